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
    source: tuple[int, ...] = ()  # Qwen-Image-Edit: the source's token grid, its tokens after the latent's in `tokens`
    image: int = 0  # Wan2.1 I2V: the CLIP image tokens beside the text (the transformer's image embedding);
    # HunyuanVideo 1.5: SigLIP's (image-to-video) or the one zero token text-to-video passes
    glyph: int = 0  # HunyuanVideo 1.5: ByT5's glyph tokens beside Qwen2.5-VL's ``text``


def geometry(family: str, config: dict, spatial: int, temporal: int, size: tuple[int, int], frames: int,
             text: int, condition: dict | None = None) -> Geometry:
    """The latent and token counts of ``family`` for a transformer ``config`` (its config.json), a VAE of
    ``spatial`` (and ``temporal``) compression, an image of ``size`` = (H, W) pixels, ``frames`` (video), ``text``
    condition tokens and the family's ``condition`` (``ModelSpec.condition``: what its condition images become)."""
    h, w = size[0] // spatial, size[1] // spatial
    c = int(config.get("in_channels", 16))
    condition = condition or {}
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
    if family == "qwen_image_edit":  # Qwen-Image's, plus the source's packed tokens (about a megapixel) after them
        rows, cols = source_grid(size, spatial, condition["source_area"])
        return Geometry(family, ((h // 2) * (w // 2), c), (h // 2) * (w // 2) + rows * cols, text, (h // 2, w // 2),
                        source=(rows, cols))
    if family == "z_image":  # the latent [C, H', W'], patchified by the transformer
        p = int(config.get("all_patch_size", (2,))[0])
        return Geometry(family, (c, h, w), (h // p) * (w // p), text, (h // p, w // p))
    if family == "wan":
        f = (frames - 1) // temporal + 1
        p = config.get("patch_size", (1, 2, 2))
        grid = (f // p[0], h // p[1], w // p[2])
        return Geometry(family, (c, f, h, w), grid[0] * grid[1] * grid[2], text, grid)
    if family in ("ltx2", "ltx2_i2v"):  # the joint latent: the video's packed tokens, then the audio's, ``c`` wide
        grid = ((frames - 1) // temporal + 1, h, w)  # LTX-2's 1x1x1 patches
        tokens = grid[0] * h * w + ltx2_audio_tokens(config, frames)
        held = h * w if family == "ltx2_i2v" else 0  # image-to-video: the first frame's tokens, not sampled
        return Geometry(family, (tokens - held, c), tokens, text, grid)
    if family in ("wan_i2v", "wan22_ti2v"):  # the transformer sees more than the SDE samples
        f, p = (frames - 1) // temporal + 1, config.get("patch_size", (1, 2, 2))
        grid = (f // p[0], h // p[1], w // p[2])
        c = int(config.get("out_channels") or c)  # I2V: in_channels = C + mask + the image's latent
        # TI2V: the image's latent is the first latent frame, the SDE samples the others
        latent = (c, f - 1, h, w) if family == "wan22_ti2v" else (c, f, h, w)
        return Geometry(family, latent, grid[0] * grid[1] * grid[2], text, grid, image=condition.get("image_tokens", 0) if config.get("image_dim") else 0)
    if family in HUNYUAN_VIDEO15:  # [C, F', H', W']; the transformer sees it with the condition latent and mask
        grid = ((frames - 1) // temporal + 1, h, w)
        patch = (int(config.get("patch_size_t", 1)), *(int(config.get("patch_size", 1)),) * 2)
        tokens = math.prod(g // p for g, p in zip(grid, patch))
        return Geometry(family, (int(config.get("out_channels") or c), *grid), tokens, text, grid,
                        image=condition.get("image_tokens", 1), glyph=condition.get("glyph_tokens", 0))
    raise ValueError(f"jagg plan: family {family!r} has no memory plan yet")


HUNYUAN_VIDEO15 = ("hunyuan_video15", "hunyuan_video15_i2v")


def source_grid(size: tuple[int, int], spatial: int, area: int) -> tuple[int, int]:
    """(rows, cols) of Qwen-Image-Edit's packed source tokens for a sampled ``size`` = (H, W): the pipeline resizes
    every source to ``calculate_dimensions(area, W / H)`` (about ``area`` pixels, sides multiples of 32) whatever size
    is sampled, then the VAE (``spatial``) and the 2x2 packing."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(area, size[1] / size[0])
    return height // (2 * spatial), width // (2 * spatial)


def vision_tokens(size: tuple[int, int], condition: dict) -> int:
    """Qwen2.5-VL's merged image tokens for Qwen-Image-Edit's source at a sampled ``size`` (H, W): the source at
    ``calculate_dimensions`` size through the processor's ``smart_resize`` (patch x merge pixels per token, the
    processor's min / max pixels) -- plus ``<|vision_start|>`` and ``<|vision_end|>``."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    width, height, _ = calculate_dimensions(condition["source_area"], size[1] / size[0])
    factor = condition["vision_patch"] * condition["vision_merge"]
    rows, cols = smart_resize(height, width, factor=factor, min_pixels=condition["vision_min_pixels"],
                              max_pixels=condition["vision_max_pixels"])
    return (rows // factor) * (cols // factor) + 2


def condition_images(geo: Geometry, config: dict, itemsize: int) -> tuple[int, str]:
    """(bytes per sample, what) of the condition's image entries beside the text, as the family's ``encode_prompts``
    keeps them for the whole step (frozen, once per sample: both CFG branches share them): Kontext's and
    Qwen-Image-Edit's source tokens, Wan2.1 I2V's mask + image latent [4 + C, F', H', W'] (float32, as the pipeline
    normalises it) and CLIP tokens, TI2V's image latent frame (float32). ``itemsize``: the condition's dtype."""
    f, c = geo.family, int(config.get("in_channels", 16))
    if f == "flux_kontext":
        return geo.tokens // 2 * c * itemsize, f"the source's {geo.tokens // 2} tokens x {c}"
    if f == "qwen_image_edit":
        rows, cols = geo.source
        return rows * cols * c * itemsize, f"the source's {rows * cols} tokens x {c}"
    if f == "wan_i2v":
        channels, frames, h, w = config["in_channels"] - geo.latent[0], *geo.latent[1:]
        image = geo.image * int(config.get("image_dim") or 0)
        return (channels * frames * h * w * 4 + image * itemsize,
                f"the image's mask + latent [{channels}, {frames}, {h}, {w}]" + (f", {geo.image} CLIP tokens" if image
                                                                                  else ""))
    if f == "ltx2_i2v":  # the first frame's packed tokens (float32, as the pipeline normalises them)
        held = geo.tokens - geo.latent[0]
        return held * geo.latent[1] * 4, f"the image's first-frame tokens [{held}, {geo.latent[1]}]"
    if f == "hunyuan_video15_i2v":  # the condition latent + mask [C + 1, F', H', W'] and SigLIP's tokens
        channels, tokens = geo.latent[0] + 1, geo.image * int(config["image_embed_dim"])
        return ((channels * math.prod(geo.latent[1:]) + tokens) * itemsize,
                f"the image's latent + mask [{channels}, {', '.join(map(str, geo.latent[1:]))}], {geo.image} SigLIP "
                f"tokens")
    if f == "wan22_ti2v":
        return geo.latent[0] * math.prod(geo.latent[2:]) * 4, f"the image's latent frame [{geo.latent[0]}, 1, " \
            f"{geo.latent[2]}, {geo.latent[3]}]"
    return 0, ""


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
    if f in ("qwen_image", "qwen_image_edit"):  # Edit: the latent's tokens followed by the source's, both grids
        shapes = [(1, *geo.grid)] + ([(1, *geo.source)] if geo.source else [])
        return dict(hidden_states=torch.zeros(n, geo.tokens, config["in_channels"], dtype=dtype), timestep=t,
                    encoder_hidden_states=torch.zeros(n, geo.text, config["joint_attention_dim"], dtype=dtype),
                    encoder_hidden_states_mask=None, img_shapes=[shapes] * n, return_dict=False)
    if f == "z_image":  # per-sample lists: one frame [C, 1, H', W'] and the prompt's valid tokens
        return dict(x=[torch.zeros(geo.latent[0], 1, *geo.latent[1:], dtype=dtype) for _ in range(n)], t=t,
                    cap_feats=[torch.zeros(geo.text, config["cap_feat_dim"], dtype=dtype) for _ in range(n)],
                    return_dict=False)
    if f == "wan":
        return dict(hidden_states=torch.zeros(n, *geo.latent, dtype=dtype), timestep=t * 1000,
                    encoder_hidden_states=torch.zeros(n, geo.text, config["text_dim"], dtype=dtype), return_dict=False)
    if f in ("ltx2", "ltx2_i2v"):  # LTX2Policy._forward: the two streams, the connectors' embeddings of both, the mask
        video = math.prod(geo.grid)
        audio = geo.tokens - video
        held = geo.tokens - geo.latent[0]  # image-to-video: the first frame's tokens first, at timestep 0
        video_timestep = torch.cat([torch.zeros(n, held), (t * 1000)[:, None].expand(n, video - held)], dim=1) \
            if held else t * 1000
        widths = ((config["caption_channels"],) * 2 if config.get("use_prompt_embeddings", True)
                  else (config["cross_attention_dim"], config["audio_cross_attention_dim"]))
        return dict(hidden_states=torch.zeros(n, video, geo.latent[1], dtype=dtype),
                    audio_hidden_states=torch.zeros(n, audio, config["audio_in_channels"], dtype=dtype),
                    encoder_hidden_states=torch.zeros(n, geo.text, widths[0], dtype=dtype),
                    audio_encoder_hidden_states=torch.zeros(n, geo.text, widths[1], dtype=dtype),
                    timestep=video_timestep, audio_timestep=t * 1000, sigma=t * 1000,
                    encoder_attention_mask=torch.ones(n, geo.text, dtype=torch.long),
                    audio_encoder_attention_mask=torch.ones(n, geo.text, dtype=torch.long), num_frames=geo.grid[0],
                    height=geo.grid[1], width=geo.grid[2], fps=24.0, audio_num_frames=audio, use_cross_timestep=True,
                    return_dict=False)
    if f in HUNYUAN_VIDEO15:  # HunyuanVideo15Policy.velocity: [z, condition, mask], every context token valid (the
        # bound: the policy drops only columns no row uses); image tokens of zeros (text-to-video) or of ones
        image = (torch.ones if f == "hunyuan_video15_i2v" else torch.zeros)(n, geo.image, config["image_embed_dim"],
                                                                             dtype=dtype)
        return dict(hidden_states=torch.zeros(n, config["in_channels"], *geo.latent[1:], dtype=dtype),
                    timestep=(t * 1000).to(dtype),
                    encoder_hidden_states=torch.zeros(n, geo.text, config["text_embed_dim"], dtype=dtype),
                    encoder_attention_mask=torch.ones(n, geo.text, dtype=torch.long),
                    encoder_hidden_states_2=torch.zeros(n, geo.glyph, config["text_embed_2_dim"], dtype=dtype),
                    encoder_attention_mask_2=torch.ones(n, geo.glyph, dtype=torch.long), image_embeds=image,
                    return_dict=False)
    if f in ("wan_i2v", "wan22_ti2v"):  # what WanI2VPolicy / Wan22TI2VPolicy hand the expert
        c, frames, h, w = geo.latent
        text = torch.zeros(n, geo.text, config["text_dim"], dtype=dtype)
        if f == "wan22_ti2v":  # the image's latent frame first; per-token timesteps, 0 on its tokens
            tokens = geo.grid[1] * geo.grid[2]
            timestep = torch.cat([torch.zeros(n, tokens), torch.full((n, frames * tokens), 500.0)], dim=1)
            return dict(hidden_states=torch.zeros(n, c, frames + 1, h, w, dtype=dtype), timestep=timestep,
                        encoder_hidden_states=text, return_dict=False)
        image = torch.zeros(n, geo.image, config["image_dim"], dtype=dtype) if geo.image else None
        return dict(hidden_states=torch.zeros(n, config["in_channels"], frames, h, w, dtype=dtype), timestep=t * 1000,
                    encoder_hidden_states=text, encoder_hidden_states_image=image, return_dict=False)
    raise ValueError(f"jagg plan: family {f!r} has no memory plan yet")
