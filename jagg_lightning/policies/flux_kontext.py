"""FLUX.1 Kontext: image editing with ``FluxKontextPipeline`` -- FLUX.1's transformer, prompt encoding, embedded
guidance and dynamic-shift schedule (:mod:`jagg_lightning.policies.flux`), plus the source image as tokens.

Each prompt carries one condition image (:class:`jagg_lightning.models.conditions.ConditionedPrompt`). As the pipeline
does, the source is encoded once by the VAE (the distribution's mode, then shifted and scaled), packed into the same
2x2 patches as the latent, and its tokens are appended after the sampled latent's along the sequence, with position
ids (1, row, col) -- the latent's are (0, row, col). The transformer sees both; the velocity is its output on the
latent's tokens only (the pipeline's ``noise_pred[:, : latents.size(1)]``).

Condition (batch-first): ``(t5_embeds [n, L, D], clip_pooled [n, P], source_tokens [n, S, 4 C])``: the source's
tokens travel with the prompt's embeddings, so the rollout, the anchors, the fused mode and the KL reference repeat
and slice them per sample like any condition. They are frozen (encoded without gradient).

Size: the source is fitted to the size sampled (``policy.resolution``: centre-cropped to its aspect ratio, then
bicubic; :func:`jagg_lightning.models.conditions.condition_pixels`) -- as the pipeline with ``_auto_resize=False`` and that
height and width, and as Flow-GRPO's Kontext script, which crops and resizes its sources to the training size.
So S equals the latent's own token count. Guidance: FLUX.1 Kontext [dev] is guidance-distilled (embedded guidance,
one forward); the pipeline's true CFG (``true_cfg_scale`` with a negative prompt) is not supported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagg_lightning.models.conditions import condition_pixels
from jagg_lightning.policies.base import Guidance
from jagg_lightning.policies.flux import FluxPolicy, build_tiny_flux_pipeline


def build_tiny_flux_kontext_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random FluxKontextPipeline: the tiny FLUX twin's parts (FLUX.1-dev shaped: guidance embeds)."""
    from diffusers import FluxKontextPipeline

    parts = build_tiny_flux_pipeline(seed, dtype).components
    return FluxKontextPipeline(**parts)


class FluxKontextPolicy(FluxPolicy):
    """Frozen FLUX.1 Kontext parts plus a trainable LoRA on the transformer (see the module docstring)."""

    family = "flux_kontext"
    pipeline_class_name = "FluxKontextPipeline"
    condition_images = (1, 1)

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_flux_kontext_pipeline(seed, dtype)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """(T5 embeddings, CLIP pooled, the source's packed latent tokens)."""
        pe, pooled = super().encode_prompts(prompts, guidance)
        pixels = condition_pixels(prompts, self.height, self.width).to(self.device, self.vae.dtype)
        latents = self.vae.encode(pixels * 2 - 1).latent_dist.mode()  # the pipeline's sample_mode="argmax"
        cfg = self.vae.config
        latents = (latents - cfg.shift_factor) * cfg.scaling_factor
        return pe, pooled, self.pack(latents.to(pe.dtype))

    def transformer_tokens(self, z: Tensor, cond: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """The latent's packed tokens followed by the source's, and their position ids (the source's first axis 1)."""
        _, _, source = cond
        n, _, h, w = z.shape
        ids = self.position_ids(h, w, z.device, source.dtype)
        source_ids = ids.clone()
        source_ids[:, 0] = 1
        tokens = torch.cat([self.pack(z.to(self.transformer.dtype)), source.to(self.transformer.dtype)], dim=1)
        return tokens, torch.cat([ids, source_ids], dim=0)
