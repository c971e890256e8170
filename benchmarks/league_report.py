"""The league's statistics and report (``benchmarks/league.py`` runs; this reads): per method over the seeds it shares
with the reference (paired), the tables, the tuning sweep's choice of setting, the cost model's check, the plot.
Plain functions of the saved JSON (``time_to_quality.py``'s ``mean_ci`` / ``crossing``)."""

from __future__ import annotations

import math
from pathlib import Path

from time_to_quality import crossing, mean_ci

KEYS = ("accuracy", "judge_accuracy")  # the two readers: classifier (the reward's) and the independent judge


def at_x(xs, ys, x) -> float:
    """The piecewise-linear curve (xs, ys) at x (nan beyond its end)."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * ((x - x0) / (x1 - x0) if x1 != x0 else 0.0)
    return float("nan")


def summarise(result: dict, reference: str = "exact") -> dict:
    """Per method, over the seeds it shares with ``reference`` (paired): final accuracy by both readers (= accuracy at
    equal optimizer steps: every method makes one step per rollout), paired minus the reference, CPU vs the reference,
    CPU to the reference's final accuracy, to base + 0.10 / + 0.15, accuracy at equal CPU (the cheapest method's total),
    and the reward-hacking watch (training reward gain against both readers' held-out gains)."""
    by = {(r["seed"], r["setting"]): r for r in result["runs"]}
    names = list(dict.fromkeys(r["setting"] for r in result["runs"]))
    seeds = sorted({s for s, n in by if n == reference})
    if not seeds:
        return {"seeds": [], "table": {}, "note": f"no {reference!r} runs"}
    budget = min(mean_ci([by[(s, n)]["cpu"][-1] for s in seeds if (s, n) in by])[0] for n in names
                 if any((s, n) in by for s in seeds))
    ref_final = {k: mean_ci([by[(s, reference)]["evals"][-1][k] for s in seeds])[0] for k in KEYS}
    ref_cpu = mean_ci([by[(s, reference)]["cpu"][-1] for s in seeds])[0]
    base = {k: mean_ci([by[(s, reference)]["evals"][0][k] for s in seeds])[0] for k in KEYS}
    table = {}
    for name in names:
        rs = [by[(s, name)] for s in seeds if (s, name) in by]
        if not rs:
            continue
        n = min(len(r["evals"]) for r in rs)
        cpu = [sum(r["evals"][i]["cpu"] for r in rs) / len(rs) for i in range(n)]
        row = {"seeds": [r["seed"] for r in rs], "steps": len(rs[0]["cpu"]), "cpu_s": mean_ci([r["cpu"][-1] for r in rs]),
               "cpu_vs_ref": mean_ci([r["cpu"][-1] / by[(r["seed"], reference)]["cpu"][-1] for r in rs]),
               "curve_cpu": cpu, "curve_steps": [rs[0]["evals"][i]["step"] for i in range(n)],
               "train_reward_gain": mean_ci([sum(r["train_reward"][-3:]) / 3 - sum(r["train_reward"][:3]) / 3
                                             for r in rs])}
        for k in KEYS:
            curve = [sum(r["evals"][i][k] for r in rs) / len(rs) for i in range(n)]
            row[f"{k}_curve"] = curve
            row[f"{k}_band"] = [mean_ci([r["evals"][i][k] for r in rs])[1] for i in range(n)]
            row[f"{k}_final"] = mean_ci([r["evals"][-1][k] for r in rs])
            row[f"{k}_gain"] = mean_ci([r["evals"][-1][k] - r["evals"][0][k] for r in rs])
            row[f"{k}_minus_ref"] = mean_ci([r["evals"][-1][k] - by[(r["seed"], reference)]["evals"][-1][k] for r in rs])
            row[f"{k}_cpu_to_ref_final"] = crossing(cpu, curve, ref_final[k]) / ref_cpu
            for gain in (0.10, 0.15):
                row[f"{k}_cpu_to_plus_{gain:.2f}"] = crossing(cpu, curve, base[k] + gain)
            row[f"{k}_at_budget"] = mean_ci([at_x([e["cpu"] for e in r["evals"]], [e[k] for e in r["evals"]], budget)
                                             for r in rs])
        table[name] = row
    return {"seeds": seeds, "reference": reference, "budget_cpu_s": budget, "reference_final": ref_final,
            "reference_cpu_s": ref_cpu, "base": base, "table": table, "skipped": result.get("skipped", {}),
            "methods": result.get("methods", {})}


def fmt(mc, digits=3) -> str:
    m, h = mc
    return f"{m:.{digits}f} ± {h:.{digits}f}" if not math.isnan(h) else f"{m:.{digits}f}"


def tables(summary: dict) -> str:
    t, b = summary["table"], summary.get("budget_cpu_s", float("nan"))
    lines = [f"seeds {summary['seeds']} (paired with {summary.get('reference')!r}); ± is the 95 % t interval over seeds; "
             f"equal-CPU budget {b:.1f} s", "",
             "| method | final acc. classifier | − exact (paired) | final acc. judge | − exact (paired) | CPU vs exact | "
             "CPU to exact's final (cls / judge, × exact's CPU) | CPU s to +0.10 (cls / judge) | CPU s to +0.15 "
             "(cls / judge) | acc. at equal CPU (cls / judge) | train-reward gain | held-out gain (cls / judge) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in t.items():
        lines.append(
            f"| {name} | {fmt(r['accuracy_final'])} | {fmt(r['accuracy_minus_ref'])} | {fmt(r['judge_accuracy_final'])} | "
            f"{fmt(r['judge_accuracy_minus_ref'])} | {fmt(r['cpu_vs_ref'], 2)} | "
            f"{r['accuracy_cpu_to_ref_final']:.2f} / {r['judge_accuracy_cpu_to_ref_final']:.2f} | "
            f"{r['accuracy_cpu_to_plus_0.10']:.0f} / {r['judge_accuracy_cpu_to_plus_0.10']:.0f} | "
            f"{r['accuracy_cpu_to_plus_0.15']:.0f} / {r['judge_accuracy_cpu_to_plus_0.15']:.0f} | "
            f"{r['accuracy_at_budget'][0]:.3f} / {r['judge_accuracy_at_budget'][0]:.3f} | {fmt(r['train_reward_gain'])} | "
            f"{r['accuracy_gain'][0]:+.3f} / {r['judge_accuracy_gain'][0]:+.3f} |")
    if summary.get("skipped"):
        lines += ["", "not run: " + "; ".join(f"{n} ({why})" for n, why in summary["skipped"].items())]
    return "\n".join(lines)


def choose(result: dict, methods=None) -> dict:
    """Each method's setting from a sweep, by ONE rule for every method: the highest held-out accuracy at equal CPU
    within the method -- every setting read at the CPU its cheapest setting spent in all (a group of 4 costs half a
    group of 8 per step, so settings are compared at equal cost, not at equal steps) -- by the LOWER of the two
    readers (a setting that lifts the reward's classifier alone is reward hacking, not quality), averaged over the
    sweep's seeds; ties go to the paper's setting (lr 1e-3, group size 8). -> {method: {"lr", "group_size", "score",
    "scores": {setting: score}, "budget_cpu_s"}}."""
    runs = {}
    for r in result["runs"]:
        if methods is None or r["method"] in methods:
            runs.setdefault(r["method"], {}).setdefault((r["lr"], r["group_size"]), []).append(r)
    chosen = {}
    for name, settings in runs.items():
        budget = min(sum(r["evals"][-1]["cpu"] for r in rs) / len(rs) for rs in settings.values())
        scores = {}
        for key, rs in settings.items():
            reads = [min(at_x([e["cpu"] for e in r["evals"]], [e[k] for e in r["evals"]], budget) for k in KEYS)
                     for r in rs]
            scores[key] = sum(reads) / len(reads)
        default = (1e-3, 8)
        best = max(scores, key=lambda key: (round(scores[key], 9), key == default))
        chosen[name] = {"lr": best[0], "group_size": best[1], "score": scores[best], "budget_cpu_s": budget,
                        "scores": {f"lr={k[0]} G={k[1]}": v for k, v in scores.items()}}
    return chosen


def sweep_table(result: dict) -> str:
    """The tuning sweep: final accuracy by both readers per setting (mean over the sweep's seeds)."""
    rows = {}
    for r in result["runs"]:
        rows.setdefault(r["setting"], []).append(r)
    lines = ["| setting | seeds | final acc. classifier | final acc. judge | CPU s |", "|---|---|---|---|---|"]
    for name, rs in rows.items():
        lines.append(f"| {name} | {len(rs)} | {fmt(mean_ci([r['evals'][-1]['accuracy'] for r in rs]))} | "
                     f"{fmt(mean_ci([r['evals'][-1]['judge_accuracy'] for r in rs]))} | "
                     f"{fmt(mean_ci([r['cpu'][-1] for r in rs]), 1)} |")
    chosen = choose(result)
    lines += ["", "chosen (the highest held-out accuracy by the lower of the two readers, at equal CPU within the "
                  "method: the CPU of its cheapest setting):", "", "| method | chosen lr | chosen group size | score | budget CPU s | every "
                  "setting's score |", "|---|---|---|---|---|---|"]
    for name, c in chosen.items():
        every = ", ".join(f"{k}: {v:.3f}" for k, v in c["scores"].items())
        lines.append(f"| {name} | {c['lr']:g} | {c['group_size']} | {c['score']:.3f} | {c['budget_cpu_s']:.1f} | "
                     f"{every} |")
    return "\n".join(lines)


def tuned_table(summary: dict, result: dict) -> str:
    """Each method at its paper setting and after the sweep's choice ('<method> tuned' rows; a method without one
    was not rerun: its choice was the paper setting, or it was not swept)."""
    t = summary["table"]
    setting = {r["setting"]: f"lr {r['lr']:g}, G {r['group_size']}" for r in result["runs"]}
    lines = ["| method | tuned setting | seeds | final acc. (cls / judge) | CPU to exact's final (cls / judge) | "
             "paper setting: final acc. | paper setting: CPU to exact's final |", "|---|---|---|---|---|---|---|"]
    for name, r in t.items():
        if name.endswith(" tuned"):
            continue
        tuned = t.get(f"{name} tuned")
        paper = (f"{r['accuracy_final'][0]:.3f} / {r['judge_accuracy_final'][0]:.3f}",
                 f"{r['accuracy_cpu_to_ref_final']:.2f} / {r['judge_accuracy_cpu_to_ref_final']:.2f}")
        if tuned is None:
            lines.append(f"| {name} | paper (not rerun) | {len(r['seeds'])} | {paper[0]} | {paper[1]} | {paper[0]} | "
                         f"{paper[1]} |")
        else:
            lines.append(f"| {name} | {setting[name + ' tuned']} | {len(tuned['seeds'])} | "
                         f"{tuned['accuracy_final'][0]:.3f} / {tuned['judge_accuracy_final'][0]:.3f} | "
                         f"{tuned['accuracy_cpu_to_ref_final']:.2f} / {tuned['judge_accuracy_cpu_to_ref_final']:.2f} | "
                         f"{paper[0]} | {paper[1]} |")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    for ax, key, label in zip(axes, KEYS, ("classifier (the reward's)", "judge (independent)")):
        for i, (name, r) in enumerate(summary["table"].items()):  # tab20: 13+ methods, no colour twice
            x, y, band = r["curve_cpu"], r[f"{key}_curve"], [0.0 if math.isnan(h) else h for h in r[f"{key}_band"]]
            line, = ax.plot(x, y, marker="o", ms=3, label=name, color=plt.cm.tab20(i % 20))
            ax.fill_between(x, [a - h for a, h in zip(y, band)], [a + h for a, h in zip(y, band)],
                            color=line.get_color(), alpha=0.15)
        ax.axhline(summary["reference_final"][key], color="grey", ls=":", lw=1)
        ax.set_xlabel("process CPU s (training steps only, mean over seeds)")
        ax.set_ylabel(f"held-out accuracy, {label}")
        ax.set_ylim(0, 1)  # a band from two seeds (t = 12.7) runs off any scale
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"the league on the digits test bed: mean ± 95 % CI over seeds {summary['seeds']}")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def cost_model(summary: dict, cost: dict, b_over_f: float) -> str:
    """Predicted against measured CPU per method (both relative to the reference): D, the per-step cost outside the
    transformer's passes (decode, reward, optimizer, Python), fitted by least squares over the methods (one number)."""
    rows = [(n, r["cpu_vs_ref"][0]) for n, r in summary["table"].items() if n in cost]
    ref = summary.get("reference", "exact")
    if not rows or ref not in cost:
        return ""
    units = {n: (lambda c: c[0] + c[1] + c[2] + b_over_f * c[3])(cost[n]) for n, _ in rows}
    e = units[ref]
    # measured m = (u + D) / (e + D)  <=>  m e - u = D (1 - m): least squares for D
    num = sum((m * e - units[n]) * (1 - m) for n, m in rows)
    den = sum((1 - m) ** 2 for n, m in rows) or float("nan")
    d = num / den
    lines = [f"cost model: B = {b_over_f} F, D = {d:.1f} F fitted (the reference {ref}: {e:.1f} F of passes + D)", "",
             "| method | rollout F | update F (grad / no-grad) | backwards | passes (F) | predicted CPU vs exact | measured |",
             "|---|---|---|---|---|---|---|"]
    for n, m in rows:
        c = cost[n]
        lines.append(f"| {n} | {c[0]} | {c[1]} / {c[2]} | {c[3]} | {units[n]:.1f} | {(units[n] + d) / (e + d):.2f} | "
                     f"{m:.2f} |")
    return "\n".join(lines)


def task_table(result: dict) -> str:
    """The scenes test bed's per-task finals: per method, each GenEval task's final score by the reader / the judge
    (mean over the method's seeds, and the first evaluation's beside it); '' when the runs carry no per-task scores."""
    runs = [r for r in result["runs"] if "per_task" in r["evals"][-1]]
    if not runs:
        return ""
    tasks = list(runs[0]["evals"][-1]["per_task"])
    lines = ["| method | seeds | " + " | ".join(f"{t} (reader / judge)" for t in tasks) + " |",
             "|---|---|" + "---|" * len(tasks)]

    def mean(rs, at, key, task):
        return sum(r["evals"][at].get(key, {}).get(task, float("nan")) for r in rs) / len(rs)

    for name in dict.fromkeys(r["setting"] for r in runs):
        rs = [r for r in runs if r["setting"] == name]
        cells = [f"{mean(rs, 0, 'per_task', t):.2f} → {mean(rs, -1, 'per_task', t):.2f} / "
                 f"{mean(rs, 0, 'judge_per_task', t):.2f} → {mean(rs, -1, 'judge_per_task', t):.2f}" for t in tasks]
        lines.append(f"| {name} | {len(rs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def phase_table(result: dict) -> str:
    """Where each setting's training time went (the runs that recorded ``StepTimes``' phases): the mean wall seconds
    per run and each phase's share of them, the held-out evaluations left out ('other': Lightning's loop, Python)."""
    rows = {}
    for r in result["runs"]:
        if r.get("phases"):
            rows.setdefault(r["setting"], []).append(r["phases"])
    if not rows:
        return ""
    phases = ("rollout", "decode", "reward", "update/forward", "update/backward", "optimizer", "other")
    lines = ["wall seconds per run (the held-out evaluations left out) and each phase's share; wall time counts the "
             "machine's other load, so read the shares", "",
             "| setting | runs | wall s | " + " | ".join(f"{p} %" for p in phases) + " |",
             "|---|---|---|" + "---|" * len(phases)]
    for name, ps in rows.items():
        total = sum(p["time/step"] - p.get("time/evaluation", 0.0) for p in ps) / len(ps)
        shares = [100 * sum(p.get(f"time/{k}", 0.0) for p in ps) / len(ps) / total if total > 0 else float("nan")
                  for k in phases]
        lines.append(f"| {name} | {len(ps)} | {total:.1f} | " + " | ".join(f"{s:.0f}" for s in shares) + " |")
    return "\n".join(lines)
