"""Wan image-to-video: ``WanImageToVideoPipeline`` -- Wan2.1 I2V (and Wan2.2 I2V-A14B's two experts) as ``wan_i2v``;
Wan2.2 TI2V-5B's image-to-video mode (``expand_timesteps``) as ``wan22_ti2v``.

Everything else is the text-to-video family's (:mod:`jagg_lightning.policies.wan`): UMT5 prompts, true CFG with both
branches in one batched forward, the flow-shift schedule, the experts, the decode. Each prompt carries ONE
condition image (:class:`jagg_lightning.models.conditions.ConditionedPrompt`), the clip's first frame, fitted to the
sampled size (:func:`jagg_lightning.models.conditions.condition_pixels`: centre-cropped to the aspect ratio, then bicubic)
and handed to the pipeline's steps as ``image=`` at that size would be. Each image is encoded alone, as the pipeline
encodes its one image, so its encoding does not depend on the batch it came in.

``wan_i2v`` (``pipeline_wan_i2v.py`` with ``expand_timesteps`` False):

* **condition** (batch-first): ``(prompt_embeds, [negative_embeds,] condition [n, 4 + C, F', H', W'],
  [image_embeds [n, T, D_img]])``. ``condition`` is the pipeline's: the image followed by F - 1 zero frames
  through the VAE (the distribution's mode), normalised ``(z - latents_mean) / latents_std`` per channel, after
  4 mask channels (the VAE's temporal factor) that are 1 on the first latent frame and 0 after it.
  ``image_embeds`` -- only when the transformer has an image embedder (``image_dim``: Wan2.1 I2V) -- is CLIP's
  second-to-last hidden state of the image (``image_encoder`` after ``image_processor``, told the pixels are
  already in [0, 1]); diffusers' attention then reads the last 512 context tokens as the text, so
  ``policy.max_sequence_length`` must be 512 (checked);
* **latent** ``[C, F', H', W']`` as the text-to-video family; the transformer sees ``cat([z, condition], channels)``
  (``in_channels`` = 2 C + 4) and both CFG branches the same image embedding.

``wan22_ti2v`` (the same pipeline with ``expand_timesteps=True``: Wan2.2 TI2V-5B, one expert, a VAE with z_dim 48
and 16x spatial compression): the pipeline puts the image's latent into the first latent frame of what the
transformer sees, gives that frame's tokens timestep 0 (the others ``1000 t``), and writes the image's latent
over the first frame of the result. Its own update of that frame never reaches the output. So here the
**latent** -- what the SDE samples, and what its log-density is taken over -- is the other F' - 1 frames,
``[C, F' - 1, H', W']``; the **condition** carries the image's normalised latent ``[n, C, 1, H', W']``; the
velocity is the transformer's output on the sampled frames; ``decode_samples`` puts the image's latent back in
front (re-encoded from the prompt's image by the condition's own code) before the VAE, as the pipeline's last
step does. ``decode`` takes a whole clip's latent (all F' frames, the pipeline's ``output_type="latent"``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jagg_lightning.models.conditions import condition_pixels
from jagg_lightning.policies.base import Guidance
from jagg_lightning.policies.wan import TINY_Z_DIM, WanPolicy, build_tiny_wan_pipeline

WAN_TEXT_TOKENS = 512  # diffusers' WanAttnProcessor: the last 512 context tokens are the text, the rest the image's
TINY_TI2V_Z_DIM = 8


def build_tiny_wan_i2v_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, ti2v: bool = False,
                                two_experts: bool = False):
    """A random ``WanImageToVideoPipeline`` offline: the Wan twin's UMT5, tokenizer and scheduler, and either
    (Wan2.1 I2V) the Wan twin's VAE, a 2-block transformer with 2 C + 4 input channels and an image embedder, a
    2-layer ``CLIPVisionModelWithProjection`` (32 px, 8 px patches: 17 tokens) with its ``CLIPImageProcessor``;
    (``two_experts``, Wan2.2 I2V-A14B) two such transformers without image embedder, no image encoder, boundary 0.9;
    or (``ti2v``, Wan2.2 TI2V-5B) a Wan2.2-style VAE (residual, 2x2 patchified input: 16x spatial, 4x temporal,
    z_dim 8), a 2-block transformer on C channels, no image encoder, ``expand_timesteps=True``."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    text = build_tiny_wan_pipeline(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        z = TINY_TI2V_Z_DIM if ti2v else TINY_Z_DIM
        image_dim = None if ti2v or two_experts else 16

        def transformer():
            return WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                in_channels=z if ti2v else 2 * z + 4, out_channels=z, text_dim=16, freq_dim=32, ffn_dim=32,
                num_layers=2, rope_max_seq_len=32, image_dim=image_dim,
                added_kv_proj_dim=None if image_dim is None else 24)

        experts = [transformer(), transformer() if two_experts else None]
        encoder = processor = None
        if ti2v:
            vae = AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                   temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                                   out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                                   latents_mean=[0.1 * (i - 3) for i in range(z)],
                                   latents_std=[0.8 + 0.2 * i for i in range(z)])
        else:
            vae = text.vae
        if image_dim is not None:
            encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
                hidden_size=image_dim, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                image_size=32, patch_size=8, projection_dim=8)).eval()
            processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    pipe = WanImageToVideoPipeline(tokenizer=text.tokenizer, text_encoder=text.text_encoder, vae=vae,
                                   scheduler=text.scheduler, image_processor=processor, image_encoder=encoder,
                                   transformer=experts[0], transformer_2=experts[1],
                                   boundary_ratio=0.9 if two_experts else None, expand_timesteps=ti2v)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def normalised(policy: WanPolicy, latents: Tensor) -> Tensor:
    """The VAE latents as the pipeline's ``prepare_latents`` normalises them: in float32 (float64 with a float64
    VAE), ``(z - latents_mean) * (1 / latents_std)``, the reciprocal taken in float32 as the pipeline takes it."""
    cfg = policy.vae.config
    dtype = torch.float64 if latents.dtype == torch.float64 else torch.float32
    latents = latents.to(dtype)
    # float32 tensors, as the pipeline builds them under the default dtype (the training step's default is the SDE's)
    mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, dtype)
    inverse_std = 1.0 / torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, cfg.z_dim, 1, 1, 1)
    inverse_std = inverse_std.to(latents.device, dtype)
    return (latents - mean) * inverse_std


class WanI2VPolicy(WanPolicy):
    """Frozen Wan image-to-video parts plus a trainable LoRA on each expert (see the module docstring)."""

    family = "wan_i2v"
    pipeline_class_name = "WanImageToVideoPipeline"
    condition_images = (1, 1)
    adapter_mismatch_hint = WanPolicy.adapter_mismatch_hint.replace("Wan2.1 model", "Wan2.1 I2V model")

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_wan_i2v_pipeline(seed, dtype)

    def setup(self, pipeline) -> None:
        if pipeline.config.get("expand_timesteps"):
            raise ValueError("policy.family: this WanImageToVideoPipeline has expand_timesteps (Wan2.2 TI2V-5B's "
                             "image-to-video mode): name policy.family: wan22_ti2v")
        super().setup(pipeline)
        z, cfg = self.vae.config.z_dim, self.transformer.config
        if cfg.in_channels != 2 * z + self.temporal:
            raise ValueError(f"policy.pretrained: a wan_i2v transformer takes the latent, {self.temporal} mask "
                             f"channels and the image's latent ({2 * z + self.temporal} input channels for z_dim "
                             f"{z}), this one {cfg.in_channels}")
        self.image_encoder, self.image_processor = None, None
        if cfg.image_dim is not None:  # Wan2.1 I2V: the CLIP image embedding beside the text
            if pipeline.image_encoder is None or pipeline.image_processor is None:
                raise ValueError("policy.pretrained: this Wan I2V transformer embeds a CLIP image (image_dim "
                                 f"{cfg.image_dim}); the pipeline has no image_encoder / image_processor")
            if self.config.max_sequence_length != WAN_TEXT_TOKENS:
                raise ValueError(f"policy.max_sequence_length must be {WAN_TEXT_TOKENS} for a Wan I2V transformer "
                                 "with an image embedder (diffusers' WanAttnProcessor takes the last 512 context "
                                 f"tokens as the text), got {self.config.max_sequence_length}")
            self.image_encoder, self.image_processor = pipeline.image_encoder, pipeline.image_processor

    def frozen_modules(self) -> list[nn.Module]:
        image = [self.image_encoder] if getattr(self, "image_encoder", None) is not None else []
        return [*super().frozen_modules(), *image]

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """``[C, F', H', W']`` with C the VAE's z_dim (the transformer takes more channels: the condition's)."""
        frames = (self.num_frames - 1) // self.temporal + 1
        return (self.vae.config.z_dim, frames, self.height // self.spatial, self.width // self.spatial)

    # ------------------------------------------------------------------ condition
    def first_frames(self, prompts: list[str]) -> Tensor:
        """Each prompt's condition image fitted to (height, width): float32 [n, 3, H, W] in [0, 1]."""
        return condition_pixels(prompts, self.height, self.width).to(self.device)

    def image_latents(self, pixels: Tensor, frames: int) -> Tensor:
        """One image [1, 3, H, W] in [0, 1], followed by ``frames - 1`` zero frames, through the VAE (the mode),
        normalised: the pipeline's ``latent_condition``."""
        image = (2.0 * pixels - 1.0).unsqueeze(2)  # the pipeline's preprocess: [0, 1] -> [-1, 1], [1, 3, 1, H, W]
        video = torch.cat([image, image.new_zeros(1, 3, frames - 1, *image.shape[-2:])], dim=2)
        return normalised(self, self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode())

    def image_embeds(self, pixels: Tensor) -> Tensor:
        """CLIP's second-to-last hidden state of one image [1, 3, H, W] in [0, 1] (the pipeline's ``encode_image``),
        in the transformer's dtype."""
        inputs = self.image_processor(images=pixels, do_rescale=False, return_tensors="pt").to(self.device)
        hidden = self.image_encoder(**inputs, output_hidden_states=True).hidden_states[-2]
        return hidden.to(self.transformer.dtype)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """(prompt_embeds, [negative_embeds,] condition, [image_embeds]): see the module docstring."""
        text = super().encode_prompts(prompts, guidance)
        pixels = self.first_frames(prompts)
        frames = self.num_frames
        latent = torch.cat([self.image_latents(p[None], frames) for p in pixels])
        mask = latent.new_zeros(len(prompts), self.temporal, *latent.shape[2:])
        mask[:, :, 0] = 1  # the pipeline's mask_lat_size: the first frame (4 x) known, the rest not
        image = () if self.image_encoder is None else (torch.cat([self.image_embeds(p[None]) for p in pixels]),)
        return (*text, torch.cat([mask, latent], dim=1), *image)

    @staticmethod
    def split(cond: tuple[Tensor, ...], cfg: bool) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """(the text entries, the image entries) of a condition tuple."""
        texts = 2 if cfg else 1
        return cond[:texts], cond[texts:]

    # ------------------------------------------------------------------ velocity
    def _expert_velocity(self, expert: nn.Module, cfg: bool, scale: float, z: Tensor, t: Tensor, cond) -> Tensor:
        text, (condition, *image) = self.split(cond, cfg)
        dtype = expert.dtype
        x = torch.cat([z, condition.to(z.dtype)], dim=1).to(dtype)  # the pipeline's latent_model_input
        image = image[0].to(dtype) if image else None
        timestep = t * 1000  # float32, as the pipeline's timesteps (sigmas * 1000)
        if not cfg:
            return expert(hidden_states=x, timestep=timestep, encoder_hidden_states=text[0].to(dtype),
                          encoder_hidden_states_image=image, return_dict=False)[0]
        out = expert(hidden_states=torch.cat([x, x]), timestep=torch.cat([timestep, timestep]),
                     encoder_hidden_states=torch.cat(text).to(dtype),
                     encoder_hidden_states_image=None if image is None else torch.cat([image, image]),
                     return_dict=False)[0]
        v_c, v_u = out.chunk(2)
        return v_u + scale * (v_c - v_u)


class Wan22TI2VPolicy(WanI2VPolicy):
    """Wan2.2 TI2V-5B's image-to-video mode (``expand_timesteps``; see the module docstring). One expert."""

    family = "wan22_ti2v"
    adapter_mismatch_hint = ""

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_wan_i2v_pipeline(seed, dtype, ti2v=True)

    @classmethod
    def load_pipeline(cls, pretrained: str, dtype: torch.dtype, config):
        """``WanImageToVideoPipeline`` in its TI2V mode (the 5B's repository says ``WanPipeline``, its
        text-to-video use; the same folder loads as the image-to-video pipeline with ``expand_timesteps``)."""
        from diffusers import WanImageToVideoPipeline

        return WanImageToVideoPipeline.from_pretrained(pretrained, torch_dtype=dtype, expand_timesteps=True)

    def setup(self, pipeline) -> None:
        if not pipeline.config.get("expand_timesteps"):
            raise ValueError("policy.family: wan22_ti2v is WanImageToVideoPipeline with expand_timesteps (Wan2.2 "
                             "TI2V-5B); this pipeline has none: use policy.family wan_i2v")
        WanPolicy.setup(self, pipeline)
        cfg, z = self.transformer.config, self.vae.config.z_dim
        if self.transformer_2 is not None:
            raise ValueError("policy.pretrained: wan22_ti2v takes one expert (Wan2.2 TI2V-5B); this pipeline has "
                             "transformer_2")
        if cfg.in_channels != z or cfg.image_dim is not None or tuple(cfg.patch_size) != (1, 2, 2):
            raise ValueError(f"policy.pretrained: a wan22_ti2v transformer takes the VAE's {z} latent channels, "
                             "(1, 2, 2) patches and no image embedding (the pipeline's expand_timesteps mode); this "
                             f"one: in_channels {cfg.in_channels}, patch_size {list(cfg.patch_size)}, image_dim "
                             f"{cfg.image_dim}")
        if self.num_frames < 1 + self.temporal:
            raise ValueError(f"policy.num_frames must be >= {1 + self.temporal} for wan22_ti2v (its first latent "
                             f"frame is the image's: nothing else would be sampled), got {self.num_frames}")
        self.image_encoder, self.image_processor = None, None

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """The sampled frames: ``[C, F' - 1, H', W']`` (the first latent frame is the image's)."""
        c, frames, h, w = super().latent_shape
        return (c, frames - 1, h, w)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """(prompt_embeds, [negative_embeds,] the image's normalised latent [n, C, 1, H', W'])."""
        text = WanPolicy.encode_prompts(self, prompts, guidance)
        return (*text, self.first_latents(prompts))

    def first_latents(self, prompts: list[str]) -> Tensor:
        """The pipeline's ``condition`` in this mode: each image alone (one frame) through the VAE, normalised."""
        return torch.cat([self.image_latents(p[None], 1) for p in self.first_frames(prompts)])

    def _expert_velocity(self, expert: nn.Module, cfg: bool, scale: float, z: Tensor, t: Tensor, cond) -> Tensor:
        text, (first,) = self.split(cond, cfg)
        dtype, n = expert.dtype, z.shape[0]
        x = torch.cat([first.to(z.dtype), z], dim=2).to(dtype)  # the image's latent as the first frame
        tokens = (z.shape[-2] // 2) * (z.shape[-1] // 2)  # per latent frame, (1, 2, 2) patches
        sampled = (t * 1000)[:, None].expand(n, z.shape[2] * tokens)  # float32, as the pipeline's mask * t
        timestep = torch.cat([sampled.new_zeros(n, tokens), sampled], dim=1)  # the first frame's tokens at 0
        if cfg:
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        out = expert(hidden_states=x, timestep=timestep, encoder_hidden_states=torch.cat(text).to(dtype),
                     return_dict=False)[0][:, :, 1:]  # the sampled frames
        if not cfg:
            return out
        v_c, v_u = out.chunk(2)
        return v_u + scale * (v_c - v_u)

    @torch.no_grad()
    def decode_samples(self, latents: Tensor, prompts: list[str]) -> Tensor:
        """The sampled frames of each prompt's clip behind its image's latent (the pipeline's last step), decoded."""
        first = self.first_latents(prompts).to(latents.device, latents.dtype)
        return self.decode(torch.cat([first, latents], dim=2))
