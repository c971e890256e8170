"""Qwen-Image: a LoRA-adapted ``QwenImageTransformer2DModel`` with its frozen Qwen2.5-VL prompt encoder and VAE.

What the family looks like (all of it stays inside this file):

* **condition** (batch-first): ``(prompt_embeds [B, L, D], prompt_mask [B, L])`` and, with true CFG,
  ``(..., negative_embeds [B, L, D], negative_mask [B, L])`` -- the last hidden state of Qwen2.5-VL over the
  pipeline's chat template with its first ``prompt_template_encode_start_idx`` (34) tokens dropped, exactly
  ``QwenImagePipeline.encode_prompt``; prompt and negative are zero-padded to one length L with the mask
  marking the valid tokens (padding is masked out of the joint attention, so it changes nothing);
* **latent**: the pipeline's packed layout ``[S, 4 C]`` -- 2x2 patches of the C = 16 channel VAE latent,
  S = (H / 16) (W / 16) tokens -- the tensor ``QwenImagePipeline`` integrates and accepts as ``latents=``;
* **velocity**: the transformer's output with ``img_shapes`` for the RoPE grid and, when
  ``guidance_scale`` > 1, the pipeline's *true* CFG (two text conditions, one batched forward):
  ``v = v_u + w (v_c - v_u)`` rescaled per token to the norm of ``v_c`` over the channel axis,
  ``v <- v * ||v_c|| / ||v||``, computed in float32 (float64 when the latents are);
* **times**: the pipeline's own ``FlowMatchEulerDiscreteScheduler`` -- ``sigmas = linspace(1, 1/N, N)``,
  dynamic (exponential) shift with ``mu = calculate_shift(S)`` for the image's sequence length, stretched to
  end at ``shift_terminal`` = 0.02, then 0;
* **decode**: unpack, ``z * latents_std + latents_mean`` (per channel, from the VAE config), the 3-D VAE's
  decode on a one-frame video, first frame, [-1, 1] -> [0, 1].

``build_tiny_qwen_image_pipeline`` builds a real ``QwenImagePipeline`` offline from tiny random configs:
the diffusers transformer and VAE, a 2-layer ``Qwen2_5_VLForConditionalGeneration`` and a byte-level
``Qwen2Tokenizer`` whose merges make every word of the prompt template one token, so the template's
system prefix is the same 34 tokens the pipeline drops from the real tokenizer's output.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from jagg_lightning.policies.base import JOINT_ATTENTION_LORA_TARGETS, Guidance, Policy
from jagg_lightning.policies.tiny import QWEN_VISION_TOKENS, tiny_qwen_tokenizer

# LoRA on the joint attention of both streams and on both streams' MLPs: the target set of the Flow-GRPO
# Qwen-Image recipes (verl's flowgrpo_trainer Qwen-Image example: r 64 / alpha 128 on these modules).
QWEN_IMAGE_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS + [
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
]

# Qwen/Qwen-Image scheduler/scheduler_config.json: dynamic exponential shift between sequence lengths 256 and
# 8192 (mu from 0.5 to 0.9), schedule stretched to end at 0.02.
QWEN_IMAGE_SCHEDULER_CONFIG = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    invert_sigmas=False,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    stochastic_sampling=False,
    time_shift_type="exponential",
    use_beta_sigmas=False,
    use_dynamic_shifting=True,
    use_exponential_sigmas=False,
    use_karras_sigmas=False,
)

def build_tiny_qwen_image_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random ``QwenImagePipeline`` small enough to train on 2 CPU cores (32 px images -> 8 x 8 packed tokens)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    tokenizer = tiny_qwen_tokenizer()
    vae = dict(base_dim=8, dim_mult=[1, 2], temperal_downsample=[False])
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
                             tokenizer=tokenizer, **tiny_qwen_image_parts(seed, tokenizer, vae))
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def tiny_qwen_image_parts(seed: int, tokenizer, vae: dict) -> dict:
    """The tiny twins' random networks: a 2-layer ``Qwen2_5_VLForConditionalGeneration`` (with a one-block vision
    tower) for ``tokenizer``, the Qwen-Image transformer and a 4-channel ``AutoencoderKLQwenImage`` (``vae``: its
    base_dim, dim_mult and temperal_downsample, which set the spatial factor 2 ** len(temperal_downsample)). The
    vision token ids are the tokenizer's when it has them (Qwen-Image-Edit's), else ids past its vocabulary."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    n = len(tokenizer)
    vision_ids = [n + i if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id) else
                  tokenizer.convert_tokens_to_ids(t) for i, t in enumerate(QWEN_VISION_TOKENS)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_config = dict(
            vocab_size=n, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=2048,
            # multimodal RoPE: sections (temporal, height, width) sum to head_dim / 2 = 4
            rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
            bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )
        vision_config = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                             fullatt_block_indexes=[0])
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=text_config, vision_config=vision_config, vision_start_token_id=vision_ids[0],
            vision_end_token_id=vision_ids[1], image_token_id=vision_ids[2], video_token_id=vision_ids[3],
        )).eval()
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
        )
        vae = AutoencoderKLQwenImage(z_dim=4, num_res_blocks=1, latents_mean=[0.1, -0.2, 0.05, 0.3],
                                     latents_std=[1.5, 0.8, 1.2, 2.0], **vae)
    return {"text_encoder": text_encoder, "transformer": transformer, "vae": vae}


def calculate_shift(image_seq_len: int, scheduler_config) -> float:
    """``mu`` of the dynamic shift for a sequence length: the line through (base_len, base_shift) and
    (max_len, max_shift) that ``QwenImagePipeline`` evaluates, with the scheduler config's values."""
    get = scheduler_config.get
    base_len, max_len = get("base_image_seq_len", 256), get("max_image_seq_len", 4096)
    base_shift, max_shift = get("base_shift", 0.5), get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + base_shift - slope * base_len


def _padded(embeds: Tensor, mask: Tensor | None, length: int) -> tuple[Tensor, Tensor]:
    """Zero-pad ``[B, L, D]`` embeddings (and their mask; None = all valid) to ``length`` tokens."""
    b, n, d = embeds.shape
    if mask is None:
        mask = torch.ones(b, n, dtype=torch.long, device=embeds.device)
    if n < length:
        embeds = torch.cat([embeds, embeds.new_zeros(b, length - n, d)], dim=1)
        mask = torch.cat([mask, mask.new_zeros(b, length - n)], dim=1)
    return embeds, mask


class QwenImagePolicy(Policy):
    """Frozen Qwen-Image parts plus a trainable peft LoRA on the transformer (see the module docstring).

    ``policy.guidance_scale`` is the pipeline's ``true_cfg_scale`` (1.0 = off: one forward, no negative).
    """

    family = "qwen_image"
    pipeline_class_name = "QwenImagePipeline"
    default_lora_targets = QWEN_IMAGE_LORA_TARGETS
    tiny_size = 32  # the tiny twin's native side in pixels (policy.pretrained null)

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_qwen_image_pipeline(seed, dtype)

    def setup(self, pipeline) -> None:
        self.transformer = pipeline.transformer
        self.vae = pipeline.vae
        self.text_encoders = nn.ModuleList([pipeline.text_encoder])
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.latent_channels = self.transformer.config.in_channels // 4
        # None: the tiny twin's size, or the pipeline's default (1024 px for Qwen-Image)
        default = pipeline.default_sample_size * self.vae_scale_factor
        native = self.tiny_size if self.config.pretrained is None else default
        self.set_size(native)

    # ------------------------------------------------------------------ shapes and schedule
    @property
    def grid(self) -> tuple[int, int]:
        """(rows, cols) of the packed token grid."""
        pack = self.vae_scale_factor * 2
        return self.height // pack, self.width // pack

    @property
    def latent_shape(self) -> tuple[int, int]:
        rows, cols = self.grid
        return (rows * cols, 4 * self.latent_channels)

    def scheduler_kwargs(self, num_steps: int) -> dict:
        """As ``QwenImagePipeline``: ``sigmas = linspace(1, 1/N, N)`` and ``mu`` for the packed sequence length."""
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps),
                "mu": calculate_shift(self.latent_shape[0], self.scheduler.config)}

    # ------------------------------------------------------------------ condition, velocity, decode
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """Through the pipeline's own ``encode_prompt`` (template, drop of the system prefix, truncation to
        ``max_sequence_length``); prompt and negative zero-padded to one length with their masks."""
        return self.encode_text(list(prompts), self.cfg(guidance or self.guidance()))

    def encode_text(self, prompts: list[str], cfg: bool, **kwargs) -> tuple[Tensor, ...]:
        """``(embeds, mask)`` (and the negative's with ``cfg``) of the pipeline's ``encode_prompt`` with ``kwargs``
        (Qwen-Image-Edit: ``image=``), zero-padded to one length."""
        length = self.config.max_sequence_length
        pe, mask = self._pipeline.encode_prompt(prompt=prompts, device=self.device, max_sequence_length=length,
                                                **kwargs)
        if not cfg:
            return _padded(pe, mask, pe.shape[1])
        neg, neg_mask = self._pipeline.encode_prompt(
            prompt=[self.config.negative_prompt] * len(prompts), device=self.device, max_sequence_length=length,
            **kwargs)
        longest = max(pe.shape[1], neg.shape[1])
        return (*_padded(pe, mask, longest), *_padded(neg, neg_mask, longest))

    def transformer_input(self, z: Tensor, extra: tuple[Tensor, ...]) -> tuple[Tensor, list]:
        """The image tokens the transformer gets for packed latents ``z`` and their ``img_shapes`` (the RoPE grids),
        ``extra`` being the condition's entries after the text's (none here; Qwen-Image-Edit: the source's tokens)."""
        return z, [[(1, *self.grid)]] * z.shape[0]

    def _forward(self, z: Tensor, t: Tensor, embeds: Tensor, mask: Tensor, extra: tuple[Tensor, ...] = ()) -> Tensor:
        dtype = self.transformer.dtype
        tokens, img_shapes = self.transformer_input(z, extra)
        return self.transformer(
            hidden_states=tokens.to(dtype), timestep=t, encoder_hidden_states=embeds.to(dtype),
            # all-valid masks go in as None, as the pipeline passes them (the unmasked attention kernel)
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=img_shapes, return_dict=False,
        )[0][:, : z.shape[1]]  # the latent's tokens (the pipeline's noise_pred[:, : latents.size(1)])

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...], guidance: Guidance | None = None) -> Tensor:
        """v(z, t) on packed latents ``[n, S, 4C]``, ``t`` [n] in [0, 1] (the pipeline's ``timestep / 1000``).
        With guidance: the pipeline's true CFG with its per-token norm rescale, one batched forward for both
        branches, the combination in float32 (float64 when ``z`` is)."""
        guidance = guidance or self.guidance()
        if not self.cfg(guidance):
            pe, mask, *extra = cond
            return self._forward(z, t, pe, mask, tuple(extra))
        pe, mask, neg, neg_mask, *extra = cond
        out = self._forward(torch.cat([z, z]), torch.cat([t, t]), torch.cat([pe, neg]), torch.cat([mask, neg_mask]),
                            tuple(torch.cat([e, e]) for e in extra))
        v_c, v_u = out.to(torch.promote_types(z.dtype, torch.float32)).chunk(2)
        v = v_u + guidance.scale * (v_c - v_u)
        norm = torch.linalg.vector_norm
        return v * (norm(v_c, dim=-1, keepdim=True) / norm(v, dim=-1, keepdim=True))

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Packed latents -> images [B, 3, H, W] in [0, 1], float32."""
        cfg = self.vae.config
        z = self._pipeline._unpack_latents(latents, self.height, self.width, self.vae_scale_factor)
        z = z.to(self.vae.dtype)
        mean = torch.tensor(cfg.latents_mean, dtype=z.dtype, device=z.device).view(1, cfg.z_dim, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, dtype=z.dtype, device=z.device).view(1, cfg.z_dim, 1, 1, 1)
        images = self.vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)
