"""The plan as text -- one table per device, the passes the memory budget chooses, fits / does not fit -- and as JSON
(every row in bytes, for scripts: ``jagg plan --json``).

The table is in GiB, or in MiB when its peak is under 1 GiB (a small config would read 0.00 GiB everywhere); a row
that is not zero but would read 0.00 in the table's unit is written in the next smaller unit, with its unit."""

from __future__ import annotations

from jagg_lightning.memory_plan.plan import GiB, HEADROOM, MemoryPlan, count

UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


def table_unit(plan: MemoryPlan) -> str:
    """The table's unit: GiB, or MiB when the peak would read under 1.00 GiB."""
    return "GiB" if plan.peak >= 0.995 * GiB else "MiB"


def amount(value: float, unit: str) -> str:
    """``value`` bytes in 8 characters: ``unit`` to two decimals, or -- not zero, but reading 0.00 there -- the first
    smaller unit it reads in, followed by its name (``3.06 MiB`` in a GiB table)."""
    if value and abs(value) < 0.005 * UNITS[unit]:
        smaller = list(UNITS)[list(UNITS).index(unit) + 1:]
        unit = next((u for u in smaller if abs(value) >= 0.005 * UNITS[u]), "B")
        return f"{value / UNITS[unit]:.2f} {unit}".rjust(8)
    return f"{value / UNITS[unit]:8.2f}"


def render(plan: MemoryPlan) -> str:
    s, g, p = plan.setup, plan.geo, plan.passes
    unit = table_unit(plan)
    strategy = {"single": "one process", "ddp": "DDP", "fsdp2": "FSDP2"}[s.strategy]
    lines = [
        f"jagg plan: {plan.spec.source}",
        f"  {plan.spec.family}, {count(plan.params['per_network'])} parameters per network x {plan.spec.experts}, "
        f"latent {list(g.latent)}, {g.tokens} tokens + {g.text} text tokens per sample",
        f"  {s.devices} device(s) of {s.device_memory_gib:g} GiB, {strategy}"
        + (f", context degree {s.context} (data-parallel {s.data_parallel})" if s.context > 1 else "")
        + (", FSDP2 cpu_offload" if s.cpu_offload else ""),
        "",
        f"  {'per device':<52}{unit:>8}  what",
    ]
    for row in plan.rows:
        label = row.name if row.resident else f"{row.name} (peak of its phase)"
        lines.append(f"  {label:<52}{amount(row.bytes, unit)}  {row.note}")
    share = 100 * plan.peak / (s.device_memory_gib * GiB)
    share_text = f"{share:.0f}" if share >= 1 or share == 0 else f"{share:.1g}"
    per_sample = p["per_sample_bytes"]
    lines += [
        f"  {'peak (resident + the largest phase)':<52}{amount(plan.peak, unit)}  of {s.device_memory_gib:g} GiB "
        f"({share_text} %; the plan fills at most {100 * HEADROOM:.0f} %)",
        "",
        f"  passes: {p['windows']} windows ({p['routed']} routed, {p['exact_steps']} exact steps); "
        f"{p['per_pass']} samples per pass, anchors {'split' if p['split_anchors'] else 'batched'}; "
        f"one sample's activations "
        + (f"{per_sample / 2**20:.1f} MiB" if per_sample >= 0.05 * 2**20 else f"{per_sample / 2**10:.1f} KiB")
        + " (traced" + (f", / {s.context} context ranks" if s.context > 1 else "") + ")",
        "",
        "  FITS" if plan.fits else "  DOES NOT FIT",
    ]
    for text in plan.suggestions:
        lines.append(f"    - {text}")
    return "\n".join(lines)


def as_json(plan: MemoryPlan) -> dict:
    """The plan as plain data: every row and the peak in bytes (rounded to whole bytes), the setup, the shapes, the
    passes and the suggestions -- what :func:`render` prints, machine-readable."""
    s, g = plan.setup, plan.geo
    return {
        "source": plan.spec.source,
        "family": plan.spec.family,
        "parameters_per_network": plan.params["per_network"],
        "networks": plan.spec.experts,
        "trainable_parameters": plan.params["trainable"],
        "latent": list(g.latent),
        "tokens": g.tokens,
        "text_tokens": g.text,
        "setup": {"devices": s.devices, "device_memory_bytes": round(s.device_memory_gib * GiB),
                  "strategy": s.strategy, "cpu_offload": s.cpu_offload, "context": s.context,
                  "data_parallel": s.data_parallel},
        "rows": [{"name": r.name, "bytes": round(r.bytes), "note": r.note, "resident": r.resident} for r in plan.rows],
        "peak_bytes": round(plan.peak),
        "limit_bytes": round(plan.limit),
        "fits": plan.fits,
        "passes": dict(plan.passes),
        "suggestions": list(plan.suggestions),
    }
