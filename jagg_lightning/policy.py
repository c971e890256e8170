"""The policy: a LoRA-adapted Stable Diffusion 3 transformer with frozen text encoders and VAE.

Built from ``pretrained`` (a local directory or a hub id, through diffusers' own ``from_pretrained``)
or, when ``pretrained`` is None, from a tiny random configuration (fixed seed) with a character-level
CLIP tokenizer built offline, so the default run needs no download. The tiny pipeline is a real
``StableDiffusion3Pipeline``: it saves with ``save_pretrained`` and loads back through ``pretrained``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# Flow-GRPO's SD3 LoRA targets: the joint-attention projections of both streams.
SD3_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]


@dataclass
class PolicyConfig:
    """What to load and how to adapt it.

    pretrained: local directory or hub id of a StableDiffusion3Pipeline; None builds the tiny model.
    lora_rank / lora_alpha / lora_targets: the peft LoRA (Flow-GRPO SD3 default r 32, alpha 64).
    guidance_scale: classifier-free guidance, 1.0 = off (one forward instead of two).
    resolution: image side in pixels; None = the transformer's native sample size.
    dtype: dtype of the frozen weights; LoRA weights and SDE math stay float32 (float64 if chosen).
    """

    pretrained: str | None = None
    lora_rank: int = 32
    lora_alpha: float = 64.0
    lora_targets: list[str] = field(default_factory=lambda: list(SD3_LORA_TARGETS))
    guidance_scale: float = 4.5
    negative_prompt: str = ""
    max_sequence_length: int = 128
    resolution: int | None = None
    dtype: str = "float32"
    load_t5: bool = True
    seed: int = 0

    def __post_init__(self):
        def integer(name, value, allowed, ok):
            if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
                raise ValueError(f"policy.{name} must be {allowed}, got {value!r}")

        integer("lora_rank", self.lora_rank, "an integer >= 1", lambda v: v >= 1)
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or not self.lora_alpha > 0:
            raise ValueError(f"policy.lora_alpha must be a number > 0, got {self.lora_alpha!r}")
        if not isinstance(self.guidance_scale, (int, float)) or self.guidance_scale < 1.0:
            raise ValueError(f"policy.guidance_scale must be >= 1.0 (1.0 = off), got {self.guidance_scale!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"policy.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        integer("max_sequence_length", self.max_sequence_length, "an integer >= 1", lambda v: v >= 1)
        if self.resolution is not None:  # the multiple of VAE factor x patch size is checked against the model
            integer("resolution", self.resolution, "an integer >= 1 (pixels) or null", lambda v: v >= 1)
        integer("seed", self.seed, "an integer", lambda v: True)
        if isinstance(self.lora_targets, str) or not self.lora_targets or not all(
                isinstance(t, str) and t for t in self.lora_targets):
            raise ValueError(f"policy.lora_targets must be a non-empty list of module names, got {self.lora_targets!r}")


def tiny_clip_tokenizer(max_length: int = 32):
    """A character-level CLIP BPE tokenizer (no merges) built offline from the byte alphabet."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for ch in sorted(ByteLevel.alphabet()):
            vocab[ch + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


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


def build_tiny_sd3_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, with_t5: bool = True):
    """A random StableDiffusion3Pipeline small enough to train on 2 CPU cores (32 px images). Its T5 outputs
    zeros, exactly what the pipeline uses without one (``with_t5=False``, what the policy trains with);
    it is there so ``save_pretrained`` then a plain ``StableDiffusion3Pipeline.from_pretrained`` round-trips."""
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
        transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32,
            pos_embed_max_size=16,
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


class SD3Policy(nn.Module):
    """Frozen SD3 parts plus a trainable peft LoRA on the transformer.

    Conditioning is batch-first: ``(prompt_embeds, pooled, negative_prompt_embeds, negative_pooled)``
    (the last two only with guidance), so it can be sliced and concatenated per sample.
    """

    family = "sd3"

    @property
    def pipeline_class(self):
        """The diffusers pipeline class (its ``save_lora_weights`` / ``load_lora_weights`` define the LoRA file)."""
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline

    def __init__(self, config: PolicyConfig | None = None, pipeline=None):
        super().__init__()
        from diffusers.training_utils import cast_training_params
        from peft import LoraConfig

        self.config = config = config or PolicyConfig()
        dtype = DTYPES[config.dtype]
        if pipeline is None:
            if config.pretrained is None:
                pipeline = build_tiny_sd3_pipeline(config.seed, dtype, with_t5=False)
            else:
                pipeline = load_sd3_pipeline(config.pretrained, dtype, config.load_t5)
        self.transformer = pipeline.transformer
        self.vae = pipeline.vae
        self.text_encoders = nn.ModuleList(
            [m for m in (pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3) if m is not None]
        )
        self.scheduler_shift = float(pipeline.scheduler.config.get("shift", 1.0))
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_channels = self.transformer.config.in_channels
        native = self.transformer.config.sample_size * self.vae_scale_factor
        self.resolution = native if config.resolution is None else config.resolution
        if self.resolution % (self.vae_scale_factor * self.transformer.config.patch_size):
            raise ValueError(
                f"policy.resolution must be a multiple of {self.vae_scale_factor * self.transformer.config.patch_size}, "
                f"got {self.resolution}"
            )
        # the pipeline is kept (outside the module tree) only for its prompt encoding
        object.__setattr__(self, "_pipeline", pipeline)
        for module in (self.transformer, self.vae, self.text_encoders):
            module.requires_grad_(False)
            module.eval()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed + 1)
            self.transformer.add_adapter(
                LoraConfig(
                    r=config.lora_rank, lora_alpha=config.lora_alpha, init_lora_weights="gaussian",
                    target_modules=list(config.lora_targets),
                )
            )
        cast_training_params(self.transformer, dtype=torch.float64 if dtype == torch.float64 else torch.float32)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        side = self.resolution // self.vae_scale_factor
        return (self.latent_channels, side, side)

    @property
    def guided(self) -> bool:
        return self.config.guidance_scale > 1.0

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> tuple[Tensor, ...]:
        """Prompt embeddings through the pipeline's own ``encode_prompt`` (frozen encoders)."""
        device = next(self.transformer.parameters()).device
        pe, neg_pe, pooled, neg_pooled = self._pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=device,
            do_classifier_free_guidance=self.guided, negative_prompt=[self.config.negative_prompt] * len(prompts),
            max_sequence_length=self.config.max_sequence_length,
        )
        return (pe, pooled, neg_pe, neg_pooled) if self.guided else (pe, pooled)

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...]) -> Tensor:
        """v(z, t) with classifier-free guidance v_u + w (v_c - v_u); ``t`` [n] in [0, 1]."""
        dtype = self.transformer.dtype
        timestep = t * 1000  # float32, as the SD3 pipeline passes it: bf16 would round 987.5 to 988
        if self.guided:
            pe, pooled, neg_pe, neg_pooled = cond
            out = self.transformer(
                hidden_states=torch.cat([z, z]).to(dtype), timestep=torch.cat([timestep, timestep]),
                encoder_hidden_states=torch.cat([neg_pe, pe]), pooled_projections=torch.cat([neg_pooled, pooled]),
                return_dict=False,
            )[0]
            v_u, v_c = out.chunk(2)
            return v_u + self.config.guidance_scale * (v_c - v_u)
        pe, pooled = cond
        return self.transformer(
            hidden_states=z.to(dtype), timestep=timestep, encoder_hidden_states=pe, pooled_projections=pooled,
            return_dict=False,
        )[0]

    @contextmanager
    def adapter_disabled(self):
        """The KL reference: the same transformer with the LoRA switched off."""
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> images [B, 3, H, W] in [0, 1], float32."""
        cfg = self.vae.config
        latents = latents.to(self.vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        images = self.vae.decode(latents, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)
