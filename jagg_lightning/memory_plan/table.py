"""The plan as text: one table per device, the passes the memory budget chooses, fits / does not fit."""

from __future__ import annotations

from jagg_lightning.memory_plan.plan import GiB, HEADROOM, MemoryPlan


def gib(value: float) -> str:
    return f"{value / GiB:8.2f}"


def render(plan: MemoryPlan) -> str:
    s, g, p = plan.setup, plan.geo, plan.passes
    strategy = {"single": "one process", "ddp": "DDP", "fsdp2": "FSDP2"}[s.strategy]
    lines = [
        f"jagg plan: {plan.spec.source}",
        f"  {plan.spec.family}, {plan.params['per_network'] / 1e9:.3g}B parameters per network x {plan.spec.experts}, "
        f"latent {list(g.latent)}, {g.tokens} tokens + {g.text} text tokens per sample",
        f"  {s.devices} device(s) of {s.device_memory_gib:g} GiB, {strategy}"
        + (f", context degree {s.context} (data-parallel {s.data_parallel})" if s.context > 1 else "")
        + (", FSDP2 cpu_offload" if s.cpu_offload else ""),
        "",
        f"  {'per device':<52}{'GiB':>8}  what",
    ]
    for row in plan.rows:
        label = row.name if row.resident else f"{row.name} (peak of its phase)"
        lines.append(f"  {label:<52}{gib(row.bytes)}  {row.note}")
    limit = s.device_memory_gib * GiB
    lines += [
        f"  {'peak (resident + the largest phase)':<52}{gib(plan.peak)}  of {s.device_memory_gib:g} GiB "
        f"({100 * plan.peak / limit:.0f} %; the plan fills at most {100 * HEADROOM:.0f} %)",
        "",
        f"  passes: {p['windows']} windows ({p['routed']} routed, {p['exact_steps']} exact steps); "
        f"{p['per_pass']} samples per pass, anchors {'split' if p['split_anchors'] else 'batched'}; "
        f"one sample's activations {p['per_sample_bytes'] / 2**20:.1f} MiB (traced"
        + (f", / {s.context} context ranks" if s.context > 1 else "") + ")",
        "",
        "  FITS" if plan.fits else "  DOES NOT FIT",
    ]
    for text in plan.suggestions:
        lines.append(f"    - {text}")
    return "\n".join(lines)
