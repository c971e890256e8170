"""FLUX.2 [klein]: ``Flux2Transformer2DModel`` (double- and single-stream blocks, 4-axis RoPE) with the Qwen3
prompt encoder of ``Flux2KleinPipeline``, its true CFG (base models) or none (step-distilled models), and its
empirical, step-count-dependent dynamic shift.

What the family looks like (all of it stays inside this file):

* **condition** (batch-first): ``(prompt_embeds [n, L, 3 D],)`` and, with CFG, ``(..., negative_embeds)`` --
  ``Flux2KleinPipeline.encode_prompt``: Qwen3 over its chat template (no thinking), padded to
  ``max_sequence_length`` tokens, the hidden states of layers (9, 18, 27) stacked along the channel axis.
  The transformer sees every padded token (the pipeline passes no text mask), so the policy does too.
* **latent** (what the SDE sees): the pipeline's ``latents=`` layout ``[4 C, H / 2f, W / 2f]`` -- the VAE
  latent's 2x2 patches, batch-normalised with the VAE's running statistics (C = 32, f = 8: 128 channels,
  H / 16 x W / 16). The policy flattens it to ``[(H / 2f)(W / 2f), 4 C]`` tokens for the transformer and
  back, as ``_pack_latents`` / ``_unpack_latents_with_ids``: a permutation, so the Gaussian step and its
  log-density are the same in either layout. Image position ids (0, row, col, 0), text ids (0, 0, 0, l).
* **guidance**: the klein models have no guidance embedding. A *base* model (``is_distilled`` false in
  model_index.json) takes the pipeline's true CFG v_u + w (v_c - v_u) with the negative prompt (the
  pipeline's is always ""), both branches in one batched forward; a *step-distilled* model
  (``is_distilled`` true: FLUX.2-klein-4B / 9B) has guidance baked in: one forward, and a
  ``guidance_scale`` > 1 is refused (the pipeline would silently ignore it).
* **times**: sigmas ``linspace(1, 1/S, S)`` and ``mu = compute_empirical_mu(image tokens, S)`` -- BFL's fit,
  which depends on the step count as well as the resolution -- into the scheduler's exponential dynamic shift.
  The transformer gets t = sigma (the pipeline's ``timestep / 1000``).
* **decode**: ``z * sqrt(bn.running_var + eps) + bn.running_mean``, unpatchify, the VAE, [-1, 1] -> [0, 1].

``build_tiny_flux2_pipeline`` builds a real ``Flux2KleinPipeline`` offline: a 1 + 1 block transformer, a
one-level ``AutoencoderKLFlux2`` with random batch-norm statistics, a 28-layer (hidden size 16) Qwen3 so the
pipeline's default layers (9, 18, 27) exist, and the byte-level Qwen2 tokenizer of the Qwen-Image twin with a
Qwen3-style chat template.

FLUX.2 [dev] (``Flux2Pipeline``: Mistral-3 encoder, embedded guidance) is the ``flux2_dev`` family,
``policies/flux2_dev.py``: a subclass of this policy (same transformer, latent layout, schedule and decode).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from jagg_lightning.policies.base import JOINT_ATTENTION_LORA_TARGETS, Guidance, Policy, PolicyConfig
from jagg_lightning.policies.tiny import tiny_qwen3_config, tiny_qwen3_tokenizer

# Flow-Factory's default FLUX.2 [klein] LoRA targets (models/flux/flux2_klein.py ``default_target_modules``):
# both streams' attention and FFNs in the double-stream blocks, the fused qkv+MLP input projection of the
# single-stream blocks (their output projection ``attn.to_out`` is a plain Linear no ".0" name matches).
FLUX2_LORA_TARGETS = [
    *JOINT_ATTENTION_LORA_TARGETS,
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
]

# black-forest-labs/FLUX.2-klein-* scheduler/scheduler_config.json: FLUX's dynamic exponential shift; mu
# itself comes from the pipeline's compute_empirical_mu, so base/max shift and lengths are not used for it.
FLUX2_SCHEDULER_CONFIG = dict(
    base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, num_train_timesteps=1000,
    shift=3.0, time_shift_type="exponential", use_dynamic_shifting=True,
)

def tiny_flux2_transformer_and_vae(guidance_embeds: bool):
    """The twins' random 1 + 1 block ``Flux2Transformer2DModel`` and one-level ``AutoencoderKLFlux2`` (drawn from the
    caller's RNG, after its text encoder): klein's without the guidance embedding, [dev]'s with it."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=3 * 16, timestep_guidance_channels=32, mlp_ratio=2.0,
        axes_dims_rope=(2, 2, 2, 2), guidance_embeds=guidance_embeds,
    )
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=(8, 8), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
    )
    # batch-norm statistics away from (0, 1), so a missing (de)normalisation shows in the tests
    vae.bn.running_mean.copy_(0.3 * torch.randn(16))
    vae.bn.running_var.copy_(0.5 + torch.rand(16))
    return transformer, vae


def build_tiny_flux2_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, distilled: bool = False):
    """A random ``Flux2KleinPipeline`` small enough to train on 2 CPU cores (32 px -> 8 x 8 tokens of 16
    channels). ``distilled``: the step-distilled variant's flag (no CFG); default the base model's shape."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    tokenizer = tiny_qwen3_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # 28 layers: the pipeline reads hidden states 9, 18 and 27 (Qwen3-4B has 36)
        text_encoder = Qwen3ForCausalLM(tiny_qwen3_config(tokenizer, num_layers=28)).eval()
        transformer, vae = tiny_flux2_transformer_and_vae(guidance_embeds=False)
    pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                              is_distilled=distilled)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


class Flux2Policy(Policy):
    """Frozen FLUX.2 [klein] parts plus a trainable peft LoRA on the transformer (see the module docstring)."""

    family = "flux2"
    pipeline_class_name = "Flux2KleinPipeline"
    packing = 2  # 1x1 patches of 2x2-packed latents
    default_lora_targets = FLUX2_LORA_TARGETS
    # the Qwen3 layers whose hidden states make the condition (the pipeline's default text_encoder_out_layers)
    text_encoder_out_layers = (9, 18, 27)

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_flux2_pipeline(seed, dtype)

    def setup(self, pipeline) -> None:
        self.transformer = pipeline.transformer
        self.vae = pipeline.vae
        self.text_encoders = nn.ModuleList([pipeline.text_encoder])
        self.distilled = bool(pipeline.config.get("is_distilled", False))
        if self.distilled and self.config.guidance_scale != 1.0:
            raise ValueError("policy.guidance_scale must be 1.0 for a step-distilled FLUX.2 [klein] (is_distilled in "
                             f"model_index.json: guidance is baked in), got {self.config.guidance_scale}")
        self.vae_scale_factor = pipeline.vae_scale_factor
        # the VAE's sample size (the twin's 32 px); the pipeline's default (1024 px) otherwise
        native = self.vae.config.get("sample_size") or pipeline.default_sample_size * self.vae_scale_factor
        self.set_size(native)

    # ------------------------------------------------------------------ shapes and schedule
    @property
    def latent_shape(self) -> tuple[int, int, int]:
        pack = self.vae_scale_factor * 2
        return (self.transformer.config.in_channels, self.height // pack, self.width // pack)

    @property
    def image_seq_len(self) -> int:
        return self.latent_shape[1] * self.latent_shape[2]

    def scheduler_kwargs(self, num_steps: int) -> dict:
        """As ``Flux2KleinPipeline.__call__``: sigmas linspace(1, 1/S, S) and BFL's empirical mu for (tokens, S)."""
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        mu = compute_empirical_mu(image_seq_len=self.image_seq_len, num_steps=num_steps)
        if self.scheduler.config.get("use_flow_sigmas", False):
            return {"mu": mu}
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": mu}

    def cfg(self, guidance: Guidance) -> bool:
        """CFG on a base model only: a step-distilled one has its guidance baked in (one forward)."""
        return guidance.scale > 1.0 and not self.distilled

    # ------------------------------------------------------------------ condition, velocity, decode
    def _encode(self, prompts: list[str]) -> Tensor:
        embeds, _ = self._pipeline.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=self.config.max_sequence_length,
            text_encoder_out_layers=self.text_encoder_out_layers,
        )
        return embeds

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """Through the pipeline's own ``encode_prompt``; the negative prompt's embeddings with CFG (both are
        padded to ``max_sequence_length``, so they batch together)."""
        cfg = self.cfg(guidance or self.guidance())
        if not cfg:
            return (self._encode(prompts),)
        return self._encode(prompts), self._encode([self.config.negative_prompt] * len(prompts))

    @staticmethod
    def to_tokens(z: Tensor) -> Tensor:
        """``[n, 4C, h, w]`` -> ``[n, h w, 4C]`` tokens (row-major), as ``Flux2KleinPipeline._pack_latents``."""
        n, c, h, w = z.shape
        return z.reshape(n, c, h * w).permute(0, 2, 1)

    @staticmethod
    def from_tokens(tokens: Tensor, h: int, w: int) -> Tensor:
        n, _, c = tokens.shape
        return tokens.permute(0, 2, 1).reshape(n, c, h, w)

    def _ids(self, h: int, w: int, text_len: int, device) -> tuple[Tensor, Tensor]:
        """(image ids (0, row, col, 0) [h w, 4], text ids (0, 0, 0, l) [L, 4]), as the pipeline's
        ``_prepare_latent_ids`` / ``_prepare_text_ids`` (the same for every sample)."""
        zero = torch.arange(1)
        img = torch.cartesian_prod(zero, torch.arange(h), torch.arange(w), zero)
        txt = torch.cartesian_prod(zero, zero, zero, torch.arange(text_len))
        return img.to(device), txt.to(device)

    def _forward(self, z: Tensor, t: Tensor, embeds: Tensor, guidance: Tensor | None = None) -> Tensor:
        """One transformer forward; ``guidance`` [n]: the embedded guidance (FLUX.2 [dev]), None for klein."""
        n, _, h, w = z.shape
        img_ids, txt_ids = self._ids(h, w, embeds.shape[1], z.device)
        out = self.transformer(
            hidden_states=self.to_tokens(z).to(self.transformer.dtype), timestep=t, guidance=guidance,
            encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]
        return self.from_tokens(out, h, w)

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...], guidance: Guidance | None = None) -> Tensor:
        """v(z, t), ``t`` [n] in [0, 1]. With CFG (base models): both branches in one batched forward, the
        combination v_u + w (v_c - v_u) in float32 (float64 when ``z`` is)."""
        guidance = guidance or self.guidance()
        if not self.cfg(guidance):
            return self._forward(z, t, cond[0])
        pe, neg = cond
        out = self._forward(torch.cat([z, z]), torch.cat([t, t]), torch.cat([pe, neg]))
        v_c, v_u = out.to(torch.promote_types(z.dtype, torch.float32)).chunk(2)
        return v_u + guidance.scale * (v_c - v_u)

    def bn_stats(self, device, dtype) -> tuple[Tensor, Tensor]:
        """(mean, std) of the VAE's batch norm over the patchified channels, shaped [1, 4C, 1, 1]."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(device, dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(device, dtype)
        return mean, std

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Normalised patchified latents -> images [n, 3, H, W] in [0, 1], float32 (the pipeline's decode)."""
        mean, std = self.bn_stats(latents.device, latents.dtype)
        z = self._pipeline._unpatchify_latents(latents * std + mean).to(self.vae.dtype)
        images = self.vae.decode(z, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def latents_from_pipeline_output(self, latents: Tensor) -> Tensor:
        """The inverse of the pipeline's ``output_type="latent"`` post-processing (denormalise, unpatchify):
        its output in this policy's latent layout (used by the tests that compare with the pipeline)."""
        mean, std = self.bn_stats(latents.device, latents.dtype)
        return (self._pipeline._patchify_latents(latents) - mean) / std


__all__ = ["FLUX2_LORA_TARGETS", "Flux2Policy", "PolicyConfig", "build_tiny_flux2_pipeline", "tiny_qwen3_tokenizer"]
