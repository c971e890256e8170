"""JAGG where its windows are least linear (issue 54, item 5): window exactness on the scenes test bed.

On the shipped scenes model (``configs/scenes.yaml``'s ``model`` section), for each seed a fresh rollout of
``--per-task`` training rows of every GenEval task (one GRPO group each, ``group_size`` samples) at the base weights
(theta = theta_old: the first update's gradient), and for every window size W in ``--windows``, disjoint and chained
windows of exactly W trained steps: the exact gradient sum_k J_k^T g_k and the JAGG gradient J_a^T G_a + J_b^T G_b of
every window and group (``fidelity.gradient_fidelity``, interiors recomputed): cosine, relative error
||jagg - exact|| / ||exact||, and both routing scores (the velocity-interpolation residual, the paper's cosine rule)
with their Spearman correlation with the error.

Two regimes: ``shipped`` (the config's: the first 4 of 10 steps trained, the rest ODE) and ``all`` (every SDE step
trained, the paper's regime, windows over the whole trajectory), so a window's place along t is visible.

    OMP_NUM_THREADS=1 python benchmarks/scenes_windows.py --seeds 0 1 2 --per-task 2 --name scenes_windows.json
    python benchmarks/scenes_windows.py --replot benchmarks/results/scenes_windows.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import gradient_fidelity, spearman  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REGIMES = {"shipped": {}, "all": dict(trained_steps=None, ode_after_trained=False)}


def module_for(config: dict, regime: str, seed: int):
    from jagg_lightning.testbed.evaluate import module_from_config

    cfg = json.loads(json.dumps(config))
    cfg["model"]["sampling"] = {k: v for k, v in dict(cfg["model"]["sampling"], **REGIMES[regime]).items()
                                if v is not None}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    try:
        L.seed_everything(seed, verbose=False)
        module, _ = module_from_config(f.name, seed, jagg_frac=0.0, fused_rollout=False)
    finally:
        Path(f.name).unlink()
    return module


def run(args) -> dict:
    from jagg_lightning.data import read_prompts
    from jagg_lightning.models.conditions import evenly_per_task, metadata_of

    torch.set_num_threads(1)
    config = yaml.safe_load(Path(args.config).read_text())
    prompts = evenly_per_task(read_prompts(config["data"]["prompts_file"]), args.per_task)
    tasks = [metadata_of(p).get("tag", "") for p in prompts]
    rows, start = [], time.time()
    for regime in args.regimes:
        for seed in args.seeds:
            module = module_for(config, regime, seed)
            module.policy.train()
            got = gradient_fidelity(module, prompts, list(range(len(prompts))), 1000 * seed, args.windows)
            for r in got:
                r.update(regime=regime, seed=seed, task=tasks[r["group"]])
            rows += got
            print(f"[{time.time() - start:5.0f}s] {regime} seed {seed}: {len(got)} windows, trained steps "
                  f"{list(module.trained_steps)}", flush=True)
    return {"args": vars(args), "config": Path(args.config).name, "tasks": tasks, "rows": rows,
            "wall_s": time.time() - start, "torch": torch.__version__}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarise(result: dict) -> dict:
    """Per (regime, W, layout) and per window: cosine (mean, 10th percentile), relative error (mean, median), the
    routing scores' Spearman correlation with the error; and per task for the shipped regime."""
    groups: dict[str, list] = {}
    for r in result["rows"]:
        layout = "chained" if r["chained"] else "disjoint"
        groups.setdefault(f"{r['regime']} W={r['W']} {layout}", []).append(r)
        groups.setdefault(f"{r['regime']} W={r['W']} {layout} steps {tuple(r['steps'])}", []).append(r)
        if not r["chained"]:
            groups.setdefault(f"{r['regime']} W={r['W']} task {r['task']}", []).append(r)

    def stats(sel):
        cos = sorted(f["cosine"] for f in sel)
        err = sorted(f["rel_error"] for f in sel)
        return {"windows": len(sel), "cosine_mean": _mean(cos), "cosine_q10": cos[len(cos) // 10],
                "rel_error_mean": _mean(err), "rel_error_median": err[len(err) // 2],
                "residual_mean": _mean([f["residual"] for f in sel]),
                "spearman_residual": spearman([f["residual"] for f in sel], [f["rel_error"] for f in sel]),
                "spearman_cosine_rule": spearman([f["cosine_rule"] for f in sel], [f["rel_error"] for f in sel])}

    return {key: stats(sel) for key, sel in sorted(groups.items())}


def table(summary: dict) -> str:
    lines = ["| windows | n | cosine mean | cosine q10 | rel. error mean | rel. error median | Spearman (residual / "
             "cosine rule) vs error |", "|---|---|---|---|---|---|---|"]
    for key, s in summary.items():
        lines.append(f"| {key} | {s['windows']} | {s['cosine_mean']:.3f} | {s['cosine_q10']:.3f} | "
                     f"{s['rel_error_mean']:.3f} | {s['rel_error_median']:.3f} | {s['spearman_residual']:+.2f} / "
                     f"{s['spearman_cosine_rule']:+.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "scenes.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--per-task", type=int, default=2, help="training rows (GRPO groups) per GenEval task per seed")
    p.add_argument("--windows", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="scenes_windows.json")
    p.add_argument("--replot", default=None, help="a saved JSON: summarise it again, no runs")
    args = p.parse_args(argv)
    out = Path(args.out) / args.name
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        out = Path(args.replot)
    else:
        result = run(args)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result) + "\n")
    text = table(summarise(result))
    out.with_name(out.stem + "_summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
