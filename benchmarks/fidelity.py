"""Does JAGG train a *trained* model as well as exact GRPO? The fidelity study on the digits test bed.

On the shipped pretrained digits SD3 (``jagg_lightning/testbed``), with the settings of
``configs/digits_fidelity.yaml`` (its ``model`` section; all 9 SDE steps trained), for each seed, all in one process, one thread:

1. training curves: exact GRPO (jagg_frac 0) and JAGG settings trained side by side from the same
   LoRA init, prompts and rollout noise; per optimizer step the training reward (DigitReward, the mean
   over the rollout), the wall-clock and process CPU time of the training step; every ``--eval-every``
   steps the held-out prompt-following accuracy (fixed seeds, ODE; not timed);
2. gradient fidelity: during the exact run, at several points of training, a fresh rollout at the
   current theta (= theta_old, the first update's gradient) and, for every window size W in
   ``--windows``, disjoint and chained, the exact and the JAGG gradient of every window, per GRPO
   group: cosine, relative error ||jagg - exact|| / ||exact||, and both routing scores (residual,
   cosine rule); then the Spearman correlation of each score with the error.

Writes ``<out>/fidelity.json`` and ``<out>/fidelity.png`` and prints the tables of benchmarks/README.md.

    python benchmarks/fidelity.py [--seeds 0 1 2] [--steps 30] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import lightning as L
import torch
import yaml

from jagg_lightning.testbed.evaluate import module_from_config

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {
    "exact": dict(jagg_frac=0.0),
    "W=4 frac=0.5": dict(window_size=4, jagg_frac=0.5),
    "W=4 frac=1": dict(window_size=4, jagg_frac=1.0),
    "W=8 frac=1": dict(window_size=8, jagg_frac=1.0),
    "W=4 frac=1 chained": dict(window_size=4, jagg_frac=1.0, chained=True),
}


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (no tie correction: the scores are continuous)."""
    if len(x) < 3:
        return float("nan")
    rx = torch.tensor(x, dtype=torch.float64).argsort().argsort().double()
    ry = torch.tensor(y, dtype=torch.float64).argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()).clamp_min(1e-300))


def gradient_fidelity(module, prompts: list[str], indices: list[int], step: int, windows: list[int]) -> list[dict]:
    """Exact vs JAGG per window and per GRPO group on a fresh rollout at the current theta."""
    from jagg_lightning.method.jagg import check_window_gradients, plan_windows
    from jagg_lightning.method.routing import cosine_score, interpolation_residual
    from jagg_lightning.utils.batching import batch_slice

    traj, cond, _, rewards, _ = module.sampler.rollout_and_score(prompts, indices, 10_000 + step,
                                                                 reward=module.reward_fn)
    K = module.sampling.group_size
    adv = module.updater.advantages(rewards)  # the config's grpo settings
    params = module.policy.lora_parameters()
    rows = []
    for g in range(len(prompts)):
        index = torch.arange(g * K, (g + 1) * K)
        if adv[index].abs().max() == 0:
            continue  # a constant group has no gradient
        mb = traj.select(index)
        loss = module.updater.step_loss_fn(mb, adv[index], None, 1.0 / len(module.trained_steps), [])
        for W in windows:
            if W > len(module.trained_steps):
                continue
            for chained in (False, True):
                plan = [w for w in plan_windows(module.trained_steps, W, chained) if len(w.steps) == W]
                checks = check_window_gradients(module.policy.velocity, params, mb.latents, mb.times,
                                                batch_slice(cond, index), loss, plan)
                for w, c in zip(plan, checks):
                    rows.append({
                        "train_step": step, "group": g, "W": W, "chained": chained, "steps": list(w.steps),
                        "cosine": c.cosine, "rel_error": c.rel_error,
                        "residual": float(interpolation_residual(mb.velocities, mb.times, w.steps)),
                        "cosine_rule": float(cosine_score(mb.velocities, mb.times, w.steps)),
                    })
    return rows


class Recorder(L.Callback):
    """Records per-step reward, wall and CPU time, held-out accuracy and (for the exact run) gradient
    fidelity; only the training step itself is timed."""

    def __init__(self, reward, eval_every, eval_samples, fidelity_at, windows, prompts, fidelity_prompts,
                 eval_prompts=None):
        self.reward, self.eval_every, self.eval_samples = reward, eval_every, eval_samples
        self.eval_prompts = eval_prompts
        self.fidelity_at, self.windows, self.prompts = set(fidelity_at), windows, prompts
        self.fidelity_prompts = fidelity_prompts
        self.steps, self.rewards, self.wall, self.cpu = [], [], [], []
        self.evals, self.fidelity = [], []
        self._wall = self._cpu = 0.0

    def evaluate(self, trainer, module):
        from jagg_lightning.testbed.evaluate import heldout_accuracy

        res = heldout_accuracy(module, self.reward, self.eval_prompts, samples_per_prompt=self.eval_samples)
        self.evals.append({"step": trainer.global_step, "wall": self._wall, "cpu": self._cpu,
                           "accuracy": res["accuracy"], "reward": res["reward"]})

    def on_fit_start(self, trainer, module):
        self.evaluate(trainer, module)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step in self.fidelity_at:
            n = self.fidelity_prompts
            self.fidelity += gradient_fidelity(module, self.prompts[:n], list(range(n)), trainer.global_step,
                                               self.windows)
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._wall += time.perf_counter() - self._t0
        self._cpu += time.process_time() - self._c0
        self.steps.append(trainer.global_step)
        self.rewards.append(float(trainer.callback_metrics["train/reward_mean"]))
        self.wall.append(self._wall)
        self.cpu.append(self._cpu)
        if trainer.global_step % self.eval_every == 0:
            self.evaluate(trainer, module)


def run(args) -> dict:
    from jagg_lightning.data import PromptDataModule, read_prompts
    from jagg_lightning.rewards import DigitReward
    from jagg_lightning.testbed import HELDOUT_TEMPLATES, digit_prompts

    torch.set_num_threads(args.threads)
    settings = yaml.safe_load(Path(args.config).read_text())
    data = settings["data"]
    prompts = read_prompts(data["prompts_file"]) if "prompts_file" in data else list(data["prompts"])  # a shipped name too
    reward = DigitReward()
    eval_prompts = digit_prompts(HELDOUT_TEMPLATES)[: args.eval_prompts]
    configs = {name: CONFIGS[name] for name in args.configs}
    fidelity_at = sorted({0, args.steps // 2, args.steps - 1}) if args.windows else []
    runs = []
    start = time.time()
    for seed in args.seeds:
        for name, jagg in configs.items():
            L.seed_everything(seed, verbose=False)
            module, _ = module_from_config(args.config, seed, **jagg)
            rec = Recorder(reward, args.eval_every, args.eval_samples, fidelity_at if name == "exact" else [],
                           args.windows, prompts, args.fidelity_prompts, eval_prompts)
            trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[rec])
            trainer.fit(module, PromptDataModule(prompts=prompts, batch_size=data.get("batch_size", 2), seed=seed))
            if rec.evals[-1]["step"] != trainer.global_step:
                rec.evaluate(trainer, module)
            runs.append({"seed": seed, "config": name, "jagg": jagg, "steps": rec.steps, "reward": rec.rewards,
                         "wall": rec.wall, "cpu": rec.cpu, "evals": rec.evals, "fidelity": rec.fidelity})
            print(f"[{time.time() - start:6.0f}s] seed {seed} {name}: reward {rec.rewards[0]:.3f} -> "
                  f"{sum(rec.rewards[-5:]) / len(rec.rewards[-5:]):.3f}, accuracy {rec.evals[0]['accuracy']:.3f} -> "
                  f"{rec.evals[-1]['accuracy']:.3f}, {rec.cpu[-1]:.1f} s CPU", flush=True)
    summary = summarise(runs, list(configs), args)
    return {"settings": {"model": settings["model"], "data": data}, "args": vars(args), "runs": runs, "summary": summary,
            "total_wall_s": time.time() - start}


def _smooth(values: list[float], width: int) -> list[float]:
    return [sum(values[max(0, i - width + 1) : i + 1]) / len(values[max(0, i - width + 1) : i + 1])
            for i in range(len(values))]


def summarise(runs: list[dict], names: list[str], args) -> dict:
    width = max(1, args.steps // 5)
    by = {(r["seed"], r["config"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    curves = {}
    for name in names:
        rows = []
        for s in seeds:
            r, ex = by[(s, name)], by[(s, "exact")] if (s, "exact") in by else None
            # gains on the held-out evaluation (fixed prompts and seeds): the training reward depends on
            # which prompts a step happens to draw far more than on the few steps taken
            ev = r["evals"]
            row = {"seed": s, "train_reward_final": _smooth(r["reward"], width)[-1],
                   "heldout_reward_start": ev[0]["reward"], "heldout_reward_final": ev[-1]["reward"],
                   "reward_gain": ev[-1]["reward"] - ev[0]["reward"],
                   "acc_start": ev[0]["accuracy"], "acc_final": ev[-1]["accuracy"],
                   "wall_s": r["wall"][-1], "cpu_s": r["cpu"][-1]}
            if ex is not None:
                gain = ex["evals"][-1]["reward"] - ex["evals"][0]["reward"]
                row["gain_share"] = row["reward_gain"] / gain if gain > 1e-12 else float("nan")
                target = ex["evals"][-1]["reward"]
                hit = next((e for e in ev[1:] if e["reward"] >= target), None)
                row["wall_to_exact_reward"] = hit["wall"] if hit is not None else float("nan")
                row["cpu_to_exact_reward"] = hit["cpu"] if hit is not None else float("nan")
                row["steps_to_exact_reward"] = hit["step"] if hit is not None else float("nan")
            rows.append(row)
        curves[name] = {"per_seed": rows, "mean": {k: _nanmean([row[k] for row in rows]) for k in rows[0] if k != "seed"}}
    fidelity_rows = [f for r in runs for f in r["fidelity"]]
    fidelity = {}
    for W in sorted({f["W"] for f in fidelity_rows}):
        for chained in (False, True):
            sel = [f for f in fidelity_rows if f["W"] == W and f["chained"] == chained]
            if not sel:
                continue
            by_step = {}
            for f in sel:
                by_step.setdefault(f["train_step"], []).append(f)
            fidelity[f"W={W} {'chained' if chained else 'disjoint'}"] = {
                "windows": len(sel),
                "cosine_mean": _nanmean([f["cosine"] for f in sel]),
                "cosine_min": min(f["cosine"] for f in sel),
                "rel_error_mean": _nanmean([f["rel_error"] for f in sel]),
                "rel_error_median": sorted(f["rel_error"] for f in sel)[len(sel) // 2],
                "by_train_step": {str(k): {"cosine_mean": _nanmean([f["cosine"] for f in v]),
                                           "rel_error_mean": _nanmean([f["rel_error"] for f in v])}
                                  for k, v in sorted(by_step.items())},
                "spearman_residual": spearman([f["residual"] for f in sel], [f["rel_error"] for f in sel]),
                "spearman_cosine_rule": spearman([f["cosine_rule"] for f in sel], [f["rel_error"] for f in sel]),
            }
    by_window = {}  # where the error sits: per window (its steps: the noise levels it spans)
    for f in fidelity_rows:
        by_window.setdefault(f"W={f['W']} {'chained' if f['chained'] else 'disjoint'} {tuple(f['steps'])}", []).append(f)
    windows = {key: {"windows": len(v), "cosine_mean": _nanmean([f["cosine"] for f in v]),
                     "cosine_min": min(f["cosine"] for f in v), "rel_error_mean": _nanmean([f["rel_error"] for f in v]),
                     "residual_mean": _nanmean([f["residual"] for f in v])}
               for key, v in by_window.items()}
    if fidelity_rows:
        fidelity["all"] = {
            "windows": len(fidelity_rows),
            "spearman_residual": spearman([f["residual"] for f in fidelity_rows], [f["rel_error"] for f in fidelity_rows]),
            "spearman_cosine_rule": spearman([f["cosine_rule"] for f in fidelity_rows],
                                             [f["rel_error"] for f in fidelity_rows]),
        }
    return {"curves": curves, "fidelity": fidelity, "fidelity_by_window": windows, "smoothing_steps": width}


def _nanmean(values) -> float:
    vals = [float(v) for v in values if not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else float("nan")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = list(result["summary"]["curves"])
    width = result["summary"]["smoothing_steps"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for name in names:
        rs = [r for r in runs if r["config"] == name]
        n = min(len(r["reward"]) for r in rs)
        mean = lambda key: [sum(r[key][i] for r in rs) / len(rs) for i in range(n)]  # noqa: E731
        reward = _smooth(mean("reward"), width)
        steps = rs[0]["steps"][:n]
        axes[0, 0].plot(steps, reward, label=name)
        axes[0, 1].plot(mean("wall")[:n], reward, label=name)
        axes[0, 2].plot(mean("cpu")[:n], reward, label=name)
        m = min(len(r["evals"]) for r in rs)
        acc = [sum(r["evals"][i]["accuracy"] for r in rs) / len(rs) for i in range(m)]
        axes[1, 0].plot([rs[0]["evals"][i]["step"] for i in range(m)], acc, marker="o", label=name)
        axes[1, 1].plot([sum(r["evals"][i]["wall"] for r in rs) / len(rs) for i in range(m)], acc, marker="o", label=name)
        axes[1, 2].plot([sum(r["evals"][i]["cpu"] for r in rs) / len(rs) for i in range(m)], acc, marker="o", label=name)
    for ax, (x, y) in zip(axes.flat, [("optimizer step", "train reward (smoothed)"), ("wall-clock s", "train reward"),
                                      ("process CPU s", "train reward"), ("optimizer step", "held-out accuracy"),
                                      ("wall-clock s", "held-out accuracy"), ("process CPU s", "held-out accuracy")]):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    seeds = sorted({r["seed"] for r in runs})
    fig.suptitle(f"digits test bed: exact GRPO vs JAGG, mean of seeds {seeds}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def tables(result: dict) -> str:
    s = result["summary"]
    lines = ["| setting | held-out reward start -> end | share of exact's gain (per seed) | held-out accuracy start -> end | "
             "CPU s (wall s) for all steps | CPU s (wall s) to exact's final held-out reward |",
             "|---|---|---|---|---|---|"]
    for name, c in s["curves"].items():
        m = c["mean"]
        shares = ", ".join(f"{row.get('gain_share', float('nan')):.2f}" for row in c["per_seed"])
        lines.append(f"| {name} | {m['heldout_reward_start']:.4f} -> {m['heldout_reward_final']:.4f} | "
                     f"{m.get('gain_share', float('nan')):.2f} ({shares}) | "
                     f"{m['acc_start']:.3f} -> {m['acc_final']:.3f} | {m['cpu_s']:.1f} ({m['wall_s']:.0f}) | "
                     f"{m.get('cpu_to_exact_reward', float('nan')):.1f} ({m.get('wall_to_exact_reward', float('nan')):.0f}) |")
    lines += ["", "| windows | n | cosine mean (min) | rel. error mean (median) | Spearman(residual, error) | "
              "Spearman(cosine rule, error) | rel. error by training step |", "|---|---|---|---|---|---|---|"]
    for name, f in s["fidelity"].items():
        if name == "all":
            continue
        steps = ", ".join(f"{k}: {v['rel_error_mean']:.3f}" for k, v in f["by_train_step"].items())
        lines.append(f"| {name} | {f['windows']} | {f['cosine_mean']:.4f} ({f['cosine_min']:.3f}) | "
                     f"{f['rel_error_mean']:.3f} ({f['rel_error_median']:.3f}) | {f['spearman_residual']:.2f} | "
                     f"{f['spearman_cosine_rule']:.2f} | {steps} |")
    if "all" in s["fidelity"]:
        a = s["fidelity"]["all"]
        lines.append(f"| all pooled | {a['windows']} | | | {a['spearman_residual']:.2f} | {a['spearman_cosine_rule']:.2f} | |")
    lines += ["", "| window (its steps) | n | cosine mean (min) | rel. error mean | residual mean |", "|---|---|---|---|---|"]
    for name, f in s.get("fidelity_by_window", {}).items():
        lines.append(f"| {name} | {f['windows']} | {f['cosine_mean']:.4f} ({f['cosine_min']:.3f}) | "
                     f"{f['rel_error_mean']:.3f} | {f['residual_mean']:.3f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="exact GRPO vs JAGG on the pretrained digits model")
    parser.add_argument("--config", default=str(ROOT / "configs" / "digits_fidelity.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--windows", type=int, nargs="*", default=[3, 4, 8], help="W of the gradient-fidelity study")
    parser.add_argument("--fidelity-prompts", type=int, default=4, help="GRPO groups per fidelity point")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-samples", type=int, default=2, help="samples per held-out prompt")
    parser.add_argument("--eval-prompts", type=int, default=None, help="first N held-out prompts (default all 30)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="fidelity.json", help="the raw JSON's file name under --out (the plot: "
                        "the same stem, .png)")
    parser.add_argument("--replot", default=None, help="a saved fidelity.json: summarise and plot it again, no runs")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:  # summarise, plot and print a saved run again (e.g. after changing the summary)
        result = json.loads(Path(args.replot).read_text())
        result["summary"] = summarise(result["runs"], list(result["summary"]["curves"]), argparse.Namespace(**result["args"]))
    else:
        result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw, picture = out / args.name, out / f"{Path(args.name).stem}.png"
    raw.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, picture)
    print(tables(result))
    print(f"total {result['total_wall_s']:.0f} s wall; wrote {raw} and {picture}")
    return result


if __name__ == "__main__":
    main()
