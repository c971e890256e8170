"""What to change when a plan does not fit: each candidate setting is planned again (activations re-traced only
when the setting changes them) and named with the peak it gives."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from jagg_lightning.memory_plan.plan import GiB, MemoryPlan, plan_memory

CONTEXT_FAMILIES = ("wan", "flux", "flux_kontext", "flux2", "flux2_dev", "qwen_image")  # a _cp_plan in diffusers


def _fits(plan: MemoryPlan) -> str:
    peak = f"{plan.peak / GiB:.1f} GiB" if plan.peak >= 0.95 * GiB else f"{plan.peak / 2**20:.1f} MiB"
    return f"peak {peak} ({'fits' if plan.fits else 'still does not fit'})"


def advise(plan: MemoryPlan, policy, sampling, grpo, jagg, memory, prompts: int,
           progress: Callable[[str], None] | None = None) -> list[str]:
    """One line per setting that helps, best first (those that make it fit before those that only help);
    ``progress``: told before each trace a setting needs (as :func:`plan_memory`)."""
    if plan.fits:
        return []
    if progress is not None:
        progress("it does not fit: planning the settings that would change that")
    replan = functools.partial(plan_memory, progress=progress)
    setup, spec = plan.setup, plan.spec
    tries: list[tuple[str, MemoryPlan]] = []

    def again(text, policy=policy, sampling=sampling, jagg=jagg, memory=memory, setup=setup):
        tries.append((text, replan(policy, sampling, grpo, jagg, memory, prompts, setup, spec=spec)))

    resident = sum(r.bytes for r in plan.rows if r.resident)
    room_mb = int((plan.limit - resident) / 2**20)
    per_sample = plan.passes["per_sample_bytes"] / setup.context
    if room_mb > 0 and plan.passes["per_pass"] > 1 or jagg.fused_rollout:
        if room_mb * 2**20 >= per_sample:
            again(f"set memory.budget_mb: {room_mb} (fewer samples per pass)",
                  memory=dataclasses.replace(memory, budget_mb=float(room_mb), fused_samples=None))
    if plan.passes["routed"] and not plan.passes["split_anchors"]:  # half the anchor pass's activations
        again("set memory.anchors: split (one anchor's activations at a time)",
              memory=dataclasses.replace(memory, anchors="split"))
    if jagg.fused_rollout:
        again("set jagg.fused_rollout: false (no kept graphs)", jagg=dataclasses.replace(jagg, fused_rollout=False))
    if not policy.gradient_checkpointing:
        again("enable policy.gradient_checkpointing", policy=dataclasses.replace(policy, gradient_checkpointing=True))
    if not setup.sharded and setup.devices > 1:
        again(f"use FSDP2Strategy (shards the trained networks over {setup.devices} processes)",
              setup=dataclasses.replace(setup, strategy="fsdp2"))
    if policy.trainable == "full" and setup.sharded and not setup.cpu_offload:
        again("set FSDP2Strategy cpu_offload: true", setup=dataclasses.replace(setup, cpu_offload=True))
    if policy.trainable == "full" and grpo.kl_beta > 0 and not policy.reference_offload:
        again("set policy.reference_offload: true", policy=dataclasses.replace(policy, reference_offload=True))
    for devices in (2, 4, 8, 16, 32, 64):
        if devices > setup.devices:
            more = dataclasses.replace(setup, devices=devices * setup.context, strategy="fsdp2")
            trial = replan(policy, sampling, grpo, jagg, memory, prompts, more, spec=spec)
            if trial.fits:
                tries.append((f"more devices: {devices * setup.context} with FSDP2Strategy", trial))
                break
    if spec.family in CONTEXT_FAMILIES:  # a higher degree splits one sample's activations further
        for degree in (d for d in (2, 4, 8, 16) if d > setup.context):
            trial_setup = dataclasses.replace(setup, devices=max(setup.devices, degree), context=degree)
            if trial_setup.devices % degree:
                continue
            trial = replan(policy, sampling, grpo, jagg, memory, prompts, trial_setup, spec=spec)
            if trial.fits:
                tries.append((f"set trainer.strategy.context_parallel_size: {degree} (on {trial_setup.devices} "
                              "devices)", trial))
                break
    tries.sort(key=lambda t: (not t[1].fits, t[1].peak))
    return [f"{text}: {_fits(trial)}" for text, trial in tries]
