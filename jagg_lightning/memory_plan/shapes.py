"""The shapes a family's transformer sees at a configured resolution: the per-sample latent of the SDE, the token
count, and example inputs of one forward (``transformer_inputs``), for tracing on a fake model.

These mirror each family's ``latent_shape`` / ``velocity`` (``jagg_lightning/policies``) for a transformer that is
only a config (no pipeline, no weights); ``tests/unit/test_memory_plan.py`` checks them against the real policies
of the twins (the same latent shape, the same saved bytes as ``Sampler.activation_bytes``), so a family that
changes its layout fails there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Geometry:
    """What one sample is at the configured shape: ``latent`` (the SDE's per-sample shape), ``tokens`` (image or video
    tokens the transformer attends over) and ``text`` (condition tokens)."""

    family: str
    latent: tuple[int, ...]
    tokens: int
    text: int
    grid: tuple[int, ...]  # the token grid: (rows, cols), or (frames, rows, cols) for video


def geometry(family: str, config: dict, spatial: int, temporal: int, size: tuple[int, int], frames: int,
             text: int) -> Geometry:
    """The latent and token counts of ``family`` for a transformer ``config`` (its config.json), a VAE of
    ``spatial`` (and ``temporal``) compression, an image of ``size`` = (H, W) pixels, ``frames`` (video) and
    ``text`` condition tokens."""
    h, w = size[0] // spatial, size[1] // spatial
    c = int(config.get("in_channels", 16))
    if family == "sd3":
        p = int(config.get("patch_size", 2))
        return Geometry(family, (c, h, w), (h // p) * (w // p), text, (h // p, w // p))
    if family == "flux":  # 2x2-packed latents, 1x1 patches
        return Geometry(family, (c // 4, h, w), (h // 2) * (w // 2), text, (h // 2, w // 2))
    if family == "flux_kontext":  # FLUX.1's, plus the source's tokens after the latent's (fitted to the same size)
        return Geometry(family, (c // 4, h, w), 2 * (h // 2) * (w // 2), text, (h // 2, w // 2))
    if family in ("flux2", "flux2_dev"):  # the 2x2 patchified latent is the SDE's
        return Geometry(family, (c, h // 2, w // 2), (h // 2) * (w // 2), text, (h // 2, w // 2))
    if family == "qwen_image":  # packed tokens [S, 4C]
        return Geometry(family, ((h // 2) * (w // 2), c), (h // 2) * (w // 2), text, (h // 2, w // 2))
    if family == "wan":
        f = (frames - 1) // temporal + 1
        p = config.get("patch_size", (1, 2, 2))
        grid = (f // p[0], h // p[1], w // p[2])
        return Geometry(family, (c, f, h, w), grid[0] * grid[1] * grid[2], text, grid)
    if family == "ltx2":  # the joint latent: the video's packed tokens, then the audio's, ``c`` wide
        grid = ((frames - 1) // temporal + 1, h, w)  # LTX-2's 1x1x1 patches
        tokens = grid[0] * h * w + ltx2_audio_tokens(config, frames)
        return Geometry(family, (tokens, c), tokens, text, grid)
    raise ValueError(f"jagg plan: family {family!r} has no memory plan yet "
                     "(planned: sd3, flux, flux_kontext, flux2, flux2_dev, qwen_image, wan)")


def ltx2_audio_tokens(config: dict, frames: int, frame_rate: float = 24.0) -> int:
    """LTX-2's audio latent length for a clip of ``frames`` at ``frame_rate`` (``LTX2Pipeline``'s: the duration
    times the audio VAE's latents per second, sampling rate / hop length / 4, which the transformer's config holds)."""
    per_second = config.get("audio_sampling_rate", 16000) / config.get("audio_hop_length", 160) / config.get(
        "audio_scale_factor", 4)
    return round(frames / frame_rate * per_second)


def transformer_inputs(geo: Geometry, config: dict, batch: int, dtype: torch.dtype) -> dict:
    """Keyword inputs of one transformer forward over ``batch`` rows (with CFG: both branches, 2 n rows), built with
    the current tensor mode (under ``FakeTensorMode``: fake tensors, nothing allocated), as the family's
    ``velocity`` passes them."""
    n, f = batch, geo.family
    t = torch.full((n,), 0.5)
    if f == "sd3":
        return dict(hidden_states=torch.zeros(n, *geo.latent, dtype=dtype), timestep=t * 1000,
                    encoder_hidden_states=torch.zeros(n, geo.text, config["joint_attention_dim"], dtype=dtype),
                    pooled_projections=torch.zeros(n, config["pooled_projection_dim"], dtype=dtype), return_dict=False)
    if f in ("flux", "flux_kontext"):  # Kontext: geo.tokens counts the latent's and the source's
        return dict(hidden_states=torch.zeros(n, geo.tokens, config["in_channels"], dtype=dtype), timestep=t,
                    guidance=torch.full((n,), 3.5) if config.get("guidance_embeds") else None,
                    pooled_projections=torch.zeros(n, config["pooled_projection_dim"], dtype=dtype),
                    encoder_hidden_states=torch.zeros(n, geo.text, config["joint_attention_dim"], dtype=dtype),
                    txt_ids=torch.zeros(geo.text, 3, dtype=dtype), img_ids=torch.zeros(geo.tokens, 3, dtype=dtype),
                    return_dict=False)
    if f in ("flux2", "flux2_dev"):  # [dev]: the embedded guidance, float32 [n]; klein: none
        guidance = torch.full((n,), 4.0) if f == "flux2_dev" else None
        return dict(hidden_states=torch.zeros(n, geo.tokens, config["in_channels"], dtype=dtype), timestep=t,
                    guidance=guidance, encoder_hidden_states=torch.zeros(n, geo.text, config["joint_attention_dim"],
                                                                     dtype=dtype),
                    txt_ids=torch.zeros(geo.text, 4, dtype=torch.long), img_ids=torch.zeros(geo.tokens, 4, dtype=torch.long),
                    return_dict=False)
    if f == "qwen_image":
        return dict(hidden_states=torch.zeros(n, *geo.latent, dtype=dtype), timestep=t,
                    encoder_hidden_states=torch.zeros(n, geo.text, config["joint_attention_dim"], dtype=dtype),
                    encoder_hidden_states_mask=None, img_shapes=[[(1, *geo.grid)]] * n, return_dict=False)
    if f == "wan":
        return dict(hidden_states=torch.zeros(n, *geo.latent, dtype=dtype), timestep=t * 1000,
                    encoder_hidden_states=torch.zeros(n, geo.text, config["text_dim"], dtype=dtype), return_dict=False)
    if f == "ltx2":  # LTX2Policy._forward: the two streams, the connectors' embeddings of both, the mask
        video = math.prod(geo.grid)
        audio = geo.latent[0] - video
        widths = ((config["caption_channels"],) * 2 if config.get("use_prompt_embeddings", True)
                  else (config["cross_attention_dim"], config["audio_cross_attention_dim"]))
        return dict(hidden_states=torch.zeros(n, video, geo.latent[1], dtype=dtype),
                    audio_hidden_states=torch.zeros(n, audio, config["audio_in_channels"], dtype=dtype),
                    encoder_hidden_states=torch.zeros(n, geo.text, widths[0], dtype=dtype),
                    audio_encoder_hidden_states=torch.zeros(n, geo.text, widths[1], dtype=dtype),
                    timestep=t * 1000, sigma=t * 1000, encoder_attention_mask=torch.ones(n, geo.text, dtype=torch.long),
                    audio_encoder_attention_mask=torch.ones(n, geo.text, dtype=torch.long), num_frames=geo.grid[0],
                    height=geo.grid[1], width=geo.grid[2], fps=24.0, audio_num_frames=audio, use_cross_timestep=True,
                    return_dict=False)
    raise ValueError(f"jagg plan: family {f!r} has no memory plan yet")
