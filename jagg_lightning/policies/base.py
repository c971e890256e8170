"""The policy interface every model family implements, and what the families share.

A policy is a frozen diffusers pipeline (text encoders, VAE, transformer) plus a trainable peft LoRA on
the transformer. The module, the engine and the callbacks call only what is listed here; nothing
outside ``policies/`` knows a family's tensor layout.

How to write a family (``policies/<family>.py``, then one line in ``policies/__init__.py``)::

    class MyPolicy(Policy):
        family = "my_family"                  # the name users give as ``policy.family``
        pipeline_class_name = "MyPipeline"    # diffusers class; model_index.json ``_class_name``
        default_lora_targets = [...]          # peft target_modules when policy.lora_targets is null

        @classmethod
        def build_tiny_pipeline(cls, seed, dtype): ...   # random, offline, a real pipeline instance
        def setup(self, pipeline): ...                    # take what is needed: self.transformer, self.vae, ...
        def encode_prompts(self, prompts): ...            # -> batch-first tuple of tensors
        def velocity(self, z, t, cond): ...               # [n, *latent_shape] -> same shape, with guidance
        def decode(self, latents): ...                    # -> images [n, 3, H, W] float32 in [0, 1]
                                                          #    (default: AutoencoderKL with scaling/shift)
        @property
        def latent_shape(self): ...                       # per-sample shape of z (what the SDE sees)

The base class then provides loading (``load_pipeline``: diffusers' own ``from_pretrained``, never
``trust_remote_code``), freezing, the LoRA (float32 trainable weights whatever the frozen dtype;
float64 with float64), ``lora_parameters``, ``adapter_disabled`` (the KL reference),
``enable_gradient_checkpointing`` and ``schedule``.

Contract details the engine relies on:

* ``encode_prompts(prompts)`` returns a tuple of tensors whose first dimension is the batch, so the
  engine may ``repeat_interleave``, slice and concatenate it per sample (``batching.batch_slice``).
  Negative / unconditional parts, when the family's guidance needs them, are further entries.
* ``velocity(z, t, cond)``: ``z`` [n, *latent_shape] in the SDE dtype (float32, float64 in float64
  runs), ``t`` [n] in [0, 1] (time runs 1 -> 0). It returns v = dz/dt with the family's guidance
  applied (SD3: CFG with a second forward; FLUX.1-dev: embedded guidance, one forward), in the
  transformer dtype; the engine upcasts for the SDE. Differentiable w.r.t. the LoRA weights.
* ``schedule(num_steps, shift=None)``: float32 times t_0 = 1 > ... > t_S = 0 (length S + 1), equal
  to the family pipeline's own scheduler sigmas for that step count and ``resolution`` (override
  ``scheduler_kwargs`` for e.g. FLUX's resolution-dependent dynamic shift). ``shift`` forces a static
  shift instead of the scheduler's.
* ``guided``: whether ``cond`` carries the negative branch (CFG with two forwards).
* ``pipeline_class``: the diffusers pipeline class (``save_lora_weights`` / ``load_lora_weights``).
* ``setup`` must set ``self.resolution`` (pixels; callbacks size their grids from it); the base then checks it
  against ``pixel_multiple`` (set ``packing`` for 1x1 patches of 2x2-packed latents).
  Read guidance from ``self.config.guidance_scale`` at call time (evaluation changes it temporarily).
* Several networks (Wan2.2's two experts): ``expert_names`` / ``expert_index(times)`` say which runs at each step
  (windows are cut where it changes: ``expert_starts``; ``RoutingStats`` logs per expert), ``sharded_networks()``
  lists what FSDP2 shards, ``extra_lora_modules()`` what the export writes beside ``transformer``; both follow
  from ``trained_networks()`` (attribute name -> network: each gets a LoRA or trains in full, a KL reference copy,
  and its part of ``policy.adapter``).
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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class PolicyConfig:
    """What to load and how to adapt it.

    family: the model family ("sd3", "flux", ...); None = detected from the pipeline's model_index.json
        (``_class_name``), or "sd3" when ``pretrained`` is None.
    pretrained: local directory or hub id of the family's pipeline; None builds the family's tiny model.
    lora_rank / lora_alpha / lora_targets: the peft LoRA; lora_targets None = the family's default
        (Flow-GRPO's targets for that family).
    guidance_scale: the family's guidance: CFG for SD3 (1.0 = off, one forward instead of two), the
        embedded distilled guidance for FLUX.1-dev.
    resolution: image side in pixels; None = the transformer's native sample size.
    dtype: dtype of the frozen weights; LoRA weights and SDE math stay float32 (float64 if chosen).
    gradient_checkpointing: recompute each transformer block's activations in backward (diffusers'
        non-reentrant checkpointing): less activation memory, about one extra block forward per backward.
    trainable: "lora" (a peft LoRA on the frozen transformer) or "full" (every transformer weight trained, Wan2.2's
        two experts' both; float32 master weights; ``dtype`` is then the compute dtype, see docs/full_finetuning.md).
    trainable_modules: with "full", module-name patterns (a name, a dotted suffix of one, or an fnmatch
        pattern) to train only those modules in full; null = every weight. Each must match some module.
    reference_offload: with "full" and kl_beta > 0, keep the frozen KL reference copy on the CPU between uses.
    num_frames: video families only (Wan): frames per video, 4 k + 1; None = the family's default.
    guidance_scale_2: two-expert video families only (Wan2.2): the low-noise expert's CFG; None = guidance_scale.
    adapter: an exported LoRA (``LoRAExport``'s folder, its ``peft/`` or ``diffusers/`` part) to start from:
        its rank, alpha and targets replace lora_rank / lora_alpha / lora_targets (evaluate, sample or train on);
        Wan2.2: ``transformer_2`` loads the ``peft_transformer_2/`` or ``diffusers_transformer_2/`` part beside it.

    Local paths (``pretrained``, ``adapter``) are found from any directory (:mod:`jagg_lightning.assets`:
    ``pretrained: digits`` is the shipped test bed); a missing one fails here, naming the field.
    """

    pretrained: str | None = None
    family: str | None = None
    lora_rank: int = 32
    lora_alpha: float = 64.0
    lora_targets: list[str] | None = None
    guidance_scale: float = 4.5
    negative_prompt: str = ""
    max_sequence_length: int = 128
    resolution: int | None = None
    dtype: str = "float32"
    load_t5: bool = True
    seed: int = 0
    gradient_checkpointing: bool = False
    trainable: str = "lora"
    trainable_modules: list[str] | None = None
    reference_offload: bool = False
    num_frames: int | None = None
    guidance_scale_2: float | None = None
    adapter: str | None = None

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
        if self.num_frames is not None:  # the 4 k + 1 rule is the VAE's, checked by the family
            integer("num_frames", self.num_frames, "an integer >= 1 or null", lambda v: v >= 1)
        if self.guidance_scale_2 is not None and (isinstance(self.guidance_scale_2, bool) or not isinstance(
                self.guidance_scale_2, (int, float)) or self.guidance_scale_2 < 1.0):
            raise ValueError(f"policy.guidance_scale_2 must be >= 1.0 or null, got {self.guidance_scale_2!r}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(f"policy.gradient_checkpointing must be true or false, got {self.gradient_checkpointing!r}")
        if self.lora_targets is not None and (isinstance(self.lora_targets, str) or not self.lora_targets or not all(
                isinstance(t, str) and t for t in self.lora_targets)):
            raise ValueError("policy.lora_targets must be a non-empty list of module names or null (the family's "
                             f"default), got {self.lora_targets!r}")
        from jagg_lightning.full_finetune import check_trainable

        check_trainable(self, PolicyConfig)
        if self.family is not None:
            from jagg_lightning.policies import check_family

            check_family(self.family)
        from jagg_lightning.adapters import adapter_format
        from jagg_lightning.assets import find_local, resolve_path

        resolve_path(self.pretrained, "policy.pretrained", hub=True)
        if self.adapter is not None:
            adapter_format(find_local(self.adapter) or resolve_path(self.adapter, "policy.adapter", kind="folder or file"))
        from jagg_lightning.policies import check_against_folder

        check_against_folder(self)


def add_lora(policy, network: nn.Module, shape: dict, seed: int, dtype: torch.dtype) -> None:
    """A peft LoRA of ``shape`` ({"r", "lora_alpha", "target_modules"}) on ``network``, gaussian A (seeded), B = 0,
    its weights float32 (float64 with float64)."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    targets = shape["target_modules"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            network.add_adapter(LoraConfig(r=shape["r"], lora_alpha=shape["lora_alpha"], init_lora_weights="gaussian",
                                           target_modules=targets))
        except ValueError:  # peft's NoMatchingPeftModuleError and its kin
            names = [n for n, m in network.named_modules() if isinstance(m, nn.Linear)]
            raise PolicyBuildError(f"policy.lora_targets {targets!r} match no layer of the {policy.family} "
                                   f"transformer (its layers are named like {', '.join(names[-3:])})") from None
    cast_training_params(network, dtype=torch.float64 if dtype == torch.float64 else torch.float32)


class PolicyBuildError(ValueError):
    """A configuration value that only the model can refute (LoRA targets, an adapter that does not fit): the
    CLI shows it as one ``jagg: error:`` line."""


class Policy(nn.Module):
    """Frozen pipeline parts plus a trainable peft LoRA on ``self.transformer`` (see the module docstring)."""

    family: str = ""
    pipeline_class_name: str = ""
    default_lora_targets: list[str] = []

    def __init__(self, config: PolicyConfig | None = None, pipeline=None):
        super().__init__()
        self.config = config = config or PolicyConfig(family=self.family)
        dtype = DTYPES[config.dtype]
        if pipeline is None:
            if config.pretrained is None:
                pipeline = self.build_tiny_pipeline(config.seed, dtype)
            else:
                from jagg_lightning.assets import resolve_path

                pipeline = self.load_pipeline(resolve_path(config.pretrained, "policy.pretrained", hub=True), dtype,
                                              config)
        # the pipeline is kept outside the module tree (its encode_prompt is reused); the scheduler is copied
        object.__setattr__(self, "_pipeline", pipeline)
        self.scheduler = type(pipeline.scheduler).from_config(pipeline.scheduler.config)
        self.setup(pipeline)
        self.check_resolution(self.resolution, self.pixel_multiple(self.vae.config, self.transformer.config))
        for module in self.frozen_modules():
            module.requires_grad_(False)
            module.eval()
        networks = self.trained_networks()
        if config.trainable == "full":  # no adapter: (a subset of) the networks' own weights, float32 masters
            from jagg_lightning.full_finetune import make_trainable

            self.lora_targets, self.frozen_reference = [], None
            for network in networks.values():
                make_trainable(network, config.trainable_modules, dtype)
            return
        # the effective peft target_modules (the family's default when policy.lora_targets is null)
        self.lora_targets = list(config.lora_targets if config.lora_targets is not None else self.default_lora_targets)
        shape = {"r": config.lora_rank, "lora_alpha": config.lora_alpha, "target_modules": self.lora_targets}
        adapters = self._read_adapters(config.adapter, networks) if config.adapter is not None else {}
        if adapters:  # an exported adapter: each network's own shape, then its weights
            self.lora_targets = adapters["transformer"][0]["target_modules"]
        for i, (name, network) in enumerate(networks.items()):  # seed + 1 for transformer, + 2 for transformer_2
            add_lora(self, network, adapters[name][0] if adapters else shape, config.seed + 1 + i, dtype)
            if adapters:
                from jagg_lightning.adapters import load_adapter_weights

                try:
                    load_adapter_weights(network, adapters[name][1])
                except ValueError as err:
                    raise PolicyBuildError(str(err) if name == "transformer" else f"{err} [{name}]") from None

    def _read_adapters(self, path: str, networks: dict[str, nn.Module]) -> dict:
        """``policy.adapter``: {network: (shape, weights)} for exactly the networks this policy trains."""
        from jagg_lightning.adapters import read_adapters
        from jagg_lightning.assets import find_local

        try:
            adapters = read_adapters(find_local(path) or path)
        except (ValueError, FileNotFoundError) as err:
            raise PolicyBuildError(str(err)) from None
        if set(adapters) != set(networks):
            raise PolicyBuildError(self.adapter_mismatch(path, adapters, networks))
        return adapters

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

    def encode_prompts(self, prompts: list[str]) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...]) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> images [n, 3, H, W] in [0, 1], float32, through ``self.vae`` (an ``AutoencoderKL``
        with ``scaling_factor`` / ``shift_factor``; a family with another VAE overrides this)."""
        cfg = self.vae.config
        latents = latents.to(self.vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        images = self.vae.decode(latents, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

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
        return [m for m in (getattr(self, "transformer", None), getattr(self, "vae", None),
                            getattr(self, "text_encoders", None)) if m is not None]

    @property
    def guided(self) -> bool:
        """True when ``cond`` carries a negative branch (classifier-free guidance with a second forward)."""
        return False

    def lora_parameters(self) -> list[nn.Parameter]:
        """The trainable weights: the LoRA's (or, with ``trainable: full``, the transformer's own)."""
        return [p for p in self.transformer.parameters() if p.requires_grad]

    trainable_parameters = lora_parameters

    @contextmanager
    def adapter_disabled(self):
        """The KL reference: the same transformer with the LoRA switched off (``trainable: full``: the frozen
        copy of the initial transformer swapped in, :mod:`jagg_lightning.reference`)."""
        if self.config.trainable == "full":
            from jagg_lightning.reference import reference_applied

            with reference_applied(self):
                yield
            return
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

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
    def check_resolution(resolution: int, multiple: int) -> None:
        if resolution % multiple:
            raise ValueError(f"policy.resolution must be a multiple of {multiple} (the VAE factor x the patch side), "
                             f"got {resolution}")

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
        """Recompute the transformer blocks' activations in backward (diffusers' own switch)."""
        self.transformer.enable_gradient_checkpointing()

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
