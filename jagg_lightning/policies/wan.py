"""Wan2.1 / Wan2.2 text-to-video: LoRA-adapted ``WanTransformer3DModel`` expert(s), frozen UMT5 and ``AutoencoderKLWan``.

What the family looks like (all of it stays inside this file):

* **condition** (batch-first): ``(prompt_embeds [B, L, D],)`` and, with true CFG, ``(..., negative_embeds [B, L, D])``
  -- UMT5's last hidden state over ``max_sequence_length`` tokens, zeroed past each prompt's length, exactly
  ``WanPipeline.encode_prompt`` (the negative is ``policy.negative_prompt``);
* **latent**: ``[C, F', H', W']`` per sample, F' = (F - 1) / 4 + 1 and H' = H / 8 (the VAE's 4x temporal and
  8x spatial compression); the transformer patchifies it with (1, 2, 2) patches. This is the tensor
  ``WanPipeline`` integrates and accepts as ``latents=``;
* **velocity**: the expert's output at ``timestep = 1000 t``; with ``guidance_scale`` > 1 the pipeline's true CFG
  ``v = v_u + w (v_c - v_u)`` (both branches in one batched forward; the pipeline runs two);
* **experts** (Wan2.2 A14B): ``transformer`` for high noise, ``transformer_2`` for low noise; a sample at t uses
  ``transformer`` iff ``1000 t >= 1000 boundary_ratio`` (float32, as the pipeline compares its timesteps), with
  ``guidance_scale`` resp. ``guidance_scale_2`` (None = the same). Both carry a LoRA (``trainable: full``: both
  train in full, each with its frozen KL reference copy), both are sharded under FSDP2 and both are exported
  (:meth:`WanPolicy.trained_networks`). :meth:`WanPolicy.expert_index` maps a step to its expert
  (``expert_names`` "high_noise", "low_noise": ``RoutingStats`` logs per expert); ``expert_starts`` tells the
  planner where the expert changes, so no JAGG window straddles the switch: interpolating the
  Jacobians of two different networks has no meaning;
* **times**: the flow-matching sigmas with Wan's ``flow_shift``: ``FlowMatchEulerDiscreteScheduler(shift=s)``
  at N steps, ``sigma = s u / (1 + (s - 1) u)`` on ``u = linspace(1, 1/1000, N)``, then 0. The released
  pipelines ship ``UniPCMultistepScheduler(flow_shift=s)`` (a multistep ODE solver, not an SDE); the
  flow-matching scheduler with the same shift is what Flow-GRPO-style Wan trainers sample with;
* **decode**: ``z * latents_std + latents_mean`` (per channel), the VAE's decode, [-1, 1] -> [0, 1], returned
  as a video ``[B, F, 3, H, W]`` (a 5-D tensor is a video everywhere in the library; image rewards see frames
  through ``rewards.FrameReward``).

``build_tiny_wan_pipeline`` builds a real ``WanPipeline`` offline (a 1-layer UMT5 with a character-level T5
tokenizer, 2-block transformer(s), a tiny Wan VAE with the real 4x / 8x compression), 32 px, 9 frames.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jagg_lightning.policies.base import Guidance, Policy
from jagg_lightning.policies.tiny import tiny_t5_tokenizer
from jagg_lightning.utils.batching import batch_slice

# LoRA on the self- and cross-attention projections (attn1 / attn2) and the feed-forward of every block: the
# target set of DanceGRPO's and Flow-Factory's Wan LoRA recipes (peft matches these suffixes in both attentions).
WAN_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]

TINY_FRAMES = 9  # -> 3 latent frames
TINY_Z_DIM = 4


def build_tiny_wan_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, two_experts: bool = False,
                            boundary_ratio: float = 0.875):
    """A random ``WanPipeline`` small enough to train on 2 CPU cores; ``two_experts``: Wan2.2-shaped
    (``transformer_2`` and ``boundary_ratio``; 0.875 is Wan2.2 T2V-A14B's)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel


    tokenizer = tiny_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()

        def transformer():
            return WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=TINY_Z_DIM,
                out_channels=TINY_Z_DIM, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)

        experts = [transformer(), transformer() if two_experts else None]
        vae = AutoencoderKLWan(base_dim=8, z_dim=TINY_Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.05, 0.3],
                               latents_std=[1.5, 0.8, 1.2, 2.0])
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=experts[0],
                       transformer_2=experts[1], boundary_ratio=boundary_ratio if two_experts else None)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


class WanPolicy(Policy):
    """Frozen Wan parts plus a trainable peft LoRA on each expert, or each expert trained in full (see the module
    docstring).

    ``policy.num_frames`` (default 81, the twin's 9) must be 4 k + 1; ``policy.guidance_scale_2`` is the
    low-noise expert's CFG scale (Wan2.2; None = ``guidance_scale``).
    """

    family = "wan"
    pipeline_class_name = "WanPipeline"
    video = True
    default_lora_targets = WAN_LORA_TARGETS
    adapter_mismatch_hint = (" (a Wan2.2 adapter holds one LoRA per expert, transformer and transformer_2: "
                             "peft_transformer_2/ or diffusers_transformer_2/ beside peft/ or diffusers/; a Wan2.1 "
                             "model has one transformer)")

    @classmethod
    def trained_network_names(cls, model_index: dict) -> set[str]:
        """Wan2.2 (``transformer_2`` in ``model_index.json``): both experts; Wan2.1: ``transformer``."""
        return {"transformer"} | ({"transformer_2"} if (model_index.get("transformer_2") or [None])[0] else set())

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_wan_pipeline(seed, dtype)

    def setup(self, pipeline) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        if pipeline.transformer is None:
            raise ValueError("policy.pretrained: a Wan pipeline without `transformer` (low-noise only) is not supported")
        self.transformer = pipeline.transformer
        self.transformer_2 = pipeline.transformer_2
        self.boundary_ratio = pipeline.config.boundary_ratio
        if self.transformer_2 is not None and self.boundary_ratio is None:
            raise ValueError("policy.pretrained: a Wan pipeline with transformer_2 needs a boundary_ratio")
        self.vae = pipeline.vae
        self.text_encoders = nn.ModuleList([pipeline.text_encoder])
        cfg = pipeline.scheduler.config
        # UniPC (the released pipelines) calls it flow_shift, the flow-matching scheduler shift
        shift = float(cfg.get("flow_shift") or cfg.get("shift") or 1.0)
        if not isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler):
            self.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift, num_train_timesteps=cfg.num_train_timesteps)
        self.temporal, self.spatial = pipeline.vae_scale_factor_temporal, pipeline.vae_scale_factor_spatial
        # the twin's 32 px; WanPipeline's default 480 x 832 (height x width) for a saved pipeline
        self.set_size(32 if self.config.pretrained is None else (480, 832))
        frames = self.config.num_frames or (TINY_FRAMES if self.config.pretrained is None else 81)
        if (frames - 1) % self.temporal:
            raise ValueError(f"policy.num_frames must be {self.temporal} k + 1 (the VAE's temporal compression), "
                             f"got {frames}")
        self.num_frames = frames

    # ------------------------------------------------------------------ experts
    @property
    def experts(self) -> list[nn.Module]:
        """``transformer`` (high noise) and, for Wan2.2, ``transformer_2`` (low noise)."""
        return list(self.trained_networks().values())

    def high_noise(self, t: Tensor) -> Tensor:
        """Which samples the high-noise expert (``transformer``) takes: 1000 t >= 1000 boundary_ratio, in
        float32 as ``WanPipeline`` compares its float32 timesteps (all True for one expert)."""
        if self.transformer_2 is None:
            return torch.ones(t.shape, dtype=torch.bool, device=t.device)
        return t.float() * 1000 >= self.boundary_ratio * 1000

    @property
    def expert_names(self) -> tuple[str, ...]:
        """Wan2.2: ("high_noise", "low_noise") -- ``transformer``, ``transformer_2``; Wan2.1: none (one network)."""
        return () if self.transformer_2 is None else ("high_noise", "low_noise")

    def expert_index(self, times: Tensor) -> list[int]:
        """0 (``transformer``) or 1 (``transformer_2``) at each time; ``expert_starts`` (where the planner cuts
        windows) follows from it."""
        return [0 if high else 1 for high in self.high_noise(times).tolist()]

    def trained_networks(self) -> dict[str, nn.Module]:
        """Both experts train (a LoRA each, or in full): FSDP2 shards both, the KL reference covers both, the
        export writes ``transformer_2`` beside ``transformer`` (loaded by ``WanPipeline.load_lora_weights(dir,
        load_into_transformer_2=True)``; a full export: ``WanPipeline.from_pretrained(base, transformer_2=...)``)."""
        low = {} if self.transformer_2 is None else {"transformer_2": self.transformer_2}
        return {"transformer": self.transformer} | low

    # ------------------------------------------------------------------ shapes and schedule
    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        frames = (self.num_frames - 1) // self.temporal + 1
        return (self.transformer.config.in_channels, frames, self.height // self.spatial, self.width // self.spatial)

    def cfg(self, guidance: Guidance) -> bool:
        """True CFG when either expert's scale is > 1 (both then take the negative branch)."""
        return guidance.scale > 1.0 or (self.transformer_2 is not None and (guidance.scale_2 or 1.0) > 1.0)

    # ------------------------------------------------------------------ condition, velocity, decode
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """Through the pipeline's own ``encode_prompt`` (cleaning, UMT5, zeros past each prompt's length)."""
        cfg = self.cfg(guidance or self.guidance())
        pe, neg = self._pipeline.encode_prompt(
            prompt=list(prompts), negative_prompt=[self.config.negative_prompt] * len(prompts),
            do_classifier_free_guidance=cfg, max_sequence_length=self.config.max_sequence_length,
            device=self.device)
        return (pe, neg) if cfg else (pe,)

    def _expert_velocity(self, expert: nn.Module, cfg: bool, scale: float, z: Tensor, t: Tensor, cond) -> Tensor:
        dtype = expert.dtype
        timestep = t * 1000  # float32, as the pipeline's timesteps (sigmas * 1000)
        if not cfg:
            return expert(hidden_states=z.to(dtype), timestep=timestep, encoder_hidden_states=cond[0].to(dtype),
                          return_dict=False)[0]
        pe, neg = cond
        out = expert(hidden_states=torch.cat([z, z]).to(dtype), timestep=torch.cat([timestep, timestep]),
                     encoder_hidden_states=torch.cat([pe, neg]).to(dtype), return_dict=False)[0]
        v_c, v_u = out.chunk(2)
        return v_u + scale * (v_c - v_u)

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...], guidance: Guidance | None = None) -> Tensor:
        """v(z, t) on latents ``[n, C, F', H', W']``, ``t`` [n] in [0, 1]; each sample through its expert, with its
        expert's scale (``guidance.scale``; the low-noise expert ``guidance.scale_2``, None = the same)."""
        guidance = guidance or self.guidance()
        cfg, w1 = self.cfg(guidance), guidance.scale
        w2 = guidance.scale_2 if guidance.scale_2 is not None else w1
        high = self.high_noise(t)
        if self.transformer_2 is None or bool(high.all()):
            return self._expert_velocity(self.transformer, cfg, w1, z, t, cond)
        if not bool(high.any()):
            return self._expert_velocity(self.transformer_2, cfg, w2, z, t, cond)
        hi, lo = high.nonzero().squeeze(1), (~high).nonzero().squeeze(1)  # a mixed batch (batched anchors)
        v_hi = self._expert_velocity(self.transformer, cfg, w1, z[hi], t[hi], batch_slice(cond, hi))
        v_lo = self._expert_velocity(self.transformer_2, cfg, w2, z[lo], t[lo], batch_slice(cond, lo))
        out = v_hi.new_zeros((z.shape[0], *v_hi.shape[1:]))
        return out.index_put((hi,), v_hi).index_put((lo,), v_lo.to(v_hi.dtype))

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, C, F', H', W']`` -> videos ``[B, F, 3, H, W]`` in [0, 1], float32."""
        cfg = self.vae.config
        z = latents.to(self.vae.dtype)
        mean = torch.tensor(cfg.latents_mean, dtype=z.dtype, device=z.device).view(1, cfg.z_dim, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, dtype=z.dtype, device=z.device).view(1, cfg.z_dim, 1, 1, 1)
        video = self.vae.decode(z * std + mean, return_dict=False)[0]  # [B, 3, F, H, W]
        return (video.float() / 2 + 0.5).clamp(0, 1).transpose(1, 2).contiguous()


class Wan22TinyPolicy(WanPolicy):
    """``policy.family: wan22``: :class:`WanPolicy` whose tiny twin (``pretrained: null``) has Wan2.2's two
    experts. A saved Wan2.2 pipeline is detected as ``wan`` (the same class handles both)."""

    family = "wan22"

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_wan_pipeline(seed, dtype, two_experts=True)
