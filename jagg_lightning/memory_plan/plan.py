"""The memory of one training step per device, before anything is allocated (``jagg plan``).

Weights and optimizer state are counted from the meta model's parameters (bytes per element of their dtype);
the rollout's buffers from the shapes ``rollout.rollout_micro_batches`` allocates; activations are TRACED
(:mod:`jagg_lightning.memory_plan.trace`: one forward of the fake transformer under saved-tensor hooks, the unit of
``Sampler.activation_bytes``) and laid out as the update lays its passes out (``passes.pass_plan`` /
``passes.fused_samples`` under ``memory.budget_mb``):

* an exact pass keeps n a (n samples of one step, a = one sample's saved bytes, both CFG branches);
* a JAGG anchor pass keeps 2 n a (both anchors' graphs until their ONE backward; ``memory.anchors: split``: n a);
* the fused mode keeps (kept steps) x (kept samples) x a for a rollout micro-batch (two with ``reward_workers``).

Per device: FSDP2 divides the trained networks' weights, gradients and optimizer state by the data-parallel
processes (text encoders and VAE stay whole, :mod:`jagg_lightning.distributed.strategies`) and gathers two blocks at a time; a
context-parallel degree c divides the activations by c (each context rank holds 1/c of the sequence); FSDP2's CPU
offload moves the sharded weights, gradients and optimizer state to the host; ``policy.reference_offload`` keeps
the KL reference on the host between uses. Plain torch, no Lightning.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from jagg_lightning.config import image_size
from jagg_lightning.memory_plan.models import ModelSpec, meta_network, model_spec
from jagg_lightning.memory_plan.shapes import Geometry, condition_images, geometry, transformer_inputs, vision_tokens
from jagg_lightning.memory_plan.trace import traced_activation_bytes
from jagg_lightning.method.jagg import Window
from jagg_lightning.training.passes import fused_graph_steps, fused_samples, pass_plan
from jagg_lightning.training.rollout import plan_rollout
from jagg_lightning.utils.dtypes import DTYPES, compute_dtype

GiB = 2**30
HEADROOM = 0.9  # the share of device memory the plan may fill: the CUDA context, allocator fragmentation, the VAE
# decode and the reward model are not counted


@dataclass
class Setup:
    """Where the step runs: ``devices`` processes of ``device_memory_gib`` each, the strategy ("single", "ddp",
    "fsdp2"), FSDP2's ``cpu_offload`` and the ``context`` degree (context ranks per sample)."""

    devices: int = 1
    device_memory_gib: float = 80.0
    strategy: str = "single"
    cpu_offload: bool = False
    context: int = 1
    optimizer_states: int = 2  # per trainable weight, float32: AdamW's two moments
    ema: bool = False
    reward_workers: int = 0

    @property
    def data_parallel(self) -> int:
        return max(1, self.devices // self.context)

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp2"


@dataclass
class Row:
    name: str
    bytes: float
    note: str = ""
    resident: bool = True  # held the whole step (False: the peak of one phase)


@dataclass
class MemoryPlan:
    spec: ModelSpec
    setup: Setup
    geo: Geometry
    rows: list[Row]
    peak: float
    passes: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    suggestions: list[str] = field(default_factory=list)

    @property
    def limit(self) -> float:
        return self.setup.device_memory_gib * GiB * HEADROOM

    @property
    def fits(self) -> bool:
        return self.peak <= self.limit


def _blocks(network: nn.Module) -> list[nn.Module]:
    return [m for name, lst in network.named_children() if isinstance(lst, nn.ModuleList)
            and (name.endswith("blocks") or name == "layers" or name.endswith("_refiner")) for m in lst]


def count(n: float) -> str:
    """A parameter count as people write it: 24.69k, 613.4M, 28.6B."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.4g}M" if n >= 1e6 else f"{n / 1e3:.4g}k"


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def guided(spec: ModelSpec, policy, sampling) -> bool:
    """Whether the training velocity takes both CFG branches (the family's ``cfg`` of the training guidance)."""
    scale = sampling.train_guidance_scale if sampling.train_guidance_scale is not None else policy.guidance_scale
    if spec.family in ("flux", "flux_kontext", "flux2_dev"):  # embedded guidance: one forward
        return False
    if spec.family == "flux2":
        return scale > 1.0 and not spec.distilled
    if spec.family in ("wan", "wan_i2v") and spec.experts == 2:
        return scale > 1.0 or (policy.guidance_scale_2 or 1.0) > 1.0
    return scale > 1.0


def wan_expert_starts(spec: ModelSpec, sampling) -> tuple[int, ...]:
    """Where Wan2.2's low-noise expert takes over on the flow-matching schedule (shift ``sampling.shift`` or the
    scheduler's): as ``WanPolicy.expert_index`` on ``FlowMatchEulerDiscreteScheduler(shift)`` sigmas."""
    if spec.boundary_ratio is None or spec.experts < 2:
        return ()
    s, n = sampling.shift or spec.flow_shift, sampling.num_steps
    u = torch.linspace(1.0, 1.0 / 1000, n)
    sigmas = s * u / (1 + (s - 1) * u)
    high = [bool(x * 1000 >= spec.boundary_ratio * 1000) for x in sigmas.tolist()]
    return tuple(k for k in range(1, n) if high[k] != high[k - 1])


def routed_windows(sampling, jagg, breaks) -> list[Window]:
    """The step-0 rollout's windows, the share ``jagg_frac`` of the full ones marked routed (which ones does not
    change a pass count)."""
    windows = plan_rollout(sampling, jagg, 0, breaks=breaks).windows
    full = [i for i, w in enumerate(windows) if len(w.steps) == jagg.window_size]
    routed = set(full[: int(jagg.jagg_frac * len(full) + 0.5)])
    return [dataclasses.replace(w, routed=i in routed) for i, w in enumerate(windows)]


def plan_memory(policy, sampling, grpo, jagg, memory, prompts_per_device: int, setup: Setup,
                spec: ModelSpec | None = None, default_targets: list[str] | None = None,
                text_tokens: int | None = None, progress: Callable[[str], None] | None = None) -> MemoryPlan:
    """The per-device table of one training step of this config (see the module docstring). The condition's tokens:
    ``text_tokens``, else SD3's CLIP tokens + ``max_sequence_length`` and every other family's padded
    ``max_sequence_length`` (Qwen-Image's prompts are cut there, shorter ones cost less: the bound; Qwen-Image-Edit's
    add the source's Qwen2.5-VL image tokens, :func:`~jagg_lightning.memory_plan.shapes.vision_tokens`). ``progress``
    is told (one line) before each trace, the slow part (a large model: minutes)."""
    from jagg_lightning.policies import FAMILIES

    spec = spec or model_spec(policy)
    if default_targets is None:
        default_targets = FAMILIES[policy.family or spec.family].policy_class().default_lora_targets
    size = image_size(policy.resolution, spec.native_size)
    frames = policy.num_frames or spec.native_frames
    text = text_tokens or spec.clip_tokens + policy.max_sequence_length
    if spec.family == "qwen_image_edit" and not text_tokens:  # Qwen2.5-VL reads the source with the instruction
        text += vision_tokens(size, spec.condition)
    geo = geometry(spec.family, spec.transformer, spec.vae_spatial, spec.vae_temporal, size, frames, text,
                   spec.condition)
    cfg = guided(spec, policy, sampling)
    rows_per_sample = 2 if cfg else 1

    traced = dict(measure(spec, policy, default_targets, geo, rows_per_sample, setup.sharded, progress))
    return layout(spec, setup, geo, policy, sampling, grpo, jagg, memory, prompts_per_device, traced)


_MEASURED: dict = {}


def measure(spec: ModelSpec, policy, default_targets: list[str], geo: Geometry, rows: int, sharded: bool,
            progress: Callable[[str], None] | None = None) -> dict:
    """The meta network's parameters (as held: float32 masters of a full fine-tune) and one sample's traced
    activation bytes (+ one block's, recomputed in backward under gradient checkpointing); remembered per setting
    (the advice plans the same model many times)."""
    dtype = DTYPES[policy.dtype]
    # the dtype the forward computes in: a full fine-tune's float32 masters on one process, policy.dtype under FSDP2
    trace_dtype = compute_dtype(dtype) if policy.trainable == "full" and not sharded else dtype
    key = (id(spec), repr(policy), geo, rows, trace_dtype)
    if key in _MEASURED:
        return _MEASURED[key]
    network = meta_network(spec, policy, default_targets)

    def trace(checkpointing: bool) -> int:
        if progress is not None:
            progress(f"tracing one forward of the {spec.family} transformer on fake tensors: {geo.tokens} tokens + "
                     f"{geo.text} text tokens, {rows} branch{'es' if rows > 1 else ''}, {str(trace_dtype)[6:]}"
                     + (", gradient checkpointing" if checkpointing else ""))
        config = dataclasses.replace(policy, gradient_checkpointing=checkpointing)
        return traced_activation_bytes(lambda: meta_network(spec, config, default_targets, sharded),
                                       lambda: transformer_inputs(geo, spec.transformer, rows, trace_dtype))

    blocks = _blocks(network)
    per_sample = trace(policy.gradient_checkpointing)
    recompute = trace(False) / max(len(blocks), 1) if policy.gradient_checkpointing else 0.0
    _MEASURED[key] = result = dict(
        per_sample=per_sample, recompute=recompute, trainable=[p for p in network.parameters() if p.requires_grad],
        frozen=[p for p in network.parameters() if not p.requires_grad], blocks=blocks, dtype=dtype,
        rows_per_sample=rows, base_params=base_params(spec))
    return result


def base_params(spec: ModelSpec) -> int:
    """Parameters of one network of ``spec`` as published (no adapter), counted on the meta device."""
    with torch.device("meta"):
        return _numel(spec.transformer_class().from_config(spec.transformer).parameters())


def layout(spec, setup, geo, policy, sampling, grpo, jagg, memory, prompts, traced) -> MemoryPlan:
    """The table from the traced activation bytes and the meta network's parameters (no tracing: cheap to redo for
    another setting)."""
    # FSDP2 shards over every process, the context ranks too (the flattened mesh, docs/distributed.md)
    experts, shard = spec.experts, setup.devices if setup.sharded else 1
    dtype, master = traced["dtype"], compute_dtype(traced["dtype"])
    a = traced["per_sample"] / setup.context
    rows: list[Row] = []
    frozen_b = _bytes(traced["frozen"]) * experts / shard
    n_train = _numel(traced["trainable"]) * experts
    on_device = not (setup.sharded and setup.cpu_offload)
    frozen_dtype = str(traced["frozen"][0].dtype if traced["frozen"] else dtype).replace("torch.", "")
    rows.append(Row("frozen transformer weights", frozen_b if on_device else 0.0,
                    f"{count(_numel(traced['frozen']))} params x {experts} network(s) in {frozen_dtype}"
                    + (f" / {shard} (FSDP2)" if shard > 1 else "")
                    + ("" if on_device else ", on the host (FSDP2 cpu_offload)")))
    comps = {k: v for k, v in spec.components.items() if policy.load_t5 or not k.startswith("text_encoder_3")}
    rows.append(Row("text encoders + VAE (frozen, whole)", sum(comps.values()) * dtype.itemsize,
                    f"{count(sum(comps.values()))} params in {str(dtype).replace('torch.', '')}"))
    per_weight = 4 * (2 + setup.optimizer_states + (1 if setup.ema else 0))  # float32 master, grad, states, EMA
    bucket = 4 if setup.strategy == "ddp" and setup.devices > 1 else 0  # DDP's gradient buckets
    train_b = n_train * (per_weight + bucket) / shard
    ema_kept = 0.0 if on_device or not setup.ema else n_train * 4 / shard  # the EMA shadow is not offloaded
    rows.append(Row("trainable weights + grads + optimizer (float32)", train_b if on_device else ema_kept,
                    f"{count(n_train)} params x ({per_weight + bucket} B: weight, grad, {setup.optimizer_states} "
                    f"state{'s' if setup.optimizer_states != 1 else ''}{', EMA' if setup.ema else ''}"
                    f"{', DDP bucket' if bucket else ''}){f' / {shard}' if shard > 1 else ''}"
                    + ("" if on_device else ", on the host (FSDP2 cpu_offload)")))
    if setup.sharded:
        largest = max((_bytes(b.parameters()) for b in traced["blocks"]), default=0)
        gathered = 2 * largest * (dtype.itemsize / master.itemsize if policy.trainable == "full" else 1)
        if policy.trainable == "full":  # + the float32 unsharded gradient of the block being reduced
            gathered += largest
        rows.append(Row("FSDP2 all-gathered blocks", gathered, "two blocks unsharded at a time (prefetch)"
                        + (" + one block's float32 gradient" if policy.trainable == "full" else "")))
    reference = policy.trainable == "full" and grpo.kl_beta > 0
    if reference:
        ref_b = (_numel(traced["frozen"]) + n_train / experts) * experts * dtype.itemsize / shard
        rows.append(Row("KL reference copy", 0.0 if policy.reference_offload else ref_b,
                        "on the host between uses (policy.reference_offload)" if policy.reference_offload
                        else f"a frozen copy in {str(dtype).replace('torch.', '')}"))
    n = prompts * sampling.group_size  # samples per process
    latent = math.prod(geo.latent) * master.itemsize
    S = sampling.num_steps
    buffers = (S + 1) * n * latent + S * n * latent + S * n * master.itemsize + (S * n * latent if grpo.kl_beta > 0 else 0)
    rows.append(Row("rollout buffers", buffers, f"{n} samples x {S} steps: latents, velocities, log-probs"
                    + (", reference velocities" if grpo.kl_beta > 0 else "")))
    config = spec.transformer
    text_dim = (config.get("joint_attention_dim") or config.get("text_dim") or config.get("cap_feat_dim")
                or config.get("text_embed_dim") or 0)
    if spec.family in ("ltx2", "ltx2_i2v"):  # the video and the audio connectors' embeddings (LTX-2.0: both this wide)
        text_dim = 2 * config["caption_channels"]
    cond = n * traced["rows_per_sample"] * geo.text * text_dim * dtype.itemsize
    what = f"{geo.text} tokens x {text_dim} per sample and branch"
    if geo.glyph:  # HunyuanVideo 1.5: Qwen2.5-VL's (text_embed_dim wide) and ByT5's glyph tokens
        cond += n * traced["rows_per_sample"] * geo.glyph * config["text_embed_2_dim"] * dtype.itemsize
        what += f" + {geo.glyph} glyph tokens x {config['text_embed_2_dim']}"
    images, images_what = condition_images(geo, config, dtype.itemsize)  # the sources, first frames: per sample
    if images:
        cond, what = cond + n * images, what + f", and {images_what}"
    rows.append(Row("prompt condition", cond, what))
    resident = sum(r.bytes for r in rows)

    windows = routed_windows(sampling, jagg, wan_expert_starts(spec, sampling))
    routed = sum(w.routed for w in windows)
    exact = len({k for w in windows if not w.routed for k in w.steps})
    per_pass, split = pass_plan(min(grpo.train_batch_size, n), windows, memory, lambda: int(a))
    phases = {}
    if jagg.fused_rollout:
        kept = fused_graph_steps(windows, jagg, memory)
        graph_n = min(fused_samples(len(kept), memory, lambda: int(a)) or n, sampling.rollout_batch_size, n)
        held = 2 if setup.reward_workers else 1
        phases["fused kept graphs"] = (held * len(kept) * graph_n * a,
                                       f"{len(kept)} steps x {graph_n} samples{' x 2 micro-batches' if held > 1 else ''}")
    if exact or (jagg.fused_rollout and phases["fused kept graphs"][0] == 0):
        phases["exact pass"] = (per_pass * a, f"{per_pass} samples x 1 step")
    if routed:
        phases["JAGG anchor pass"] = ((1 if split else 2) * per_pass * a,
                                      f"{per_pass} samples x {'1 anchor (split)' if split else '2 anchors'}")
    if traced["recompute"]:
        phases = {k: (v + traced["recompute"] / setup.context * per_pass, d + " + one block recomputed")
                  for k, (v, d) in phases.items()}
    for name, (value, note) in phases.items():
        rows.append(Row(f"activations: {name}", value, note, resident=False))
    peak = resident + max((v for v, _ in phases.values()), default=0.0)
    if reference and policy.reference_offload and not setup.sharded:
        peak = max(peak, resident + ref_b)  # it visits the device whole for the rollout's reference forwards
    return MemoryPlan(spec, setup, geo, rows, peak,
                      passes=dict(windows=len(windows), routed=routed, exact_steps=exact, per_pass=per_pass,
                                  split_anchors=split, per_sample_bytes=traced["per_sample"]),
                      params=dict(trainable=n_train, per_network=traced["base_params"]))
