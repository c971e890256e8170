"""HunyuanVideo 1.5 text-to-video (``hunyuan_video15``) and image-to-video (``hunyuan_video15_i2v``): a LoRA-adapted
``HunyuanVideo15Transformer3DModel``, frozen Qwen2.5-VL and ByT5 text encoders (and SigLIP for the image) and
``AutoencoderKLHunyuanVideo15``.

What the family looks like (all of it stays inside this file; ``pipeline_hunyuan_video1_5*.py`` in diffusers 0.42):

* **condition** (batch-first): ``(embeds [B, L, 3584], mask [B, L], embeds_2 [B, 256, 1472], mask_2 [B, 256])`` and,
  with CFG, the same four for ``policy.negative_prompt`` -- the pipeline's own ``encode_prompt``: Qwen2.5-VL's
  third-to-last hidden state over the chat template with the pipeline's system message, its first
  ``prompt_template_encode_start_idx`` (108) tokens dropped, ``policy.max_sequence_length`` tokens after them (the
  pipeline's ``tokenizer_max_length``, 1000); ByT5 over the prompt's quoted text (its glyphs; zeros and a zero mask
  when the prompt quotes nothing). Image-to-video appends ``(condition [B, C + 1, F', H', W'], image_embeds [B, T,
  1152])``: the image's VAE latent (the mode, times ``scaling_factor``) on the first latent frame and zeros after
  it, then one mask channel that is 1 on the first frame; SigLIP's last hidden state of the image;
* **latent**: ``[C, F', H', W']`` per sample (C = 32), F' = (F - 1) / 4 + 1, H' = H / 16, W' = W / 16 -- the
  tensor the pipelines integrate and accept as ``latents=``; the transformer sees ``cat([z, condition, mask])``
  (``in_channels`` = 2 C + 1; text-to-video: the condition and mask are zeros, as ``prepare_cond_latents_and_mask``
  makes them) and patchifies it with (1, 1, 1) patches, with 3-D RoPE over frames x height x width;
* **velocity**: the transformer's output at ``timestep = 1000 t``; with ``guidance_scale`` > 1 the pipeline's
  ``ClassifierFreeGuidance`` ``v = v_u + w (v_c - v_u)`` (both branches in one batched forward; the pipeline runs
  two, both with the same image tokens and condition latent). Text-to-video passes image tokens that are all zeros,
  which the transformer masks out (``is_t2v``). The transformer puts each row's valid context tokens first and
  masks the rest out of every attention, so padding columns that no row of the batch uses change nothing but the
  cost: they are dropped before the forward (the pipeline's 729 zero image tokens of text-to-video become one, its
  1000 + 256 text columns the batch's longest prompt);
* **times**: ``FlowMatchEulerDiscreteScheduler`` with the pipeline's ``sigmas = linspace(1, 0, N + 1)[:-1]``,
  shifted by the scheduler's ``shift`` (5 for the 480p models, 7 / 9 for 720p), then 0;
* **decode**: ``z / scaling_factor`` through the VAE, [-1, 1] -> [0, 1], as a video ``[B, F, 3, H, W]``.

The pipelines' other options are refused with a message: a guider with ``guidance_rescale`` or the original
formulation, and a MeanFlow (step-distilled) transformer (``use_meanflow``: its second timestep is the next step's).
Image-to-video prompts carry ONE condition image each, fitted to the sampled size
(:func:`jagg_lightning.models.conditions.condition_pixels`); the pipeline picks its size from the image's aspect
ratio instead (a bucket at ``target_size``), which is the same when the image already has the sampled size.

``build_tiny_hunyuan_video15_pipeline`` builds a real pipeline offline: 2-layer Qwen2.5-VL text model with the
byte-level tiny Qwen tokenizer (the system message's words one token each), a 1-layer ByT5 (ByT5's tokenizer needs no
files), a 2-block transformer, a tiny VAE with the real 16x / 4x compression, and for image-to-video a 2-layer SigLIP
vision tower (32 px, 8 px patches: 16 tokens) with its processor. 32 px, 9 frames (latents [4, 3, 2, 2]).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jagg_lightning.models.conditions import condition_pixels
from jagg_lightning.policies.base import JOINT_ATTENTION_LORA_TARGETS, Guidance, Policy
from jagg_lightning.policies.tiny import QWEN3_CHAT_TEMPLATE, tiny_qwen_tokenizer

# The joint attention of every double-stream block (video and text projections), as Flow-GRPO's MM-DiT targets; the
# suffixes also reach the token refiner's self-attention (``attn.to_q`` ...), which the diffusers loader loads alike.
HUNYUAN_VIDEO15_LORA_TARGETS = list(JOINT_ATTENTION_LORA_TARGETS)

TINY_FRAMES = 9  # -> 3 latent frames
TINY_Z_DIM = 4
TINY_SIZE = 32  # the twin's target_size: the pipeline's default 16:9 bucket at it is 32 x 32


def build_tiny_hunyuan_video15_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, i2v: bool = False):
    """A random ``HunyuanVideo15Pipeline`` (``i2v``: ``HunyuanVideo15ImageToVideoPipeline``) small enough for CPU
    tests (see the module docstring)."""
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline,
                           HunyuanVideo15Transformer3DModel)
    from transformers import (ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, SiglipImageProcessor,
                              SiglipVisionConfig, SiglipVisionModel, T5Config, T5EncoderModel)

    tokenizer = tiny_qwen_tokenizer(words_of=system_message())
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE  # Qwen2.5's, for the system and user turns the pipeline renders
    tokenizer_2 = ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
            bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id)).eval()
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=2 * TINY_Z_DIM + 1, out_channels=TINY_Z_DIM, num_attention_heads=2, attention_head_dim=12,
            num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=16, text_embed_2_dim=16,
            image_embed_dim=16, rope_axes_dim=(4, 4, 4), target_size=TINY_SIZE, task_type="i2v" if i2v else "t2v")
        vae = AutoencoderKLHunyuanVideo15(latent_channels=TINY_Z_DIM, block_out_channels=(8, 8, 8, 8, 8),
                                          layers_per_block=1, scaling_factor=1.25)
        image_parts = {}
        if i2v:
            image_parts = {"image_encoder": SiglipVisionModel(SiglipVisionConfig(
                hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                patch_size=8)).eval(), "feature_extractor": SiglipImageProcessor(size={"height": 32, "width": 32})}
    cls = HunyuanVideo15ImageToVideoPipeline if i2v else HunyuanVideo15Pipeline
    pipe = cls(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
               scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=text_encoder_2,
               tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=6.0), **image_parts)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def system_message() -> str:
    """The pipelines' system message: the default of their ``_get_mllm_prompt_embeds`` (the one ``__init__`` sets)."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default


def used_columns(*masks: Tensor) -> int:
    """How many leading columns of these [n, L] masks any row uses (at least 1: the transformer takes no empty
    context): the columns after them are padding in every row, masked out of every attention."""
    used = torch.stack([m.bool().any(0) for m in masks]).any(0).nonzero()
    return max(1, int(used.max()) + 1) if used.numel() else 1


class HunyuanVideo15Policy(Policy):
    """Frozen HunyuanVideo 1.5 parts plus a trainable peft LoRA on the transformer, or the transformer trained in full
    (see the module docstring). ``policy.num_frames`` (default 121, the twin's 9) must be 4 k + 1;
    ``policy.max_sequence_length`` is the pipeline's ``tokenizer_max_length`` (Qwen2.5-VL tokens after the template)."""

    family = "hunyuan_video15"
    pipeline_class_name = "HunyuanVideo15Pipeline"
    video = True
    default_lora_targets = HUNYUAN_VIDEO15_LORA_TARGETS
    TEXT_ENTRIES = 4  # (embeds, mask, embeds_2, mask_2) per branch

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_hunyuan_video15_pipeline(seed, dtype)

    @property
    def pipeline_class(self) -> type:
        """The class whose ``save_lora_weights`` writes the diffusers-format export. diffusers 0.42's HunyuanVideo 1.5
        pipelines have no LoRA loader, so HunyuanVideo's ``HunyuanVideoLoraLoaderMixin`` writes it (one network, keys
        ``transformer.<module>.lora_A.weight`` and the adapter's metadata, as every single-transformer export); it
        loads with ``pipe.transformer.load_lora_adapter(dir, use_safetensors=True)``."""
        from diffusers.loaders import HunyuanVideoLoraLoaderMixin

        return HunyuanVideoLoraLoaderMixin

    @classmethod
    def pixel_multiple(cls, vae_config, transformer_config) -> int:
        """The VAE's ``spatial_compression_ratio`` (16) times the transformer's patch side (1)."""
        return int(vae_config.get("spatial_compression_ratio", 16)) * int(transformer_config.get("patch_size", 1))

    def setup(self, pipeline) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        guider, cfg = pipeline.guider, pipeline.transformer.config
        if getattr(guider, "guidance_rescale", 0.0) or getattr(guider, "use_original_formulation", False):
            raise ValueError("policy.pretrained: this pipeline's guider rescales or uses the original CFG formulation; "
                             "hunyuan_video15 trains with v_u + w (v_c - v_u) (guidance_rescale 0)")
        if cfg.use_meanflow:
            raise ValueError("policy.pretrained: a MeanFlow (step-distilled) HunyuanVideo 1.5 transformer "
                             "(use_meanflow) is not supported: its second timestep is the next step's")
        if not isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError("policy.pretrained: hunyuan_video15 samples with the pipeline's "
                             f"FlowMatchEulerDiscreteScheduler, this one has {type(pipeline.scheduler).__name__}")
        self.transformer = pipeline.transformer
        self.vae = pipeline.vae
        self.text_encoders = nn.ModuleList([pipeline.text_encoder, pipeline.text_encoder_2])
        pipeline.tokenizer_max_length = self.config.max_sequence_length  # what its encode_prompt pads / truncates to
        self.temporal, self.spatial = pipeline.vae_scale_factor_temporal, pipeline.vae_scale_factor_spatial
        # the pipeline's default size: the 16:9 bucket at the transformer's target_size (480 x 848 at 640; 32 x 32)
        self.set_size(pipeline.video_processor.calculate_default_height_width(9, 16, cfg.target_size))
        frames = self.config.num_frames or (TINY_FRAMES if self.config.pretrained is None else 121)
        if (frames - 1) % self.temporal:
            raise ValueError(f"policy.num_frames must be {self.temporal} k + 1 (the VAE's temporal compression), "
                             f"got {frames}")
        self.num_frames = frames
        z = self.vae.config.latent_channels
        if cfg.in_channels != 2 * z + 1 or cfg.out_channels != z:
            raise ValueError("policy.pretrained: a HunyuanVideo 1.5 transformer takes the latent, the condition "
                             f"latent and a mask ({2 * z + 1} input channels, {z} out for the VAE's {z}); this one "
                             f"{cfg.in_channels} in, {cfg.out_channels} out")

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        frames = (self.num_frames - 1) // self.temporal + 1
        return (self.vae.config.latent_channels, frames, self.height // self.spatial, self.width // self.spatial)

    def scheduler_kwargs(self, num_steps: int) -> dict:
        """The pipeline's sigmas before the shift: ``linspace(1, 0, N + 1)[:-1]``."""
        import numpy as np

        return {"sigmas": np.linspace(1.0, 0.0, num_steps + 1)[:-1]}

    # ------------------------------------------------------------------ condition
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """Through the pipeline's own ``encode_prompt`` (see the module docstring), the negative prompt's after."""
        encode = self._pipeline.encode_prompt
        dtype = self.transformer.dtype
        text = encode(prompt=list(prompts), device=self.device, dtype=dtype, batch_size=len(prompts))
        if self.cfg(guidance or self.guidance()):
            text = (*text, *encode(prompt=[self.config.negative_prompt] * len(prompts), device=self.device,
                                   dtype=dtype, batch_size=len(prompts)))
        return (*text, *self.encode_images(prompts))

    def encode_images(self, prompts: list[str]) -> tuple[Tensor, ...]:
        """The image-to-video entries of the condition (text-to-video: none)."""
        return ()

    # ------------------------------------------------------------------ velocity
    def model_inputs(self, z: Tensor, images: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """(``cat([z, condition, mask])``, image tokens) of the pipeline: text-to-video, zeros for the condition and
        mask, and one zero image token (all of the pipeline's 729 are masked out)."""
        n, c, *rest = z.shape
        x = torch.cat([z, z.new_zeros(n, c + 1, *rest)], dim=1)
        return x, z.new_zeros(n, 1, self.transformer.config.image_embed_dim)

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...], guidance: Guidance | None = None) -> Tensor:
        """v(z, t) on latents ``[n, C, F', H', W']``, ``t`` [n] in [0, 1]: one forward of n rows, or of 2 n with CFG
        (the conditional rows first)."""
        guidance = guidance or self.guidance()
        cfg, k = self.cfg(guidance), self.TEXT_ENTRIES
        branches = [cond[:k], cond[k:2 * k]] if cfg else [cond[:k]]
        x, image = self.model_inputs(z, cond[len(branches) * k:])
        embeds, mask, embeds_2, mask_2 = (torch.cat(parts) for parts in zip(*branches))
        keep, keep_2 = used_columns(mask), used_columns(mask_2)
        dtype, rows = self.transformer.dtype, len(branches)
        # copies of the kept columns: a trained layer that saves its input then holds them, not the padded whole
        out = self.transformer(
            hidden_states=torch.cat([x] * rows).to(dtype), timestep=torch.cat([t * 1000] * rows).to(dtype),
            encoder_hidden_states=embeds[:, :keep].to(dtype, copy=True), encoder_attention_mask=mask[:, :keep],
            encoder_hidden_states_2=embeds_2[:, :keep_2].to(dtype, copy=True),
            encoder_attention_mask_2=mask_2[:, :keep_2],
            image_embeds=torch.cat([image] * rows).to(dtype), return_dict=False)[0]
        if not cfg:
            return out
        v_c, v_u = out.chunk(2)
        return v_u + guidance.scale * (v_c - v_u)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, C, F', H', W']`` -> videos ``[B, F, 3, H, W]`` in [0, 1], float32 (the pipeline's decode)."""
        z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        # one clip at a time: the VAE's attention mask is built [B, S, S] against [B, 1, S, S] heads (fails for B > 1)
        video = torch.cat([self.vae.decode(clip[None], return_dict=False)[0] for clip in z])  # [B, 3, F, H, W]
        return (video.float() / 2 + 0.5).clamp(0, 1).transpose(1, 2).contiguous()


class HunyuanVideo15I2VPolicy(HunyuanVideo15Policy):
    """HunyuanVideo 1.5 image-to-video: each prompt's one condition image is the clip's first frame (see the module
    docstring)."""

    family = "hunyuan_video15_i2v"
    pipeline_class_name = "HunyuanVideo15ImageToVideoPipeline"
    condition_images = (1, 1)

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_hunyuan_video15_pipeline(seed, dtype, i2v=True)

    def setup(self, pipeline) -> None:
        super().setup(pipeline)
        self.image_encoder, self.feature_extractor = pipeline.image_encoder, pipeline.feature_extractor

    def frozen_modules(self) -> list[nn.Module]:
        return [*super().frozen_modules(), self.image_encoder]

    def encode_images(self, prompts: list[str]) -> tuple[Tensor, ...]:
        """(condition ``[n, C + 1, F', H', W']``, SigLIP tokens ``[n, T, D]``), each image encoded alone as the
        pipeline encodes its one image."""
        pixels = condition_pixels(prompts, self.height, self.width).to(self.device)
        c, frames, h, w = self.latent_shape
        condition = pixels.new_zeros(len(prompts), c + 1, frames, h, w, dtype=self.transformer.dtype)
        condition[:, c, 0] = 1  # the mask: the first latent frame is known
        tokens = []
        for i, p in enumerate(pixels):
            image = (2.0 * p - 1.0)[None, :, None].to(self.vae.dtype)  # the pipeline's preprocess, [1, 3, 1, H, W]
            latent = self.vae.encode(image).latent_dist.mode() * self.vae.config.scaling_factor
            condition[i, :c, :1] = latent[0].to(condition.dtype)
            inputs = self.feature_extractor(images=p, do_rescale=False, return_tensors="pt").to(self.device)
            encoder_dtype = next(self.image_encoder.parameters()).dtype
            tokens.append(self.image_encoder(pixel_values=inputs.pixel_values.to(encoder_dtype)).last_hidden_state)
        return condition, torch.cat(tokens).to(self.transformer.dtype)

    def model_inputs(self, z: Tensor, images: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        condition, tokens = images
        return torch.cat([z, condition.to(z.dtype)], dim=1), tokens
