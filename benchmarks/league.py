"""The league (issue 41): every method a user would pick, each ONE config choice over the same engine, on the digits
test bed in the paper's regime (``configs/digits_all_steps.yaml``: 10 sampling steps, all trained, 16 prompts x 8
samples per step, lr 1e-3, one optimizer step per rollout), measured side by side.

Per (seed, method) one run of ``--steps`` optimizer steps, one thread, seed-major with the methods interleaved (a
stopped league has whole seeds); time is the process CPU time of the training steps only. Every ``--eval-every``
steps both readers -- the reward's classifier (``val/digit_accuracy``) and the independent judge
(``val/judge_accuracy``) -- read the same fixed-noise ODE samples of the 30 HELD-OUT prompts (noise seed 1000 + seed).
The recording and the statistics are ``time_to_quality.py``'s (``Recorder``, ``mean_ci``, ``crossing``).

``METHODS`` is the table: a name -> the overrides of the config's ``sampling`` / ``grpo`` / ``jagg`` sections (every
entry names ``fused_rollout``: the base config turns it on). ``--methods`` picks names from it; an entry whose
``needs`` module is not importable is listed and skipped with the reason. ``--sweep`` runs a small tuning grid per method (``--lr`` x ``--group-size``)
on seeds outside the reported ones, into its own JSON; the summary reports it.

    OMP_NUM_THREADS=1 python benchmarks/league.py --seeds 0 2 4 --name league_a.json   # (benchmarks/README.md)
    python benchmarks/league.py --replot benchmarks/results/league_a.json benchmarks/results/league_b.json \
        --name league.json
    OMP_NUM_THREADS=1 python benchmarks/league.py --sweep --seeds 100 --methods exact flash_grpo \
        --lr 5e-4 1e-3 2e-3 --group-size 4 8 --steps 20 --name league_sweep.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_to_quality import Recorder, crossing, mean_ci  # noqa: E402  (the shared machinery)

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("accuracy", "judge_accuracy")  # the two readers: classifier (the reward's) and the independent judge
FAST_WINDOW = dict(trained_steps=None, ode_after_trained=False)
FLASH_TAIL = dict(trained_steps=4, ode_after_trained=True, ode_solver="dpmpp_2m", ode_steps=2)
UNFUSED_EXACT = dict(jagg_frac=0.0, fused_rollout=False)

# name -> {"sampling": ..., "grpo": ..., "jagg": ..., "what": one line, "needs": a module that must import}
METHODS = {
    "exact": dict(jagg=UNFUSED_EXACT, what="exact Flow-GRPO, every step trained (the reference)"),
    "jagg_w5_fused": dict(jagg=dict(window_size=5, jagg_frac=1.0, fused_rollout=True),
                          what="fused JAGG, windows (0..4) (5..9) routed (the paper's regime)"),
    "jagg_w4_fused": dict(jagg=dict(window_size=4, jagg_frac=1.0, fused_rollout=True),
                          what="fused JAGG W = 4: (0..3) (4..7) routed, (8, 9) exact"),
    # Flow-GRPO-Fast (pickscore_sd3_fast: sde_window_size 3 in (0, num_steps // 2), ODE elsewhere)
    "flow_grpo_fast": dict(sampling=dict(FAST_WINDOW, sde_window_size=3, sde_window_range=[0, 5],
                                         sde_window_schedule="random"),
                           jagg=dict(UNFUSED_EXACT, window_size=3), what="Flow-GRPO-Fast: 3 SDE steps drawn in [0, 5)"),
    # MixGRPO: a sliding SDE window (4 of 25 steps there -> 2 of 10 here), moved by 1 every shift_every rollouts
    "mixgrpo": dict(sampling=dict(FAST_WINDOW, sde_window_size=2, sde_window_range=[0, 10],
                                  sde_window_schedule="progressive", sde_window_shift_every=4),
                    jagg=dict(UNFUSED_EXACT, window_size=2), what="MixGRPO: 2-step SDE window sliding every 4 rollouts"),
    # MixGRPO-Flash's higher-order ODE: here the tail after the first 4 trained steps in 2 DPM-Solver++(2M) steps
    "flash_tail": dict(sampling=FLASH_TAIL, jagg=dict(UNFUSED_EXACT, window_size=4),
                       what="first 4 steps trained, the rest 2 DPM-Solver++(2M) steps (MixGRPO-Flash's solver)"),
    # Flash-GRPO (arXiv 2605.15980): one SDE step per trajectory drawn uniformly in the first half (the authors'
    # script: the first 10 of 20), loss x (1 / c_k) / mean (1 / c); drawn per rollout here (docs/method.md)
    "flash_grpo": dict(sampling=dict(FAST_WINDOW, sde_window_size=1, sde_window_range=[0, 5],
                                     sde_window_schedule="random"),
                       grpo=dict(temporal_rectification=True), jagg=dict(UNFUSED_EXACT, window_size=2),
                       what="Flash-GRPO: one SDE step in [0, 5) per rollout, 1/c(t) rectified"),
    # ... and drawn per prompt, as the authors do (each group its own step: sampling.sde_window_draw group)
    "flash_grpo_group": dict(sampling=dict(FAST_WINDOW, sde_window_size=1, sde_window_range=[0, 5],
                                           sde_window_schedule="random", sde_window_draw="group"),
                             grpo=dict(temporal_rectification=True), jagg=dict(UNFUSED_EXACT, window_size=2),
                             what="Flash-GRPO: one SDE step per GROUP in [0, 5), 1/c(t) rectified (the authors' draw)"),
    # DanceGRPO timestep_fraction 0.6 at pair granularity: 3 of the 5 (k, k + 1) pairs per rollout (docs/parity.md)
    "dance_fraction": dict(jagg=dict(UNFUSED_EXACT, window_size=2, window_fraction=0.6),
                           what="DanceGRPO timestep_fraction 0.6 (3 of 5 step pairs per rollout, exact)"),
    "jagg_w5_guard": dict(grpo=dict(ratio_norm=True, ratio_reweight=True),
                          jagg=dict(window_size=5, jagg_frac=1.0, fused_rollout=True),
                          what="fused JAGG W = 5 + GRPO-Guard (RatioNorm + reweighting)"),
    "exact_guard": dict(grpo=dict(ratio_norm=True, ratio_reweight=True), jagg=UNFUSED_EXACT,
                        what="exact + GRPO-Guard"),
    "jagg_w4_flash_tail": dict(sampling=FLASH_TAIL, jagg=dict(window_size=4, jagg_frac=1.0, fused_rollout=True),
                               what="fused JAGG W = 4 over the first 4 steps + the 2M tail"),
    # the forward-process objectives (docs/method.md section 10): configs/digits_nft.yaml / digits_awm.yaml's settings
    "nft": dict(sampling=dict(trained_steps=None, ode_after_trained=True, ode_solver="dpmpp_2m"),
                grpo=dict(adv_std="global"), jagg=UNFUSED_EXACT,
                objective=dict(name="nft", num_levels=9, levels="schedule", nft_beta=1.0, nft_adv_clip=5.0,
                               nft_decay_type=1, kl_beta=0.0),
                what="DiffusionNFT: ODE rollout (DPM-Solver++), 9 noise levels per sample (configs/digits_nft.yaml)"),
    "awm": dict(sampling=dict(trained_steps=None), grpo=dict(adv_std="global"), jagg=UNFUSED_EXACT,
                objective=dict(name="awm", num_levels=9, levels="schedule", awm_weighting="uniform", kl_beta=0.0),
                what="AWM: ODE rollout (Euler), 9 noise levels per sample (configs/digits_awm.yaml)"),
    "awm_k1": dict(sampling=dict(trained_steps=None), grpo=dict(adv_std="global"), jagg=UNFUSED_EXACT,
                   objective=dict(name="awm", num_levels=1, levels="schedule", awm_weighting="uniform", kl_beta=0.0),
                   what="AWM with ONE noise level per sample (K = 1: one forward + backward per sample)"),
    "awm_multi_t_jagg": dict(sampling=dict(trained_steps=None), grpo=dict(adv_std="global"), jagg=UNFUSED_EXACT,
                             objective=dict(name="awm", num_levels=9, levels="schedule", awm_weighting="uniform",
                                            kl_beta=0.0, shared_noise=True, jagg=True, jagg_window=3),
                             what="AWM with JAGG over its noise levels, windows of 3 levels (one backward each)"),
}
# The cost model (docs/method.md section 11): per sample and training step, (rollout forwards, the update's forwards with
# grad, its no-grad forwards, one-step backwards). Fused JAGG's rollout forwards carry the graphs (no update forward);
# its one backward call sweeps the 2 anchors of each routed window. NFT's theta_old forward per level is counted (it
# lags from the second step on). Predicted CPU = R + G + N + b B (in F, b = B / F) + D (decode, reward, optimizer).
COST = {"exact": (10, 10, 0, 10), "jagg_w5_fused": (10, 0, 0, 4), "jagg_w4_fused": (10, 2, 0, 6), "flow_grpo_fast": (10, 3, 0, 3), "mixgrpo": (10, 2, 0, 2), "flash_tail": (6, 4, 0, 4), "flash_grpo": (10, 1, 0, 1), "flash_grpo_group": (10, 1, 0, 1), "dance_fraction": (10, 6, 0, 6), "jagg_w5_guard": (10, 0, 0, 4), "exact_guard": (10, 10, 0, 10), "jagg_w4_flash_tail": (6, 0, 0, 2), "nft": (10, 9, 9, 9), "awm": (10, 9, 0, 9), "awm_k1": (10, 1, 0, 1), "awm_multi_t_jagg": (10, 6, 3, 6)}
B_OVER_F = 1.2  # a LoRA-only backward against a forward on this CPU (docs/method.md section 5)


def cost_model(summary: dict) -> str:
    """Predicted against measured CPU per method (both relative to the reference): D, the per-step cost outside the
    transformer's passes (decode, reward, optimizer, Python), fitted by least squares over the methods (one number)."""
    rows = [(n, r["cpu_vs_ref"][0]) for n, r in summary["table"].items() if n in COST]
    ref = summary.get("reference", "exact")
    if not rows or ref not in COST:
        return ""
    units = {n: (lambda c: c[0] + c[1] + c[2] + B_OVER_F * c[3])(COST[n]) for n, _ in rows}
    e = units[ref]
    # measured m = (u + D) / (e + D)  <=>  m e - u = D (1 - m): least squares for D
    num = sum((m * e - units[n]) * (1 - m) for n, m in rows)
    den = sum((1 - m) ** 2 for n, m in rows) or float("nan")
    d = num / den
    lines = [f"cost model: B = {B_OVER_F} F, D = {d:.1f} F fitted (the reference {ref}: {e:.1f} F of passes + D)", "",
             "| method | rollout F | update F (grad / no-grad) | backwards | passes (F) | predicted CPU vs exact | measured |",
             "|---|---|---|---|---|---|---|"]
    for n, m in rows:
        c = COST[n]
        lines.append(f"| {n} | {c[0]} | {c[1]} / {c[2]} | {c[3]} | {units[n]:.1f} | {(units[n] + d) / (e + d):.2f} | "
                     f"{m:.2f} |")
    return "\n".join(lines)


DEFAULT = [n for n, m in METHODS.items() if "needs" not in m and n != "exact_guard"]


def available(name: str) -> str | None:
    """None if the method can run here, else why not."""
    need = METHODS[name].get("needs")
    if need and importlib.util.find_spec(need) is None:
        return f"needs {need} (not in this tree)"
    return None


def run_config(base: dict, name: str, lr: float | None = None, group_size: int | None = None) -> dict:
    """The base config with the method's overrides (and a sweep's learning rate / group size)."""
    m, cfg = METHODS[name], json.loads(json.dumps(base))
    model = cfg["model"]
    for section in ("sampling", "grpo", "jagg"):
        model[section] = {k: v for k, v in dict(model.get(section, {}), **m.get(section, {})).items() if v is not None}
    if "objective" in m:
        model["objective"] = m["objective"]
    if lr is not None:
        model["optimizer"]["init_args"]["lr"] = lr
    if group_size is not None:
        model["sampling"]["group_size"] = group_size
    return cfg


def one_run(args, cfg: dict, label: str, name: str, seed: int, prompts, reward, judge, eval_prompts) -> dict:
    from jagg_lightning.data import PromptDataModule
    from jagg_lightning.testbed.evaluate import module_from_config

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    L.seed_everything(seed, verbose=False)
    try:
        module, _ = module_from_config(f.name, seed)
    finally:
        Path(f.name).unlink()
    rec = Recorder(reward, judge, eval_prompts, args.eval_samples, 1000 + seed, args.eval_every)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rec])
    trainer.fit(module, PromptDataModule(prompts=prompts, batch_size=cfg["data"].get("batch_size", 16), seed=seed))
    if rec.evals[-1]["step"] != trainer.global_step:
        rec.evaluate(trainer, module)
    m = cfg["model"]
    return {"seed": seed, "setting": label, "method": name, "lr": m["optimizer"]["init_args"]["lr"],
            "group_size": m["sampling"]["group_size"], "overrides": {k: METHODS[name].get(k, {}) for k in
                                                                     ("sampling", "grpo", "jagg")},
            "train_reward": rec.train_reward, "cpu": rec.cpu, "evals": rec.evals, "passes": rec.passes}


def run(args) -> dict:
    from jagg_lightning.data import read_prompts
    from jagg_lightning.rewards import DigitReward
    from jagg_lightning.testbed import HELDOUT_TEMPLATES, digit_prompts
    from jagg_lightning.testbed.judge import load_judge

    torch.set_num_threads(1)
    base = yaml.safe_load(Path(args.config).read_text())
    prompts = read_prompts(base["data"]["prompts_file"])
    reward, judge = DigitReward(), load_judge()
    eval_prompts = digit_prompts(HELDOUT_TEMPLATES)
    out = Path(args.out) / args.name
    out.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(out.read_text()) if args.resume and out.exists() else {"runs": []}
    result.update({"args": vars(args), "config": Path(args.config).name, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "sweep": bool(args.sweep),
                   "methods": {n: METHODS[n]["what"] for n in args.methods}})
    skipped = {n: why for n in args.methods if (why := available(n))}
    result["skipped"] = skipped
    for n, why in skipped.items():
        print(f"skipping {n}: {why}", flush=True)
    grid = list(itertools.product(args.lr or [None], args.group_size or [None])) if args.sweep else [(None, None)]
    done = {(r["seed"], r["setting"]) for r in result["runs"]}
    for seed in args.seeds:
        for name in (n for n in args.methods if n not in skipped):
            for lr, k in grid:
                label = name if not args.sweep else f"{name} lr={lr} K={k}"
                if (seed, label) in done:
                    continue
                t0 = time.time()
                r = one_run(args, run_config(base, name, lr, k), label, name, seed, prompts, reward, judge,
                            eval_prompts)
                result["runs"].append(r)
                out.write_text(json.dumps(result) + "\n")
                e0, e1 = r["evals"][0], r["evals"][-1]
                print(f"seed {seed} {label}: acc {e0['accuracy']:.3f} -> {e1['accuracy']:.3f}, judge "
                      f"{e0['judge_accuracy']:.3f} -> {e1['judge_accuracy']:.3f}, {r['cpu'][-1]:.1f} s CPU "
                      f"({time.time() - t0:.0f} s wall incl. eval)", flush=True)
    return result


# ---------------------------------------------------------------------------------------------- summary

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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "digits_all_steps.yaml"))
    p.add_argument("--methods", nargs="+", default=DEFAULT, choices=list(METHODS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=8, help="samples per held-out prompt (30 prompts)")
    p.add_argument("--sweep", action="store_true", help="a tuning grid per method (--lr x --group-size)")
    p.add_argument("--lr", type=float, nargs="+", default=None)
    p.add_argument("--group-size", type=int, nargs="+", default=None)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="league.json")
    p.add_argument("--resume", action="store_true", help="keep the runs already in the JSON, do the rest")
    p.add_argument("--replot", nargs="+", default=None, help="saved JSONs (runs merged, the first of a repeat kept)")
    p.add_argument("--list", action="store_true", help="print the method table and exit")
    args = p.parse_args(argv)
    if args.list:
        for n, m in METHODS.items():
            print(f"{n:20s} {m['what']}{'' if not available(n) else '  [' + available(n) + ']'}")
        return
    if args.replot:
        from time_to_quality import load_runs
        result = load_runs(args.replot)
    else:
        result = run(args)
    out, stem = Path(args.out), Path(args.name).stem
    if result.get("sweep"):
        text = sweep_table(result)
        (out / f"{stem}_summary.md").write_text(text + "\n")
        print(text)
        return
    summary = summarise(result)
    (out / f"{stem}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if summary["table"]:
        plot(summary, out / f"{stem}.png")
    text = tables(summary) + "\n\n" + cost_model(summary)
    (out / f"{stem}_summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
