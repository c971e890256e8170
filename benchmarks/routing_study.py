"""Routing that pays (issue 19, deliverable 3): residual vs the published cosine rule vs random routing, at equal
backward passes, same seeds, on the trained digits test bed.

The runs are made by benchmarks/time_to_quality.py (its ``ROUTING`` settings: ``configs/digits.yaml`` with 8
trained steps, W = 3 chained -- windows (0,1,2) (2,3,4) (4,5,6) and the exact tail (6,7) -- jagg_frac 0.5, so
2 of the 3 full windows are routed by every rule; a routed W = 3 window saves its one interior pass and chained
W = 3 windows share no interior, so every rule makes 6 pass steps of 8 per sample, whichever windows it picks),
next to "T=8 exact" (the same 8 trained steps, exact GRPO) and "T=8 W=4 (2 windows)" (both W = 4 windows routed):

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/time_to_quality.py --seeds 0 1 2 3 4 --steps 60 \\
        --settings "T=8 exact" "T=8 W=3 chained, residual" --name time_to_quality_t8_a.json &
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/time_to_quality.py --seeds 0 1 2 3 4 --steps 60 \\
        --settings "T=8 W=3 chained, cosine" "T=8 W=3 chained, random" --name time_to_quality_t8_b.json
    python benchmarks/routing_study.py benchmarks/results/time_to_quality_t8_a.json \\
        benchmarks/results/time_to_quality_t8_b.json benchmarks/results/time_to_quality.json

Writes routing_study_summary.json and routing_study.png under ``--out`` and prints the tables. Held-out accuracy
by the classifier and by the independent judge; ± is the 95 % t interval over seeds; differences are paired
(same seed: same LoRA init, prompts, rollout noise and evaluation noise).
"""

from __future__ import annotations

import argparse
import json
from itertools import combinations
from pathlib import Path

from time_to_quality import ROUTING, fmt, load_runs, mean_ci

BASE = "T=8 exact"
ROWS = [BASE, "T=8 W=4 (2 windows)", *ROUTING]
KEYS = ("accuracy", "judge_accuracy", "reward")
WINDOWS = [(0, 1, 2), (2, 3, 4), (4, 5, 6), (6, 7)]  # the ROUTING settings' windows


def pass_steps(routed: list[bool]) -> int:
    """Steps with a backward per sample: every step of an exact window, the anchors of a routed one."""
    return len({k for w, r in zip(WINDOWS, routed) for k in ((w[0], w[-1]) if r else w)})


def summarise(result: dict) -> dict:
    by = {(r["seed"], r["setting"]): r for r in result["runs"]}
    seeds = sorted({s for s, n in by if n == BASE and all((s, m) in by for m in ROUTING)})
    final = lambda name, k: [by[(s, name)]["evals"][-1][k] for s in seeds]
    table = {}
    for name in [n for n in ROWS if all((s, n) in by for s in seeds)]:
        rs = [by[(s, name)] for s in seeds]
        row = {"cpu_s": mean_ci([r["cpu"][-1] for r in rs]),
               "cpu_vs_base": mean_ci([r["cpu"][-1] / by[(r["seed"], BASE)]["cpu"][-1] for r in rs])}
        for k in KEYS:
            row[f"{k}_final"] = mean_ci(final(name, k))
            row[f"{k}_gain"] = mean_ci([r["evals"][-1][k] - r["evals"][0][k] for r in rs])
            row[f"{k}_minus_base"] = mean_ci([a - b for a, b in zip(final(name, k), final(BASE, k))])
        if name in ROUTING:
            steps = [st for r in rs for st in r["routed"]]
            row["window_routed_share"] = [sum(st[i] for st in steps) / len(steps) for i in range(len(WINDOWS))]
            row["pass_steps"] = sorted({pass_steps(st) for st in steps})
            patterns = [tuple(i for i, x in enumerate(st) if x) for st in steps]
            row["patterns"] = {str(p): patterns.count(p) / len(patterns) for p in sorted(set(patterns))}
        table[name] = row
    pairs = {}
    for a, b in combinations(ROUTING, 2):
        pairs[f"{a.split(', ')[-1]} - {b.split(', ')[-1]}"] = {
            k: mean_ci([x - y for x, y in zip(final(a, k), final(b, k))]) for k in KEYS}
    curves = {name: {k: [[e[k] for e in by[(s, name)]["evals"]] for s in seeds] for k in KEYS}
              for name in table}
    steps = [e["step"] for e in by[(seeds[0], BASE)]["evals"]]
    return {"seeds": seeds, "table": table, "pairs": pairs, "curves": curves, "eval_steps": steps}


def tables(summary: dict) -> str:
    lines = [f"seeds {summary['seeds']}; 60 steps; ± 95 % t interval over seeds; paired differences", "",
             "| setting | classifier acc. final | gain | − T=8 exact | judge acc. final | gain | − T=8 exact | "
             "CPU s (vs T=8 exact) | pass steps / 8 | share of steps each window routed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["table"].items():
        share = " / ".join(f"{x:.2f}" for x in r.get("window_routed_share", []))
        passes = ", ".join(map(str, r.get("pass_steps", [8 if name == BASE else 4])))
        lines.append(f"| {name} | {fmt(r['accuracy_final'])} | {fmt(r['accuracy_gain'])} | "
                     f"{fmt(r['accuracy_minus_base'])} | {fmt(r['judge_accuracy_final'])} | "
                     f"{fmt(r['judge_accuracy_gain'])} | {fmt(r['judge_accuracy_minus_base'])} | "
                     f"{fmt(r['cpu_s'], 1)} ({fmt(r['cpu_vs_base'], 2)}) | {passes} | {share} |")
    lines += ["", "| rule − rule (paired, final) | classifier acc. | judge acc. | held-out reward |", "|---|---|---|---|"]
    for pair, d in summary["pairs"].items():
        lines.append(f"| {pair} | {fmt(d['accuracy'])} | {fmt(d['judge_accuracy'])} | {fmt(d['reward'])} |")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = summary["eval_steps"]
    for name, per_key in summary["curves"].items():
        for ax, key, label in ((axes[0], "accuracy", "classifier"), (axes[1], "judge_accuracy", "judge")):
            cols = list(zip(*per_key[key]))[: len(steps)]
            ax.errorbar(steps[: len(cols)], [mean_ci(c)[0] for c in cols], yerr=[mean_ci(c)[1] for c in cols],
                        marker="o", capsize=3, label=name)
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(f"held-out accuracy ({label})")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"routing rules at equal passes (8 trained steps, W = 3 chained, jagg_frac 0.5), mean ± 95 % CI "
                 f"of seeds {summary['seeds']}")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="time_to_quality JSONs (runs merged)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    summary = summarise(load_runs(args.results))
    out = Path(args.out)
    (out / "routing_study_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, out / "routing_study.png")
    print(tables(summary))


if __name__ == "__main__":
    main()
