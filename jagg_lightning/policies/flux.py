"""FLUX.1: ``FluxTransformer2DModel`` (double-stream + single-stream blocks, RoPE over position ids),
CLIP-L pooled + T5 prompt encoding, the embedded guidance of FLUX.1-dev and the resolution-dependent
dynamic-shift schedule of ``FluxPipeline``.

Condition (batch-first): ``(t5_embeds [n, L, D], clip_pooled [n, P])``; there is no negative branch:
FLUX.1-dev is guidance-distilled, so ``guidance_scale`` is fed to the transformer's guidance embedding
and each velocity is ONE forward (``guided`` is False). Text position ids are zeros [L, 3], image
position ids (0, row, col) of the 2x2-packed latent grid -- both rebuilt in ``velocity``.

Latent (what the SDE sees): the VAE latent ``[C, H / f, W / f]`` (scaled and shifted), unpacked. The
policy packs it into ``FluxPipeline``'s 2x2 patches ``[(H/2f)(W/2f), 4C]`` for the transformer and
unpacks the velocity, exactly as the pipeline's ``_pack_latents`` / ``_unpack_latents``; packing is a
permutation, so the Gaussian SDE step (and its log-density) is the same in either layout.

Schedule: ``FluxPipeline`` passes sigmas ``linspace(1, 1/S, S)`` and ``mu = calculate_shift(image
sequence length)`` (base 256 -> 0.5, max 4096 -> 1.15 for FLUX.1-dev) to its scheduler; so does
:meth:`FluxPolicy.scheduler_kwargs`, so the sampling times equal the pipeline's for every resolution.

The tiny twin: a random ``FluxPipeline`` with 1 double + 1 single block, a tiny CLIP text model and a
tiny ``T5EncoderModel`` with a character-level T5 tokenizer built offline; 32 px images by default.
"""

from __future__ import annotations


import numpy as np
import torch
from torch import Tensor, nn

from jagg_lightning.policies.base import Guidance, Policy, PolicyConfig
from jagg_lightning.policies.tiny import tiny_clip_tokenizer, tiny_t5_tokenizer

# Flow-GRPO's FLUX LoRA targets (scripts/train_flux.py): attention of both streams plus both FFNs.
# The single-stream blocks' attn.to_q/k/v match too (peft matches module-name suffixes).
FLUX_LORA_TARGETS = [
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]


def build_tiny_flux_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, guidance_embeds: bool = True):
    """A random FluxPipeline small enough to train on 2 CPU cores (FLUX.1-dev shaped: guidance embeds)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_clip_tokenizer(max_length=16)
        tokenizer_2 = tiny_t5_tokenizer()
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=tokenizer.model_max_length, bos_token_id=0, eos_token_id=1, pad_token_id=1,
            hidden_act="gelu", projection_dim=16,
        ))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False, use_cache=False,
        ))
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=guidance_embeds, axes_dims_rope=(2, 2, 4),
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=(8, 8), layers_per_block=1,
            latent_channels=4, norm_num_groups=4, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False,
        )
    # FLUX.1-dev's scheduler configuration
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


class FluxPolicy(Policy):
    """Frozen FLUX.1 parts plus a trainable peft LoRA on the transformer (see the module docstring)."""

    family = "flux"
    pipeline_class_name = "FluxPipeline"
    packing = 2  # 1x1 patches of 2x2-packed latents
    default_lora_targets = FLUX_LORA_TARGETS

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_flux_pipeline(seed, dtype)

    @classmethod
    def load_pipeline(cls, pretrained: str, dtype: torch.dtype, config: PolicyConfig):
        import diffusers

        pipeline_class = getattr(diffusers, cls.pipeline_class_name)  # FluxPipeline, FluxKontextPipeline
        index = pipeline_class.load_config(pretrained)
        absent = {name: None for name in ("image_encoder", "feature_extractor")
                  if name not in index or index[name][0] is None}
        return pipeline_class.from_pretrained(pretrained, torch_dtype=dtype, **absent)

    def setup(self, pipeline) -> None:
        self.transformer = pipeline.transformer
        self.vae = pipeline.vae
        self.text_encoders = nn.ModuleList([m for m in (pipeline.text_encoder, pipeline.text_encoder_2) if m is not None])
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_channels = self.transformer.config.in_channels // 4
        # the VAE's sample size (1024 for FLUX.1, 32 for the tiny twin); FluxPipeline's own default otherwise
        native = self.vae.config.get("sample_size") or pipeline.default_sample_size * self.vae_scale_factor
        self.set_size(native)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (self.latent_channels, self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)

    @property
    def image_seq_len(self) -> int:
        return (self.latent_shape[1] // 2) * (self.latent_shape[2] // 2)

    def scheduler_kwargs(self, num_steps: int) -> dict:
        """As ``FluxPipeline.__call__``: sigmas linspace(1, 1/S, S) and mu for the image sequence length."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        cfg = self.scheduler.config
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if cfg.get("use_flow_sigmas", False):
            sigmas = None
        mu = calculate_shift(self.image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        return {"mu": mu} if sigmas is None else {"sigmas": sigmas, "mu": mu}

    def cfg(self, guidance: Guidance) -> bool:
        """Never: FLUX.1-dev's guidance is embedded (one forward, no negative branch)."""
        return False

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """(T5 embeddings, CLIP pooled) through the pipeline's own ``encode_prompt``."""
        pe, pooled, _ = self._pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.config.max_sequence_length,
        )
        return pe, pooled

    def pack(self, z: Tensor) -> Tensor:
        n, c, h, w = z.shape
        return z.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, (h // 2) * (w // 2), c * 4)

    def unpack(self, packed: Tensor, h: int, w: int) -> Tensor:
        n, _, d = packed.shape
        return packed.view(n, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, d // 4, h, w)

    def position_ids(self, h: int, w: int, device, dtype) -> Tensor:
        """Image position ids (0, row, col) of the packed grid, as ``FluxPipeline._prepare_latent_image_ids``."""
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        return ids.reshape(-1, 3).to(device=device, dtype=dtype)

    def transformer_tokens(self, z: Tensor, cond: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """The tokens the transformer sees and their position ids: the packed latent (Kontext appends its source)."""
        n, _, h, w = z.shape
        return self.pack(z.to(self.transformer.dtype)), self.position_ids(h, w, z.device, cond[0].dtype)

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...], guidance: Guidance | None = None) -> Tensor:
        """v(z, t): one forward with the embedded guidance ``guidance_scale`` (FLUX.1-dev); ``t`` [n] in [0, 1]; the
        output on the latent's own tokens, unpacked."""
        pe, pooled = cond[:2]
        n, _, h, w = z.shape
        tokens, ids = self.transformer_tokens(z, cond)
        embedded = None
        if self.transformer.config.guidance_embeds:
            embedded = torch.full([n], (guidance or self.guidance()).scale, device=z.device, dtype=torch.float32)
        out = self.transformer(
            hidden_states=tokens, timestep=t, guidance=embedded, pooled_projections=pooled,
            encoder_hidden_states=pe, txt_ids=torch.zeros(pe.shape[1], 3, device=z.device, dtype=pe.dtype),
            img_ids=ids, return_dict=False,
        )[0]
        return self.unpack(out[:, : (h // 2) * (w // 2)], h, w)
