"""LTX-2 text-to-audio+video: a LoRA-adapted ``LTX2VideoTransformer3DModel``, frozen Gemma-3 + text connectors,
``AutoencoderKLLTX2Video`` (and ``AutoencoderKLLTX2Audio`` + vocoder for the sound).

What the family looks like (all of it stays inside this file):

* **condition** (batch-first): ``(video_embeds [B, L, Dv], audio_embeds [B, L, Da], mask [B, L])`` and, with CFG,
  the negative prompt's three after them -- ``LTX2Pipeline.encode_prompt`` (Gemma-3's hidden states of every layer,
  left-padded to ``max_sequence_length`` tokens) through the pipeline's ``connectors`` (the per-layer masked
  normalisation and the video / audio connector transformers), exactly as the pipeline feeds the transformer; the
  mask is the connectors' (1 = a token the transformer's cross-attention sees);
* **latent** (the SDE state): ``[S_v + S_a, D]`` per sample -- the video latent packed as ``LTX2Pipeline._pack_latents``
  packs it (``S_v = F' H' W'`` tokens in frame, row, column order, F' = (F - 1) / 8 + 1, H' = H / 32 on LTX-2), then
  the audio latent packed as ``_pack_audio_latents`` (``S_a`` = the pipeline's audio length for the clip's duration at
  24 fps, ``D`` = audio channels x latent mel bins). Both are 128 wide on LTX-2, so they stack into one token
  sequence; a checkpoint whose two widths differ is refused in ``setup``;
* **the audio stream is generated with the video**: LTX-2 is one joint network -- every block's video tokens
  attend to the audio tokens (audio-to-video cross-attention) and back -- so the video's velocity is a function of
  the audio state. The audio latent is therefore part of the Markov state the SDE moves and the policy's
  log-density covers (both streams noised, both streams' velocity from the same forward, as the pipeline denoises
  them together). Rewards score the decoded frames (``decode``); :meth:`LTX2Policy.decode_audio` turns the same final
  latent into the waveform (audio VAE + vocoder) for a user who wants to score the sound;
* **velocity**: the transformer's two outputs (video, audio) at ``timestep = sigma = 1000 t`` (the scheduler's
  timesteps; LTX-2.3's prompt modulation reads ``sigma``, the pipeline passes the same value), RoPE over
  (frames, rows, columns) from the transformer's own ``prepare_video_coords`` at 24 fps and over the audio length;
  with ``guidance_scale`` > 1 classifier-free guidance ``v = v_u + w (v_c - v_u)`` on both streams (both branches
  in one batched forward). The pipeline writes its guidance on x0 = z - sigma v, which is the same v when nothing
  else is added; its further default terms (spatio-temporal guidance, modality-isolation guidance, guidance
  rescale 0.7, an audio scale of 7) are each another forward or a non-linear rescale per step and are off here,
  as the Flow-GRPO trainers sample (compare with the pipeline at ``stg_scale=0, modality_scale=1,
  guidance_rescale=0, audio_guidance_scale=guidance_scale``);
* **times**: ``FlowMatchEulerDiscreteScheduler`` at ``sigmas = linspace(1, 1/N, N)`` with the pipeline's dynamic
  shift ``mu`` from the video token count (``base_shift`` 0.95 .. ``max_shift`` 2.05 over 1024 .. 4096 tokens when
  the scheduler config leaves them out), then 0 -- ``LTX2Pipeline``'s own ``retrieve_timesteps`` call;
* **image-to-video** (``ltx2_i2v``, ``LTX2ImageToVideoPipeline``): each prompt's one image, fitted to the size, is
  the clip's first latent frame -- the VAE's mode of the image alone, normalised ``(x - mean) / std`` per channel,
  packed into ``H' W'`` tokens (``prepare_latents``) -- and is held clean: the SDE samples the other frames' video
  tokens and the audio (latent ``[S_v - H' W' + S_a, D]``), the transformer sees the held tokens first at timestep 0
  (the pipeline's per-token ``t (1 - conditioning_mask)``; the audio's timestep and ``sigma`` stay t) and their
  output is dropped, as the pipeline steps only the frames after the first. The pipeline's H.264 re-compression of
  the image (``image_crf``: CRF 33 with a Gemma-3 encoder, through PyAV) is not applied: pass the images as you want
  them seen (the pipeline at ``image_crf=0`` is this policy);
* **decode**: the video tokens unpacked, ``z std / scaling_factor + mean`` (per channel), the VAE's decode (at
  decode timestep 0 with no decode noise where the VAE is timestep-conditioned: the pipeline's defaults), [-1, 1] ->
  [0, 1], as a video ``[B, F, 3, H, W]``.

**Precision**: a float64 policy is float64 except where diffusers computes in float32 whatever the dtype -- the RoPE
(``apply_split_rotary_emb`` / ``apply_interleaved_rotary_emb`` cast q and k with ``.float()``) and ``RMSNorm``'s
variance; no config or dtype argument changes that (``rope_double_precision`` only builds the frequency grid in
float64), so float64 updates agree with a float64 reference to float32's rounding (about 1e-7 relative), not 1e-10
(docs/model_families.md, "LTX-2").

``build_tiny_ltx2_pipeline`` builds a real ``LTX2Pipeline`` offline (a 1-layer Gemma-3 with a character-level
tokenizer, 1-layer connectors, a 2-block transformer, a tiny video VAE with 8x spatial and 4x temporal compression, a
tiny audio VAE and vocoder): 32 px x 9 frames -> 48 video tokens and 9 audio tokens of width 8.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from jagg_lightning.models.conditions import condition_pixels
from jagg_lightning.policies.base import Guidance, Policy

# Flow-Factory's LTX-2 default, "28 Linear layers per block": q/k/v/out of the 6 attentions of every block (video and
# audio self-attention, their text cross-attentions, audio-to-video and video-to-audio) and both feed-forwards (peft
# matches a suffix after a dot, so the audio stream's feed-forward is named apart).
LTX2_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj",
                     "audio_ff.net.2"]

FRAME_RATE = 24.0  # LTX2Pipeline's default: the clip's duration (hence the audio length) and RoPE's frame positions
TINY_FRAMES = 9  # -> 3 latent frames (the twin's VAE compresses time 4x)
TINY_VIDEO_CHANNELS = 8
TINY_TEXT_LAYERS = 1


def tiny_gemma_tokenizer():
    """A character-level ``GemmaTokenizer`` (BPE without merges) built offline, with Gemma's special tokens."""
    from transformers import GemmaTokenizer

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    for ch in " \u2581" + "".join(chr(c) for c in range(33, 127)):
        vocab.setdefault(ch, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[])


def build_tiny_ltx2_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, i2v: bool = False):
    """A random ``LTX2Pipeline`` (``i2v``: the same parts as an ``LTX2ImageToVideoPipeline``) small enough to train
    on 2 CPU cores (see the module docstring)."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2ImageToVideoPipeline, LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    tokenizer = tiny_gemma_tokenizer()
    width = 16  # Gemma's hidden size = the connectors' width (2 heads x 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=Gemma3TextConfig(
                vocab_size=len(tokenizer), hidden_size=width, intermediate_size=32, num_hidden_layers=TINY_TEXT_LAYERS,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
                sliding_window=64, pad_token_id=0, eos_token_id=1, bos_token_id=2),
            vision_config=SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14),
            mm_tokens_per_image=4, image_token_index=4)).eval()
        connectors = LTX2TextConnectors(
            caption_channels=width, text_proj_in_factor=TINY_TEXT_LAYERS + 1, video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=8, video_connector_num_layers=1,
            video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
            audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_type="split")
        transformer = LTX2VideoTransformer3DModel(
            in_channels=TINY_VIDEO_CHANNELS, out_channels=TINY_VIDEO_CHANNELS, num_attention_heads=2,
            attention_head_dim=8, cross_attention_dim=16, vae_scale_factors=(4, 8, 8), audio_in_channels=8,
            audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
            num_layers=2, caption_channels=width, rope_type="split")
        vae = AutoencoderKLLTX2Video(
            latent_channels=TINY_VIDEO_CHANNELS, block_out_channels=(8, 8), down_block_types=("LTX2VideoDownBlock3D",) * 2,
            decoder_block_out_channels=(8, 8), layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
            spatio_temporal_scaling=(True, True), decoder_spatio_temporal_scaling=(True, True),
            decoder_inject_noise=(False, False, False), downsample_type=("spatiotemporal",) * 2,
            upsample_type=("spatiotemporal",) * 2, upsample_residual=(False, False), upsample_factor=(1, 1),
            patch_size=2, decoder_causal=False)
        # per-channel statistics that are not the identity, so a decode that forgets them shows
        vae.latents_mean.copy_(torch.linspace(-0.3, 0.3, TINY_VIDEO_CHANNELS))
        vae.latents_std.copy_(torch.linspace(0.6, 1.8, TINY_VIDEO_CHANNELS))
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=8, output_channels=2, ch_mult=(1,), num_res_blocks=1, in_channels=2, resolution=32,
            latent_channels=2, mel_bins=16)
        audio_vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, 8))  # on the packed [C x M] tokens
        audio_vae.latents_std.copy_(torch.linspace(0.7, 1.5, 8))
        vocoder = LTX2Vocoder(in_channels=2 * 16, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4],
                              upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                              output_sampling_rate=16000)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    cls = LTX2ImageToVideoPipeline if i2v else LTX2Pipeline
    pipe = cls(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tokenizer,
               connectors=connectors, transformer=transformer, vocoder=vocoder)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


class LTX2Policy(Policy):
    """Frozen LTX-2 parts plus a trainable peft LoRA on the transformer, or the transformer trained in full (see the
    module docstring). ``policy.num_frames`` (default 121, the twin's 9) must be 8 k + 1 on LTX-2 (the VAE's temporal
    compression); ``policy.resolution`` a multiple of 32 (LTX-2's default 512 x 768)."""

    family = "ltx2"
    pipeline_class_name = "LTX2Pipeline"
    video = True
    default_lora_targets = LTX2_LORA_TARGETS

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_ltx2_pipeline(seed, dtype)

    @classmethod
    def pixel_multiple(cls, vae_config, transformer_config) -> int:
        """The VAE's spatial compression (its ``patch_size`` x 2 per spatial-scaling block, as the VAE computes it)
        times the transformer's patch side."""
        ratio = vae_config.get("spatial_compression_ratio")
        if ratio is None:
            scaling = vae_config.get("spatio_temporal_scaling", (True, True, True, True))
            ratio = int(vae_config.get("patch_size", 4)) * 2 ** sum(bool(s) for s in scaling)
        return int(ratio) * int(transformer_config.get("patch_size") or 1)

    def setup(self, pipeline) -> None:
        self.transformer = pipeline.transformer
        self.vae, self.audio_vae, self.vocoder = pipeline.vae, pipeline.audio_vae, pipeline.vocoder
        self.text_encoders = nn.ModuleList([pipeline.text_encoder, pipeline.connectors])
        self.temporal, self.spatial = pipeline.vae_temporal_compression_ratio, pipeline.vae_spatial_compression_ratio
        tiny = self.config.pretrained is None
        self.set_size(32 if tiny else (512, 768))  # LTX2Pipeline's default height x width
        frames = self.config.num_frames or (TINY_FRAMES if tiny else 121)
        if (frames - 1) % self.temporal:
            raise ValueError(f"policy.num_frames must be {self.temporal} k + 1 (the VAE's temporal compression), "
                             f"got {frames}")
        self.num_frames = frames
        cfg = self.transformer.config
        if (cfg.patch_size, cfg.patch_size_t, cfg.audio_patch_size, cfg.audio_patch_size_t) != (1, 1, 1, 1):
            raise ValueError("policy.pretrained: this family packs latents as LTX-2 does, one token per latent pixel "
                             f"(transformer patch sizes 1); got patch_size {cfg.patch_size}, patch_size_t "
                             f"{cfg.patch_size_t}, audio {cfg.audio_patch_size} / {cfg.audio_patch_size_t}")
        self.video_grid = ((frames - 1) // self.temporal + 1, self.height // self.spatial, self.width // self.spatial)
        self.video_tokens = int(np.prod(self.video_grid))
        self.held_tokens = 0  # the video tokens the SDE does not sample (image-to-video: the first frame's)
        # the pipeline's audio length for the clip's duration, and the packed width (channels x latent mel bins)
        per_second = pipeline.audio_sampling_rate / pipeline.audio_hop_length / pipeline.audio_vae_temporal_compression_ratio
        self.audio_tokens = round(frames / FRAME_RATE * per_second)
        self.audio_mel_bins = self.audio_vae.config.mel_bins // pipeline.audio_vae_mel_compression_ratio
        audio_width = self.audio_vae.config.latent_channels * self.audio_mel_bins
        video_width = cfg.in_channels
        if audio_width != video_width or cfg.audio_in_channels != audio_width:
            raise ValueError(f"policy.pretrained: the LTX-2 transformer's video tokens are {video_width} wide and its "
                             f"audio tokens {audio_width} (transformer audio_in_channels {cfg.audio_in_channels}); this "
                             "family stacks both streams into one latent and needs them equal, as LTX-2's 128 and 128")

    def frozen_modules(self) -> list[nn.Module]:
        """The base's (transformer, video VAE, Gemma-3 and the connectors) and the sound's decoders."""
        return [*super().frozen_modules(), self.audio_vae, self.vocoder]

    # ------------------------------------------------------------------ shapes and schedule
    @property
    def latent_shape(self) -> tuple[int, int]:
        return (self.video_tokens - self.held_tokens + self.audio_tokens, self.transformer.config.in_channels)

    def scheduler_kwargs(self, num_steps: int) -> dict:
        """``LTX2Pipeline``'s: ``sigmas = linspace(1, 1/N, N)`` and ``mu`` of the video token count."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        cfg = self.scheduler.config
        mu = calculate_shift(self.video_tokens, cfg.get("base_image_seq_len", 1024), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.95), cfg.get("max_shift", 2.05))
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": mu}

    # ------------------------------------------------------------------ condition, velocity, decode
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """Through the pipeline's own ``encode_prompt`` (Gemma-3, left padding) and ``connectors``; the positive and
        the negative prompts each through the connectors on their own (each row is independent there)."""
        cfg = self.cfg(guidance or self.guidance())
        pe, mask, neg, neg_mask = self._pipeline.encode_prompt(
            prompt=list(prompts), negative_prompt=[self.config.negative_prompt] * len(prompts),
            do_classifier_free_guidance=cfg, max_sequence_length=self.config.max_sequence_length, device=self.device)
        side = getattr(self._pipeline.tokenizer, "padding_side", "left")
        connectors = self._pipeline.connectors
        out = connectors(pe, mask, padding_side=side)
        return (*out, *connectors(neg, neg_mask, padding_side=side)) if cfg else out

    def _forward(self, z: Tensor, t: Tensor, video_embeds: Tensor, audio_embeds: Tensor, mask: Tensor,
                 held: Tensor | None = None) -> Tensor:
        """The transformer on the joint latent; ``held``: image-to-video's first-frame tokens ``[n, T0, D]``, put
        before the sampled video tokens at timestep 0 (``LTX2ImageToVideoPipeline``'s ``t (1 - conditioning_mask)``),
        their output dropped."""
        dtype = self.transformer.dtype
        timestep = t * 1000  # float32, as the scheduler's timesteps (sigmas * 1000)
        frames, height, width = self.video_grid
        sampled = self.video_tokens - self.held_tokens
        video_in, video_timestep = z[:, :sampled], timestep
        if held is not None:
            video_in = torch.cat([held.to(z.dtype), video_in], dim=1)
            video_timestep = torch.cat([timestep.new_zeros(len(z), self.held_tokens),
                                        timestep[:, None].expand(len(z), sampled)], dim=1)
        video, audio = self.transformer(
            hidden_states=video_in.to(dtype), audio_hidden_states=z[:, sampled:].to(dtype),
            encoder_hidden_states=video_embeds.to(dtype), audio_encoder_hidden_states=audio_embeds.to(dtype),
            timestep=video_timestep, audio_timestep=timestep, sigma=timestep, encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask, num_frames=frames, height=height, width=width, fps=FRAME_RATE,
            audio_num_frames=self.audio_tokens, use_cross_timestep=True, return_dict=False)
        return torch.cat([video[:, self.held_tokens:], audio.to(video.dtype)], dim=1)

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...], guidance: Guidance | None = None) -> Tensor:
        """v(z, t) on the joint latent ``[n, S_v + S_a, D]`` (image-to-video: ``S_v`` less the first frame's tokens),
        ``t`` [n] in [0, 1]; CFG: both branches in one forward."""
        guidance = guidance or self.guidance()
        cfg = self.cfg(guidance)
        text, held = cond[:6 if cfg else 3], cond[6 if cfg else 3:]  # held: image-to-video's first frame
        if not cfg:
            return self._forward(z, t, *text, *held)
        pos, neg = text[:3], text[3:]
        out = self._forward(torch.cat([z, z]), torch.cat([t, t]), *(torch.cat([p, n]) for p, n in zip(pos, neg)),
                            *(torch.cat([h, h]) for h in held))
        v_c, v_u = out.chunk(2)
        return v_u + guidance.scale * (v_c - v_u)

    def unpack_video(self, latents: Tensor) -> Tensor:
        """The video part of joint latents ``[B, S_v + S_a, C]`` -> ``[B, C, F', H', W']`` (the inverse of
        ``LTX2Pipeline._pack_latents`` at patch size 1: tokens in frame, row, column order)."""
        return latents[:, :self.video_tokens].unflatten(1, self.video_grid).permute(0, 4, 1, 2, 3)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Joint latents -> videos ``[B, F, 3, H, W]`` in [0, 1], float32 (the audio tokens are not read)."""
        vae = self.vae
        z = self.unpack_video(latents.to(vae.dtype))  # denormalised per channel, as the pipeline does
        z = z * vae.latents_std.view(1, -1, 1, 1, 1).to(z) / vae.config.scaling_factor + vae.latents_mean.view(
            1, -1, 1, 1, 1).to(z)
        timestep = None
        if vae.config.timestep_conditioning:  # the pipeline's defaults: decode_timestep 0, no decode noise
            timestep = torch.zeros(len(z), dtype=z.dtype, device=z.device)
        video = vae.decode(z, timestep, return_dict=False)[0]  # [B, 3, F, H, W]
        return (video.float() / 2 + 0.5).clamp(0, 1).transpose(1, 2).contiguous()

    @torch.no_grad()
    def decode_audio(self, latents: Tensor) -> Tensor:
        """The SDE's joint latents -> waveforms ``[B, channels, samples]`` at the vocoder's ``output_sampling_rate``:
        the audio tokens denormalised, unpacked, through the audio VAE's decode and the vocoder, as ``LTX2Pipeline``
        does."""
        audio_vae = self.audio_vae
        tokens = latents[:, self.video_tokens - self.held_tokens:].to(audio_vae.dtype)  # [B, L, C x M], packed
        tokens = tokens * audio_vae.latents_std.to(tokens) + audio_vae.latents_mean.to(tokens)
        mel = audio_vae.decode(tokens.unflatten(2, (-1, self.audio_mel_bins)).transpose(1, 2), return_dict=False)[0]
        return self.vocoder(mel).float()


class LTX2I2VPolicy(LTX2Policy):
    """LTX-2 image-to-audio+video (``LTX2ImageToVideoPipeline``): each prompt's one condition image is the clip's first
    latent frame, held clean (see the module docstring)."""

    family = "ltx2_i2v"
    pipeline_class_name = "LTX2ImageToVideoPipeline"
    condition_images = (1, 1)

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_ltx2_pipeline(seed, dtype, i2v=True)

    def setup(self, pipeline) -> None:
        super().setup(pipeline)
        if self.video_grid[0] < 2:
            raise ValueError(f"policy.num_frames must be >= {1 + self.temporal} for ltx2_i2v (its first latent frame "
                             f"is the image's: no video frame would be sampled), got {self.num_frames}")
        self.held_tokens = self.video_grid[1] * self.video_grid[2]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """The text condition, then the first frames' packed latent tokens ``[n, H' W', D]``."""
        return (*super().encode_prompts(prompts, guidance), self.first_tokens(prompts))

    def first_tokens(self, prompts: list[str]) -> Tensor:
        """``LTX2ImageToVideoPipeline.prepare_latents``' first frame: each image (fitted to the size, [-1, 1]) alone
        through the VAE (the mode), normalised per channel ``(x - mean) / std`` (no ``scaling_factor`` there),
        float32, packed into tokens in row, column order."""
        vae, tokens = self.vae, []
        for p in condition_pixels(prompts, self.height, self.width).to(self.device):
            image = (2.0 * p - 1.0)[None, :, None].to(vae.dtype)  # [1, 3, 1, H, W]
            latent = vae.encode(image).latent_dist.mode().float()
            latent = (latent - vae.latents_mean.view(1, -1, 1, 1, 1).float()) / vae.latents_std.view(
                1, -1, 1, 1, 1).float()
            tokens.append(latent[:, :, 0].flatten(2).transpose(1, 2))  # [1, H' W', C]
        return torch.cat(tokens)

    @torch.no_grad()
    def decode_samples(self, latents: Tensor, prompts: list[str]) -> Tensor:
        """The sampled tokens behind each prompt's first-frame tokens (the pipeline's last step), decoded."""
        return self.decode(torch.cat([self.first_tokens(prompts).to(latents), latents], dim=1))
