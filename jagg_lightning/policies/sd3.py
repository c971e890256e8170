"""Stable Diffusion 3 / 3.5: ``SD3Transformer2DModel`` with joint attention, CLIP-L + CLIP-G (+ T5)
prompt encoding, classifier-free guidance (both branches in one batched forward), a static-shift flow-match
schedule.

SD3.5 is the same family: its transformer adds ``dual_attention_layers`` (MMDiT-X: a second,
image-only attention ``attn2`` in the first layers) and ``qk_norm="rms_norm"``; the LoRA targets
below name the joint-attention projections of both streams, which every SD3 / SD3.5 block has.

Condition (batch-first): ``(prompt_embeds [n, L, D], pooled [n, P])`` plus, with guidance,
``(negative_prompt_embeds, negative_pooled)``. Latent: ``[C, H / 8, W / 8]`` (the VAE's scaled,
shifted latent), patchified inside the transformer.

With ``pretrained`` None the tiny twin is a real random ``StableDiffusion3Pipeline`` (no T5, 32 px
images, character-level CLIP tokenizers built offline); ``build_tiny_sd3_pipeline`` adds a T5 that
outputs zeros, so a saved twin loads back through ``pretrained`` with identical velocities.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jagg_lightning.policies.base import JOINT_ATTENTION_LORA_TARGETS, Guidance, Policy, PolicyConfig
from jagg_lightning.policies.tiny import tiny_clip_tokenizer

# Flow-GRPO's SD3 LoRA targets: the joint-attention projections of both streams.
SD3_LORA_TARGETS = list(JOINT_ATTENTION_LORA_TARGETS)


def tiny_zero_t5(d_model: int):
    """A one-layer T5 encoder whose final norm is zero, so it outputs exactly the zeros the SD3 pipeline
    uses without a T5 -- present only so the saved pipeline has every component ``from_pretrained`` expects."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(c, -1.0) for c in sorted(ByteLevel.alphabet())]
    backend = Tokenizer(models.Unigram(vocab, unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer = T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                extra_ids=0)
    encoder = T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=d_model, d_kv=8, d_ff=16, num_layers=1,
                                      num_heads=2))
    with torch.no_grad():
        encoder.encoder.final_layer_norm.weight.zero_()
    return encoder, tokenizer


def build_tiny_sd3_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, with_t5: bool = True, sd35: bool = False):
    """A random StableDiffusion3Pipeline small enough to train on 2 CPU cores (32 px images). Its T5 outputs
    zeros, exactly what the pipeline uses without one (``with_t5=False``, what the policy trains with);
    it is there so ``save_pretrained`` then a plain ``StableDiffusion3Pipeline.from_pretrained`` round-trips.

    ``sd35``: the SD3.5 (MMDiT-X) shape -- a dual-attention first layer and RMS QK-norm.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_clip_tokenizer()
        clip_cfg = dict(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=tokenizer.model_max_length, projection_dim=16,
            bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_act="gelu",
        )
        text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
        sd35_kw = dict(dual_attention_layers=(0,), qk_norm="rms_norm") if sd35 else {}
        transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32,
            pos_embed_max_size=16, **sd35_kw,
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=(8, 8), layers_per_block=1,
            latent_channels=4, norm_num_groups=4, sample_size=32, scaling_factor=1.5, shift_factor=0.06,
            use_quant_conv=False, use_post_quant_conv=False,
        )
        # built last, so the components above are the same with or without it
        text_encoder_3, tokenizer_3 = tiny_zero_t5(transformer.config.joint_attention_dim) if with_t5 else (None, None)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tiny_clip_tokenizer(),
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def load_sd3_pipeline(pretrained: str, dtype: torch.dtype, load_t5: bool = True):
    """diffusers' own loading path; never ``trust_remote_code``."""
    from diffusers import StableDiffusion3Pipeline

    index = StableDiffusion3Pipeline.load_config(pretrained)
    # components saved as null (e.g. a pipeline without T5) must be passed as None explicitly
    absent = {name: None for name, entry in index.items() if isinstance(entry, list) and entry[0] is None}
    if not load_t5:
        absent |= {"text_encoder_3": None, "tokenizer_3": None}
    for name in ("text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor"):
        if name not in index:
            absent[name] = None
    return StableDiffusion3Pipeline.from_pretrained(pretrained, torch_dtype=dtype, **absent)


class SD3Policy(Policy):
    """Frozen SD3 / SD3.5 parts plus a trainable peft LoRA on the transformer.

    Conditioning is batch-first: ``(prompt_embeds, pooled, negative_prompt_embeds, negative_pooled)``
    (the last two only with guidance), so it can be sliced and concatenated per sample.
    """

    family = "sd3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    default_lora_targets = SD3_LORA_TARGETS

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_sd3_pipeline(seed, dtype, with_t5=False)

    @classmethod
    def load_pipeline(cls, pretrained: str, dtype: torch.dtype, config: PolicyConfig):
        return load_sd3_pipeline(pretrained, dtype, config.load_t5)

    def setup(self, pipeline) -> None:
        self.transformer = pipeline.transformer
        self.vae = pipeline.vae
        self.text_encoders = nn.ModuleList(
            [m for m in (pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3) if m is not None]
        )
        self.scheduler_shift = float(pipeline.scheduler.config.get("shift", 1.0))
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_channels = self.transformer.config.in_channels
        native = self.transformer.config.sample_size * self.vae_scale_factor
        self.set_size(native)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (self.latent_channels, self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)

    def scheduler_kwargs(self, num_steps: int) -> dict:
        """As ``StableDiffusion3Pipeline``: mu from the image sequence length only with dynamic shifting."""
        if not self.scheduler.config.get("use_dynamic_shifting", False):
            return {}
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        patch = self.transformer.config.patch_size
        tokens = (self.latent_shape[1] // patch) * (self.latent_shape[2] // patch)
        cfg = self.scheduler.config
        return {"mu": calculate_shift(tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                                      cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.16))}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """Prompt embeddings through the pipeline's own ``encode_prompt`` (frozen encoders)."""
        cfg = self.cfg(guidance or self.guidance())
        pe, neg_pe, pooled, neg_pooled = self._pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=cfg, negative_prompt=[self.config.negative_prompt] * len(prompts),
            max_sequence_length=self.config.max_sequence_length,
        )
        return (pe, pooled, neg_pe, neg_pooled) if cfg else (pe, pooled)

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...], guidance: Guidance | None = None) -> Tensor:
        """v(z, t) with classifier-free guidance v_u + w (v_c - v_u); ``t`` [n] in [0, 1]."""
        guidance = guidance or self.guidance()
        dtype = self.transformer.dtype
        timestep = t * 1000  # float32, as the SD3 pipeline passes it: bf16 would round 987.5 to 988
        if self.cfg(guidance):
            pe, pooled, neg_pe, neg_pooled = cond
            out = self.transformer(
                hidden_states=torch.cat([z, z]).to(dtype), timestep=torch.cat([timestep, timestep]),
                encoder_hidden_states=torch.cat([neg_pe, pe]), pooled_projections=torch.cat([neg_pooled, pooled]),
                return_dict=False,
            )[0]
            v_u, v_c = out.chunk(2)
            return v_u + guidance.scale * (v_c - v_u)
        pe, pooled = cond
        return self.transformer(
            hidden_states=z.to(dtype), timestep=timestep, encoder_hidden_states=pe, pooled_projections=pooled,
            return_dict=False,
        )[0]
