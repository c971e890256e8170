"""Z-Image (Tongyi-MAI): ``ZImageTransformer2DModel`` (a single-stream S3-DiT over image and caption tokens,
3-axis RoPE) with the Qwen3 prompt encoder of ``ZImagePipeline``, its CFG and its static-shift schedule.

What the family looks like (all of it stays inside this file):

* **condition** (batch-first): ``(prompt_embeds [n, L, D], prompt_mask [n, L])`` and, with CFG,
  ``(..., negative_embeds, negative_mask)``. ``ZImagePipeline.encode_prompt`` returns one tensor per prompt
  (the second-to-last hidden state of Qwen3 over its chat template, thinking on, the valid tokens only); the
  policy zero-pads them to one length with a mask and cuts them back to the same list in ``velocity``, so
  the transformer sees exactly what the pipeline gives it.
* **latent**: the VAE latent ``[C, H / 8, W / 8]`` (scaled and shifted; C = 16), the pipeline's
  ``latents=`` layout; the transformer patchifies it itself (2x2 patches, one frame).
* **time and sign**: the transformer is trained on the reversed time ``1 - t`` (the pipeline feeds
  ``(1000 - timestep) / 1000``) and predicts ``-v``; the policy does both, so ``velocity`` is dz/dt like
  every other family's.
* **guidance**: ``ZImagePipeline`` writes CFG as ``pos + w (pos - neg)`` with ``w = guidance_scale`` and
  0 = off. Here ``policy.guidance_scale`` keeps this library's convention for every family,
  v = v_u + g (v_c - v_u) with 1.0 = off, so **g = pipeline guidance_scale + 1** (the model card's 4.0 for
  Z-Image is g = 5.0; Z-Image-Turbo's 0.0 is g = 1.0). Both branches run as one batched forward, the
  combination in float32. The pipeline's ``cfg_truncation`` / ``cfg_normalization`` are used at their
  defaults (1.0 / off: no effect); other values are not reproduced.
* **times**: sigmas ``linspace(1, 1/S, S)`` through the scheduler, with ``mu = calculate_shift(image
  tokens)`` -- which a static-shift scheduler (Z-Image-Turbo's: shift 3) ignores.
* **decode**: the base class's ``AutoencoderKL`` decode (``/ scaling_factor + shift_factor``).

``build_tiny_z_image_pipeline`` builds a real ``ZImagePipeline`` offline: a one-layer transformer with one
refiner layer per stream, a two-level ``AutoencoderKL``, a 2-layer Qwen3 and the Qwen-Image twin's byte-level
tokenizer with Qwen3's chat template.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jagg_lightning.policies.base import Guidance, Policy
from jagg_lightning.policies.tiny import tiny_qwen3_config, tiny_qwen3_tokenizer

# Flow-Factory's default Z-Image LoRA targets (models/z_image/z_image.py ``default_target_modules``): the
# attention projections and the SwiGLU feed-forward of every block (refiners included: suffix match).
Z_IMAGE_LORA_TARGETS = [
    "attention.to_q",
    "attention.to_k",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
]

# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a static shift of 3.
Z_IMAGE_SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def build_tiny_z_image_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random ``ZImagePipeline`` small enough to train on 2 CPU cores (32 px -> 8 x 8 tokens)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model


    tokenizer = tiny_qwen3_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3Model(tiny_qwen3_config(tokenizer, num_layers=2)).eval()
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=16, n_layers=1, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[2, 2, 4], axes_lens=[256, 32, 32],
        )
        # diffusers zero-initialises some output layers; random values keep every path visible in the tests (on the
        # meta device, where `jagg plan` builds the twin, there are no values)
        with torch.no_grad():
            for p in transformer.parameters():
                if not p.is_meta and p.abs().sum() == 0:
                    p.normal_(0, 0.05)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=(8, 8), layers_per_block=1,
            latent_channels=4, norm_num_groups=4, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False,
        )
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER_CONFIG), vae=vae,
                          text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def _padded(embeds: list[Tensor], length: int) -> tuple[Tensor, Tensor]:
    """Per-prompt ``[L_i, D]`` tensors -> zero-padded ``[n, length, D]`` and the bool mask of valid tokens."""
    d = embeds[0].shape[-1]
    out = embeds[0].new_zeros(len(embeds), length, d)
    mask = torch.zeros(len(embeds), length, dtype=torch.bool, device=out.device)
    for i, e in enumerate(embeds):
        out[i, : len(e)] = e
        mask[i, : len(e)] = True
    return out, mask


class ZImagePolicy(Policy):
    """Frozen Z-Image parts plus a trainable peft LoRA on the transformer (see the module docstring).

    ``policy.guidance_scale`` is this library's CFG scale: ``ZImagePipeline``'s ``guidance_scale`` + 1.
    """

    family = "z_image"
    pipeline_class_name = "ZImagePipeline"
    default_lora_targets = Z_IMAGE_LORA_TARGETS

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_z_image_pipeline(seed, dtype)

    def setup(self, pipeline) -> None:
        self.transformer = pipeline.transformer
        self.vae = pipeline.vae
        self.text_encoders = nn.ModuleList([pipeline.text_encoder])
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.patch_size = self.transformer.config.all_patch_size[0]
        # the VAE's sample size (the FLUX.1 VAE Z-Image ships: 1024; the twin's: 32); the pipeline's 1024 without one
        native = self.vae.config.get("sample_size") or 1024
        self.set_size(native)

    # ------------------------------------------------------------------ shapes and schedule
    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (self.transformer.config.in_channels, self.height // self.vae_scale_factor,
                self.width // self.vae_scale_factor)

    def scheduler_kwargs(self, num_steps: int) -> dict:
        """As ``ZImagePipeline.__call__``: sigmas linspace(1, 1/S, S) and mu for the patch count."""
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

        cfg = self.scheduler.config
        tokens = (self.latent_shape[1] // self.patch_size) * (self.latent_shape[2] // self.patch_size)
        mu = calculate_shift(tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        return {"sigmas": torch.linspace(1.0, 1 / num_steps, num_steps).tolist(), "mu": mu}

    # ------------------------------------------------------------------ condition, velocity, decode
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """Through the pipeline's own ``encode_prompt`` (it rewrites the list it gets: a copy is passed)."""
        cfg = self.cfg(guidance or self.guidance())
        pe, neg = self._pipeline.encode_prompt(
            prompt=list(prompts), device=self.device, do_classifier_free_guidance=cfg,
            negative_prompt=[self.config.negative_prompt] * len(prompts),
            max_sequence_length=self.config.max_sequence_length,
        )
        longest = max(len(e) for e in list(pe) + list(neg))
        return (*_padded(pe, longest), *_padded(neg, longest)) if cfg else _padded(pe, longest)

    def _forward(self, z: Tensor, t: Tensor, embeds: Tensor, mask: Tensor) -> Tensor:
        dtype = self.transformer.dtype
        out = self.transformer(
            [x.unsqueeze(1) for x in z.to(dtype)],  # one frame: [C, 1, h, w] per sample
            1 - t,  # the reversed time the model is trained on
            [e[m] for e, m in zip(embeds.to(dtype), mask)],
            return_dict=False,
        )[0]
        return -torch.stack(out).squeeze(2)  # the model predicts -dz/dt

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...], guidance: Guidance | None = None) -> Tensor:
        """v(z, t) on ``[n, C, h, w]``, ``t`` [n] in [0, 1]; with CFG both branches in one batched forward, the
        combination v_u + g (v_c - v_u) in float32 (float64 when ``z`` is)."""
        guidance = guidance or self.guidance()
        if not self.cfg(guidance):
            pe, mask = cond
            return self._forward(z, t, pe, mask)
        pe, mask, neg, neg_mask = cond
        out = self._forward(torch.cat([z, z]), torch.cat([t, t]), torch.cat([pe, neg]), torch.cat([mask, neg_mask]))
        v_c, v_u = out.to(torch.promote_types(z.dtype, torch.float32)).chunk(2)
        return v_u + guidance.scale * (v_c - v_u)
