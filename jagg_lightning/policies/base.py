"""The policy interface every model family implements, and what the families share.

A policy is a frozen diffusers pipeline (text encoders, VAE, transformer) plus a trainable peft LoRA on
each trained network (the transformer; Wan2.2's two experts), or those networks trained in full. The module, the engine and the callbacks call only what is listed here; nothing
outside ``policies/`` knows a family's tensor layout.

How to write a family (``policies/<family>.py``, then one line in ``policies/__init__.py``)::

    class MyPolicy(Policy):
        family = "my_family"                  # the name users give as ``policy.family``
        pipeline_class_name = "MyPipeline"    # diffusers class; model_index.json ``_class_name``
        default_lora_targets = [...]          # peft target_modules when policy.lora_targets is null

        @classmethod
        def build_tiny_pipeline(cls, seed, dtype): ...   # random, offline, a real pipeline instance
        def setup(self, pipeline): ...                    # take what is needed: self.transformer, self.vae, ...
        def encode_prompts(self, prompts, guidance=None): ...  # -> batch-first tuple of tensors
        def velocity(self, z, t, cond, guidance=None): ...     # [n, *latent_shape] -> same shape, guided
        def decode(self, latents): ...                    # -> images [n, 3, H, W] float32 in [0, 1]
                                                          #    (default: AutoencoderKL with scaling/shift)
        def decode_samples(self, latents, prompts): ...   # optional: the rollout's / evaluation's decode, given
                                                          #    each sample's prompt (default: decode(latents))
        @property
        def latent_shape(self): ...                       # per-sample shape of z (what the SDE sees)

The base class then provides loading (``load_pipeline``: diffusers' own ``from_pretrained``, never
``trust_remote_code``), freezing, the LoRA of every trained network (``adapters.attach_lora``: float32 trainable
weights whatever the frozen dtype, float64 with float64; or ``full_finetune.train_in_full``), ``lora_parameters``,
``adapter_disabled`` (the KL reference; ``reference.py`` for a full fine-tune), ``enable_gradient_checkpointing``,
``guidance`` and ``schedule`` -- all over ``trained_networks()``. The config (``config.PolicyConfig``) checks its
fields alone; what its files say is checked by ``policies.checks.check_policy``.

Contract details the engine relies on:

* Guidance is passed, never read from a changed config: ``guidance`` is a :class:`Guidance` (``scale``, and
  ``scale_2`` for Wan2.2's low-noise expert); None means the configured one (``self.guidance()``). The rollout,
  the update and evaluation each hand theirs to every call. ``cfg(guidance)`` says whether it takes a negative
  branch (override it: FLUX.1's embedded guidance never does).
* ``encode_prompts(prompts, guidance)`` returns a tuple of tensors whose first dimension is the batch, so the
  engine may ``repeat_interleave``, slice and concatenate it per sample (``batching.batch_slice``).
  Negative / unconditional parts, when ``cfg(guidance)``, are further entries.
* ``velocity(z, t, cond, guidance)``: ``z`` [n, *latent_shape] in the SDE dtype (float32, float64 in float64
  runs), ``t`` [n] in [0, 1] (time runs 1 -> 0), ``cond`` encoded for the same guidance. It returns v = dz/dt
  with the guidance applied (CFG: both branches in ONE batched forward of 2n rows per network -- a family must
  keep it so, tests/families/test_cfg_one_batch.py; FLUX.1-dev: embedded guidance, one forward of n), in the
  transformer dtype; the engine upcasts for the SDE. Differentiable w.r.t. the LoRA weights.
* ``schedule(num_steps, shift=None)``: float32 times t_0 = 1 > ... > t_S = 0 (length S + 1), equal
  to the family pipeline's own scheduler sigmas for that step count and ``resolution`` (override
  ``scheduler_kwargs`` for e.g. FLUX's resolution-dependent dynamic shift). ``shift`` forces a static
  shift instead of the scheduler's.
* ``guided``: ``cfg`` of the configured guidance.
* ``pipeline_class``: the diffusers pipeline class (``save_lora_weights`` / ``load_lora_weights``).
* ``setup`` must set ``self.height`` / ``self.width`` (pixels: ``set_size(native)``; ``resolution`` is the
  pair); the base then checks each side against ``pixel_multiple`` (set ``packing`` for 1x1 patches of 2x2-packed
  latents).
* Several networks (Wan2.2's two experts): ``expert_names`` / ``expert_index(times)`` say which runs at each step
  (windows are cut where it changes: ``expert_starts``; ``RoutingStats`` logs per expert), ``sharded_networks()``
  lists what FSDP2 shards, ``extra_lora_modules()`` what the export writes beside ``transformer``; both follow
  from ``trained_networks()`` (attribute name -> network: each gets a LoRA or trains in full, a KL reference copy,
  and its part of ``policy.adapter``; the base methods all work on it, so such a family overrides only it and its
  expert map).
* Available to a family: ``self.config`` (the PolicyConfig), ``self._pipeline`` (kept outside the module
  tree, for its ``encode_prompt``), ``self.scheduler`` (a copy), ``self.lora_targets`` (effective).
* Tests: add a ``FamilyCase`` to tests/support/family_cases.py and tests/families/test_families.py runs on the new twin, or
  give the family its own test file as tests/families/test_family_qwen_image.py (docs/model_families.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from jagg_lightning.config import PolicyConfig, image_size
from jagg_lightning.models.adapters import attach_lora
from jagg_lightning.models.full_finetune import train_in_full
from jagg_lightning.models.reference import reference_applied
from jagg_lightning.utils.assets import resolve_path
from jagg_lightning.utils.dtypes import DTYPES

# The joint-attention projections of both streams (image and text) of an MM-DiT block: Flow-GRPO's SD3
# targets, and the attention part of the Qwen-Image targets.
JOINT_ATTENTION_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]


@dataclass(frozen=True)
class Guidance:
    """The guidance one call of :meth:`Policy.encode_prompts` / :meth:`Policy.velocity` applies: ``scale`` is the
    family's guidance (classifier-free v_u + scale (v_c - v_u), 1.0 = off; FLUX.1-dev's embedded guidance) and
    ``scale_2`` the low-noise expert's (Wan2.2; None = ``scale``). Rollouts, training and evaluation each pass their
    own (``sampling.train_guidance_scale``, ``evaluation.guidance_scale``); nothing changes ``policy.config``."""

    scale: float = 1.0
    scale_2: float | None = None


class Policy(nn.Module):
    """Frozen pipeline parts plus a trainable peft LoRA on each trained network (see the module docstring)."""

    family: str = ""
    pipeline_class_name: str = ""
    video: bool = False  # a video family (``policy.num_frames``; ``decode`` gives [n, F, 3, H, W])
    default_lora_targets: list[str] = []
    # how many condition images each prompt carries (min, max): (0, 0) text-to-image / video; an editing or
    # image-to-video family's encode_prompts reads them (jagg_lightning.models.conditions); checked before training
    condition_images: tuple[int, int] = (0, 0)

    def __init__(self, config: PolicyConfig | None = None, pipeline=None):
        super().__init__()
        self.config = config = config or PolicyConfig(family=self.family)
        if not self.video and config.num_frames not in (None, 1):  # before anything is built
            raise ValueError(f"policy.num_frames: the {self.family} family makes images (null or 1), got "
                             f"{config.num_frames}")
        dtype = DTYPES[config.dtype]
        if pipeline is None:
            if config.pretrained is None:
                pipeline = self.build_tiny_pipeline(config.seed, dtype)
            else:
                pipeline = self.load_pipeline(resolve_path(config.pretrained, "policy.pretrained", hub=True), dtype,
                                              config)
        # the pipeline is kept outside the module tree (its encode_prompt is reused); the scheduler is copied
        object.__setattr__(self, "_pipeline", pipeline)
        self.scheduler = type(pipeline.scheduler).from_config(pipeline.scheduler.config)
        self.setup(pipeline)
        self.check_resolution(self.config.resolution or self.resolution,  # the value as the user wrote it
                              self.pixel_multiple(self.vae.config, self.transformer.config))
        for module in self.frozen_modules():
            module.requires_grad_(False)
            module.eval()
        if config.trainable == "full":  # no adapter: (a subset of) the networks' own weights, float32 masters
            self.lora_targets, self.frozen_reference = [], None
            train_in_full(self.trained_networks(), config.trainable_modules, dtype)
        else:  # the effective peft target_modules: policy.adapter's, or policy.lora_targets, or the family's
            self.lora_targets = attach_lora(self, self.trained_networks(), dtype)

    @classmethod
    def adapter_mismatch(cls, path: str, found, expected) -> str:
        return (f"policy.adapter: {path!r} holds a LoRA for {sorted(found)} but this {cls.family} model adapts "
                f"{sorted(expected)}{cls.adapter_mismatch_hint}")

    # ------------------------------------------------------------------ what a family writes
    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        """A random instance of the family's pipeline, built offline, small enough for CPU tests."""
        raise NotImplementedError

    def setup(self, pipeline) -> None:
        """Take the components from ``pipeline`` (at least ``self.transformer``) and check the config."""
        raise NotImplementedError

    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """Batch-first condition of ``prompts``; with CFG (:meth:`cfg` of ``guidance``, None = the configured one)
        the negative branch's entries too."""
        raise NotImplementedError

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...], guidance: Guidance | None = None) -> Tensor:
        """v(z, t) under ``guidance`` (None = the configured one), ``cond`` encoded for that guidance."""
        raise NotImplementedError

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> images [n, 3, H, W] in [0, 1], float32, through ``self.vae`` (an ``AutoencoderKL``
        with ``scaling_factor`` / ``shift_factor``; a family with another VAE overrides this)."""
        cfg = self.vae.config
        latents = latents.to(self.vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        images = self.vae.decode(latents, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def decode_samples(self, latents: Tensor, prompts: list[str]) -> Tensor:
        """The final latents of samples of ``prompts`` (one prompt per sample) -> images: :meth:`decode`. A family
        whose sampled latent leaves out what the condition fixes (Wan2.2 TI2V: the first latent frame is the
        image's) puts it back from the prompts first."""
        return self.decode(latents)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def scheduler_kwargs(self, num_steps: int) -> dict:
        """Extra arguments the family pipeline passes to ``retrieve_timesteps`` (sigmas, mu)."""
        return {}

    # ------------------------------------------------------------------ shared
    @classmethod
    def load_pipeline(cls, pretrained: str, dtype: torch.dtype, config: PolicyConfig):
        """diffusers' own loading path; never ``trust_remote_code``."""
        import diffusers

        return getattr(diffusers, cls.pipeline_class_name).from_pretrained(pretrained, torch_dtype=dtype)

    @property
    def pipeline_class(self) -> type:
        """The family's diffusers pipeline class (``save_lora_weights`` / ``load_lora_weights`` live there)."""
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    def frozen_modules(self) -> list[nn.Module]:
        """What is frozen before the LoRA (or the full-training weights) is made trainable: the trained networks, the
        VAE and the text encoders."""
        parts = (getattr(self, "vae", None), getattr(self, "text_encoders", None))
        return [*self.trained_networks().values(), *(m for m in parts if m is not None)]

    def guidance(self, scale: float | None = None) -> Guidance:
        """``policy.guidance_scale`` (and ``guidance_scale_2``), with ``scale`` in place of the first when given."""
        return Guidance(float(self.config.guidance_scale if scale is None else scale), self.config.guidance_scale_2)

    def cfg(self, guidance: Guidance) -> bool:
        """Whether ``guidance`` is classifier-free guidance: ``cond`` then carries a negative branch and the velocity
        takes a second (batched) forward. CFG families: scale > 1; FLUX.1's embedded guidance: never."""
        return guidance.scale > 1.0

    @property
    def guided(self) -> bool:
        """:meth:`cfg` of the configured guidance (``policy.guidance_scale``)."""
        return self.cfg(self.guidance())

    def lora_parameters(self) -> list[nn.Parameter]:
        """The trainable weights of every trained network: the LoRA's (or, with ``trainable: full``, the networks' own)."""
        return [p for network in self.trained_networks().values() for p in network.parameters() if p.requires_grad]

    @contextmanager
    def adapter_disabled(self):
        """The KL reference: the trained networks with their LoRA switched off (``trainable: full``: the frozen copies
        of the initial networks swapped in, :mod:`jagg_lightning.models.reference`)."""
        if self.config.trainable == "full":
            with reference_applied(self):
                yield
            return
        networks = list(self.trained_networks().values())
        for network in networks:
            network.disable_adapters()
        try:
            yield
        finally:
            for network in networks:
                network.enable_adapters()

    # the transformer's patch side in latent pixels; the packed families (FLUX.1/.2) take 1x1 patches of 2x2 packs
    packing: int | None = None

    @classmethod
    def pixel_multiple(cls, vae_config, transformer_config) -> int:
        """What ``policy.resolution`` must be a multiple of: the VAE's spatial factor times the patch side. Read from
        the loaded modules' configs or, before any model is built, from the pipeline folder's JSON files."""
        if vae_config.get("scale_factor_spatial"):  # Wan's VAE says it
            factor = int(vae_config["scale_factor_spatial"])
        elif vae_config.get("temperal_downsample") is not None:  # Wan / Qwen-Image VAEs (diffusers' spelling)
            factor = 2 ** len(vae_config["temperal_downsample"])
        else:
            factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
        patch = cls.packing or transformer_config.get("patch_size") or transformer_config.get("all_patch_size") or 1
        return factor * int(patch[-1] if isinstance(patch, (list, tuple)) else patch)

    @staticmethod
    def check_resolution(resolution, multiple: int) -> None:
        """Each side of ``resolution`` (``[H, W]`` or one side) a multiple of ``multiple``, or one error naming it."""
        if any(side % multiple for side in image_size(resolution, None)):
            shown = list(resolution) if isinstance(resolution, (list, tuple)) else resolution
            raise ValueError(f"policy.resolution must be a multiple of {multiple} per side (the VAE factor x the patch "
                             f"side), got {shown}")

    @property
    def resolution(self) -> tuple[int, int]:
        """(height, width) in pixels of the images -- a video's frames -- the policy samples (``setup`` sets
        ``self.height`` and ``self.width``, from ``policy.resolution`` or the family's native size)."""
        return self.height, self.width

    def set_size(self, native) -> None:
        """``self.height`` / ``self.width`` from ``policy.resolution``, or ``native`` (a side or ``(H, W)``) when None."""
        self.height, self.width = image_size(self.config.resolution, native)

    # the names of the networks a sampling step may run on, in expert-index order (Wan2.2: "high_noise",
    # "low_noise"); empty for a family with one network. Per-expert statistics (``RoutingStats``) use them.
    expert_names: tuple[str, ...] = ()

    def expert_index(self, times: Tensor) -> list[int]:
        """The expert (index into ``expert_names``) that runs at each of ``times`` (a step k at t_k). One network: 0."""
        return [0] * len(times)

    def expert_starts(self, times: Tensor) -> tuple[int, ...]:
        """Sampling steps (times t_0..t_S) where another network takes over (Wan2.2's low-noise expert): no JAGG
        window straddles one. One network: none."""
        experts = self.expert_index(times[:-1])
        return tuple(k for k in range(1, len(experts)) if experts[k] != experts[k - 1])

    def trained_networks(self) -> dict[str, nn.Module]:
        """The networks that train (attribute name -> module; each gets a LoRA, or trains in full): ``transformer``.
        Wan2.2 adds ``transformer_2``. The KL reference, FSDP2, the exports and ``policy.adapter`` cover each."""
        return {"transformer": self.transformer}

    # appended to the error of a ``policy.adapter`` made for other networks (Wan: Wan2.2's two experts vs Wan2.1's one)
    adapter_mismatch_hint: str = ""

    @classmethod
    def trained_network_names(cls, model_index: dict) -> set[str]:
        """The names ``trained_networks()`` will have for a pipeline folder's ``model_index.json``, known before any
        model is built (``policy.adapter`` is checked against them): ``transformer``."""
        return {"transformer"}

    def sharded_networks(self) -> list[nn.Module]:
        """The networks FSDP2 shards (each block, then the network; ``strategies.shard_policy``): the trained ones."""
        return list(self.trained_networks().values())

    def extra_lora_modules(self) -> dict[str, nn.Module]:
        """Further adapted networks an export writes beside ``transformer`` (name -> module): the trained ones but it."""
        return {n: m for n, m in self.trained_networks().items() if n != "transformer"}

    def enable_gradient_checkpointing(self) -> None:
        """Recompute the trained networks' blocks' activations in backward (diffusers' own switch)."""
        for network in self.trained_networks().values():
            network.enable_gradient_checkpointing()

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def schedule(self, num_steps: int, shift: float | None = None) -> Tensor:
        """t_0 = 1 > ... > t_S = 0, float32 on the CPU: the family scheduler's sigmas for ``num_steps``
        at ``resolution``, set the way the family pipeline sets them; ``shift`` forces a static shift."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

        overrides = {} if shift is None else {"shift": float(shift), "use_dynamic_shifting": False}
        scheduler = type(self.scheduler).from_config(self.scheduler.config, **overrides)
        # a static shift replaces the dynamic one: the resolution's mu is then not passed
        kwargs = {k: v for k, v in self.scheduler_kwargs(num_steps).items()
                  if k != "mu" or scheduler.config.get("use_dynamic_shifting")}
        if "sigmas" in kwargs:
            retrieve_timesteps(scheduler, None, "cpu", **kwargs)
        else:
            retrieve_timesteps(scheduler, num_steps, "cpu", **kwargs)
        return scheduler.sigmas.to(torch.float32)
