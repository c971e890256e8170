"""Time to quality: exact GRPO against JAGG on the trained digits test bed (issue 19, deliverable 1).

``configs/digits.yaml`` (its ``model`` section: 10 sampling steps, the first 4 stochastic and trained,
16 prompts x 8 samples per step, lr 1e-3), one thread, for each seed and setting one run of ``--steps``
optimizer steps; seed-major, settings interleaved, so a stopped study has whole seeds. Per run:

* per optimizer step: the training reward and the process CPU time of the training step (only the step
  is timed; evaluation is not);
* every ``--eval-every`` steps: held-out accuracy and reward (30 held-out prompts x ``--eval-samples``
  fixed-noise ODE samples, noise seed 1000 + seed) read by the reward's classifier AND by the independent
  judge (``jagg_lightning.testbed.judge``), on the same images. With a scenes config (``--config
  configs/scenes.yaml``, reward ``geneval``) "accuracy" is GenEval's overall score of the 132 held-out rows by the
  exact reader and "judge_accuracy" the scenes judge's (``benchmarks/heldout.py``); ``--prompt`` trains on one
  training row and evaluates on that row instead (``heldout.one_prompt``: the one-prompt study).

Settings (``SETTINGS``): exact (jagg_frac 0), JAGG W = 4 unfused and fused (the one window of 4 trained
steps routed), and 8 trained steps with W = 4 (two routed windows) next to exact on those 8 steps ("T=8 exact").
Per step the run also records which windows were routed, their scores and the passes made.
The routing comparison (``ROUTING``: 8 trained steps, W = 3 chained, jagg_frac 0.5, residual / cosine / random
routing) is summarised by benchmarks/routing_study.py. The JSON (``--name``) is rewritten after every run;
``--replot`` summarises, plots and prints saved ones again (their runs merged):

    OMP_NUM_THREADS=1 python benchmarks/time_to_quality.py --seeds 0 1 2 3 4 --steps 60
    python benchmarks/time_to_quality.py --replot benchmarks/results/time_to_quality.json \
        benchmarks/results/time_to_quality_t8_a.json \
        [--extended benchmarks/results/time_to_quality_fused80.json]   # longer runs of one setting, same seeds
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent

# name -> (sampling overrides, jagg overrides); every setting names fused_rollout (configs/digits_all_steps.yaml
# turns it on, so the section's own value must not leak into "exact")
SETTINGS = {
    "exact": ({}, dict(jagg_frac=0.0, fused_rollout=False)),
    "W=4": ({}, dict(window_size=4, jagg_frac=1.0, fused_rollout=False)),
    "W=4 fused": ({}, dict(window_size=4, jagg_frac=1.0, fused_rollout=True)),
    "T=8 W=4 (2 windows)": (dict(trained_steps=8), dict(window_size=4, jagg_frac=1.0, fused_rollout=False)),
    "T=8 exact": (dict(trained_steps=8), dict(jagg_frac=0.0, fused_rollout=False)),
    # routing that pays (deliverable 3): 8 trained steps, W = 3 chained = windows (0,1,2) (2,3,4) (4,5,6) and the
    # exact tail (6,7); jagg_frac 0.5 routes round(1.5) = 2 of the 3 full windows, so half the windows are routed
    # and every rule saves the same 2 interior passes (chained W = 3 windows share no interior): equal passes
    **{f"T=8 W=3 chained, {rule}": (dict(trained_steps=8), dict(window_size=3, chained=True, jagg_frac=0.5,
                                                                   routing=rule, fused_rollout=False))
       for rule in ("residual", "cosine", "random")},
    # the paper's regime (issue 29, --config configs/digits_all_steps.yaml: all 10 steps trained): W = 5 windows
    # (0..4) (5..9); three anchors per 5 steps = W = 3 chained (0,1,2) (2,3,4) ... (6,7,8) + the exact tail (8,9)
    # (piecewise linear through a middle anchor); the control variate on W = 5 (p = 0.5: a routed window also
    # gets its exact gradient half the time, unbiased)
    "W=5": ({}, dict(window_size=5, jagg_frac=1.0, fused_rollout=False)),
    "W=5 fused": ({}, dict(window_size=5, jagg_frac=1.0, fused_rollout=True)),
    "3 anchors fused": ({}, dict(window_size=3, chained=True, jagg_frac=1.0, fused_rollout=True)),
    "W=5 control variate": ({}, dict(window_size=5, jagg_frac=1.0, fused_rollout=False, estimator="control_variate",
                                     control_p=0.5)),
    # does routing recover W = 4's judge loss (issue 29)? jagg_frac 0.5: of the two full windows (0..3) (4..7) the one
    # with the smaller interpolation residual is routed, the other trained exactly (its interiors kept in the fused mode)
    "W=4 fused, half routed": ({}, dict(window_size=4, jagg_frac=0.5, fused_rollout=True)),
    # the cheaper rollout on the shipped job (issue 29, deliverable 2: MixGRPO-Flash): the ODE tail after the 4 trained
    # steps in 2 DPM-Solver++(2M) steps instead of 6 Euler ones; the trained steps' policy unchanged
    "exact, 2M tail n=2": (dict(ode_solver="dpmpp_2m", ode_steps=2), dict(jagg_frac=0.0, fused_rollout=False)),
    "W=4 fused, 2M tail n=2": (dict(ode_solver="dpmpp_2m", ode_steps=2),
                               dict(window_size=4, jagg_frac=1.0, fused_rollout=True)),
}
ROUTING = [n for n in SETTINGS if n.startswith("T=8 W=3 chained")]

# The cost model of docs/method.md §7 per training step, in units of one forward F over the rollout
# (S sampling steps; B = 1.2 F with LoRA only; decode, reward and optimizer neglected, F_g = F):
# the rollout S F; exact T (F + B); unfused JAGG (F + B) per pass step (the anchors; interiors cached; a tail
# window's steps); fused: only B per pass step (its forward was the rollout's); the control variate adds its
# drawn windows' interiors, p (W - 2) (F + B) each in expectation.
B_OVER_F = 1.2


def pass_steps(name: str, trained: int) -> float:
    """Pass steps per sample and training step (a batched anchor pair counts 2; expectation for the control
    variate) when ``trained`` steps are trained."""
    from jagg_lightning.method.jagg import plan_windows

    sampling, jagg = SETTINGS[name]
    trained = sampling.get("trained_steps", trained)
    if jagg.get("jagg_frac", 0.5) == 0.0:
        return float(trained)
    windows = plan_windows(range(trained), jagg["window_size"], jagg.get("chained", False))
    routed = [w.steps for w in windows if len(w.steps) > 2]
    if jagg.get("jagg_frac") != 1.0:  # the routing comparison: 2 of the 3 full windows routed
        routed = routed[:round(jagg["jagg_frac"] * len(routed))]
    steps = {k for w in windows for k in w.steps} - {k for w in routed for k in w[1:-1]}
    extra = jagg.get("control_p", 0.0) * sum(len(w) - 2 for w in routed) if "estimator" in jagg else 0.0
    return len(steps) + extra


def model_cost(name: str, num_steps: int = 10, trained: int = 4) -> float:
    passes = pass_steps(name, trained)
    sampling, jagg = SETTINGS[name]
    per_pass = B_OVER_F if jagg.get("fused_rollout") else 1.0 + B_OVER_F
    # a Flash tail: the trained steps, then ode_steps evaluations (DPM-Solver++(2M): one each) instead of the rest
    rollout = sampling.get("trained_steps", trained) + sampling["ode_steps"] if "ode_steps" in sampling else num_steps
    return rollout + passes * per_pass


class Recorder(L.Callback):
    """Training reward and CPU time per step (the step only), held-out evaluation every ``every`` steps."""

    def __init__(self, heldout, seed, every):
        self.heldout, self.seed, self.every = heldout, seed, every  # heldout: benchmarks/heldout.py
        self.train_reward, self.cpu, self.evals, self._cpu = [], [], [], 0.0
        self.routed, self.scores, self.passes = [], [], []  # per step: which windows were routed, their scores

    def evaluate(self, trainer, module):
        from jagg_lightning.utils.timing import CLOCK

        with CLOCK.phase("evaluation"):  # a phase of its own where a StepTimes runs beside (league.py)
            res = self.heldout(module, self.seed)
        self.evals.append({"step": trainer.global_step, "cpu": self._cpu, **{k: res[k] for k in
                          ("accuracy", "reward", "judge_accuracy", "judge_agreement", "per_task", "judge_per_task")
                          if k in res}})

    def on_fit_start(self, trainer, module):
        self.evaluate(trainer, module)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._c0 = time.process_time()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._cpu += time.process_time() - self._c0
        self.cpu.append(self._cpu)
        self.train_reward.append(float(trainer.callback_metrics["train/reward_mean"]))
        self.routed.append([w.routed for w in module.windows])
        self.scores.append([w.score for w in module.windows])
        self.passes.append({k: float(trainer.callback_metrics[f"train/passes/{k}"]) for k in ("backward", "grad_forward")
                            if f"train/passes/{k}" in trainer.callback_metrics})
        if trainer.global_step % self.every == 0:
            self.evaluate(trainer, module)


def fit_recorded(cfg: dict, seed: int, prompts, heldout, steps: int, eval_every: int, callbacks=(), **jagg) -> Recorder:
    """One seeded run of the config ``cfg`` (``jagg`` overriding its jagg section) for ``steps`` optimizer steps,
    recorded (held-out evaluations every ``eval_every`` steps and after the last), ``callbacks`` beside the recorder;
    the study scripts' one run."""
    from jagg_lightning.data import PromptDataModule
    from jagg_lightning.testbed.evaluate import module_from_config

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    L.seed_everything(seed, verbose=False)
    try:
        module, _ = module_from_config(f.name, seed, **jagg)
    finally:
        Path(f.name).unlink()
    rec = Recorder(heldout, 1000 + seed, eval_every)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rec, *callbacks])
    data = PromptDataModule(prompts=prompts, batch_size=cfg["data"].get("batch_size", 16), seed=seed,
                            balance_tasks=cfg["data"].get("balance_tasks", False))
    trainer.fit(module, data)
    if rec.evals[-1]["step"] != trainer.global_step:
        rec.evaluate(trainer, module)
    return rec


def one_run(args, base_cfg: dict, name: str, seed: int, prompts, heldout) -> dict:
    sampling, jagg = SETTINGS[name]
    cfg = json.loads(json.dumps(base_cfg))
    cfg["model"]["sampling"] = dict(cfg["model"]["sampling"], **sampling)
    rec = fit_recorded(cfg, seed, prompts, heldout, args.steps, args.eval_every, **jagg)
    return {"seed": seed, "setting": name, "sampling": sampling, "jagg": jagg, "train_reward": rec.train_reward,
            "cpu": rec.cpu, "evals": rec.evals, "routed": rec.routed, "scores": rec.scores, "passes": rec.passes}


def run(args) -> dict:
    from heldout import heldout_for, one_prompt
    from jagg_lightning.data import read_prompts

    torch.set_num_threads(1)
    base_cfg = yaml.safe_load(Path(args.config).read_text())
    prompts = read_prompts(base_cfg["data"]["prompts_file"])  # a shipped name or a path (jagg_lightning.utils.assets)
    if args.prompt:  # one row trained and evaluated (benchmarks/README.md, "one prompt")
        base_cfg, prompts, heldout = one_prompt(base_cfg, prompts, args.prompt, args.eval_samples, args.group_size)
    else:
        heldout = heldout_for(base_cfg, args.eval_samples)
    out = Path(args.out) / args.name
    out.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(out.read_text()) if args.resume and out.exists() else {"runs": []}
    sampling = base_cfg["model"]["sampling"]
    result["regime"] = {"config": Path(args.config).name, "num_steps": sampling["num_steps"],
                        "trained": sampling.get("trained_steps") or sampling["num_steps"] - 1}
    result.update({"args": vars(args), "settings": {k: list(v) for k, v in SETTINGS.items()},
                   "torch": torch.__version__, "threads": torch.get_num_threads()})
    done = {(r["seed"], r["setting"]) for r in result["runs"]}
    for seed in args.seeds:
        for name in args.settings:
            if (seed, name) in done:
                continue
            t0 = time.time()
            r = one_run(args, base_cfg, name, seed, prompts, heldout)
            result["runs"].append(r)
            out.write_text(json.dumps(result) + "\n")
            e0, e1 = r["evals"][0], r["evals"][-1]
            print(f"seed {seed} {name}: acc {e0['accuracy']:.3f} -> {e1['accuracy']:.3f}, judge "
                  f"{e0['judge_accuracy']:.3f} -> {e1['judge_accuracy']:.3f}, {r['cpu'][-1]:.1f} s CPU "
                  f"({time.time() - t0:.0f} s wall incl. eval)", flush=True)
    return result


# ---------------------------------------------------------------------------------------------- summary

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def mean_ci(values) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t interval over seeds (nan for one value)."""
    v = [float(x) for x in values if not math.isnan(float(x))]
    if not v:
        return float("nan"), float("nan")
    m = sum(v) / len(v)
    if len(v) < 2:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
    return m, T95.get(len(v) - 1, 1.96) * sd / math.sqrt(len(v))


def crossing(xs, ys, target) -> float:
    """First x where the piecewise-linear curve (xs, ys) reaches ``target`` (nan if never)."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y1 >= target:
            return x0 + (x1 - x0) * ((target - y0) / (y1 - y0) if y1 != y0 and y0 < target else 0.0)
    return float("nan")


def summary_curve(by: dict, seeds, name: str, key: str) -> list[float]:
    rs = [by[(s, name)] for s in seeds if (s, name) in by]
    return [sum(r["evals"][i][key] for r in rs) / len(rs) for i in range(min(len(r["evals"]) for r in rs))]


def load_runs(paths) -> dict:
    """The runs of several saved JSONs in one result (the first file's other keys); a (seed, setting) run that
    is in two files is taken from the first."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    merged, seen = dict(results[0], runs=[]), set()
    for res in results:
        for r in res["runs"]:
            if (r["seed"], r["setting"]) not in seen:
                seen.add((r["seed"], r["setting"]))
                merged["runs"].append(r)
    return merged


def summarise(result: dict) -> dict:
    """Every setting but the routing comparison (benchmarks/routing_study.py) against exact on its seeds."""
    runs = result["runs"]
    names = [n for n in SETTINGS if n not in ROUTING and any(r["setting"] == n for r in runs)]
    by = {(r["seed"], r["setting"]): r for r in runs}
    seeds = sorted({s for s, n in by if n == "exact"})  # each setting: the seeds it shares with exact
    keys = ("accuracy", "reward", "judge_accuracy", "judge_agreement")
    regime = result.get("regime", {"config": "digits.yaml", "num_steps": 10, "trained": 4})  # older JSONs: digits.yaml
    exact_final = {k: mean_ci([by[(s, "exact")]["evals"][-1][k] for s in seeds])[0] for k in keys}
    table = {}
    for name in names:
        rs = [by[(s, name)] for s in seeds if (s, name) in by]
        own = [r["seed"] for r in rs]  # exact's numbers below are over the same seeds (paired)
        ex_cpu = mean_ci([by[(s, "exact")]["cpu"][-1] for s in own])[0]
        ex_final = {k: mean_ci([by[(s, "exact")]["evals"][-1][k] for s in own])[0] for k in keys}
        ex_gain = {k: mean_ci([by[(s, "exact")]["evals"][-1][k] - by[(s, "exact")]["evals"][0][k] for s in own])[0]
                   for k in keys}
        ex_cpu_curve = summary_curve(by, own, "exact", "cpu")
        row = {"seeds": [r["seed"] for r in rs], "cpu_s": mean_ci([r["cpu"][-1] for r in rs]),
               "cpu_vs_exact": mean_ci([r["cpu"][-1] / by[(r["seed"], "exact")]["cpu"][-1] for r in rs]),
               "model_ratio": model_cost(name, regime["num_steps"], regime["trained"])
               / model_cost("exact", regime["num_steps"], regime["trained"]),
               "backward_ratio": pass_steps(name, regime["trained"]) / pass_steps("exact", regime["trained"])}
        for k in keys:
            row[f"{k}_start"] = mean_ci([r["evals"][0][k] for r in rs])
            row[f"{k}_final"] = mean_ci([r["evals"][-1][k] for r in rs])
            row[f"{k}_gain"] = mean_ci([r["evals"][-1][k] - r["evals"][0][k] for r in rs])
            # paired against exact on the same seed (same LoRA init, prompts, evaluation noise)
            row[f"{k}_minus_exact"] = mean_ci([r["evals"][-1][k] - by[(r["seed"], "exact")]["evals"][-1][k] for r in rs])
            row[f"{k}_gain_share"] = row[f"{k}_gain"][0] / ex_gain[k] if ex_gain[k] else float("nan")
        # mean curve over seeds (evaluation points are the same steps in every run)
        n = min(len(r["evals"]) for r in rs)
        steps = [rs[0]["evals"][i]["step"] for i in range(n)]
        cpu = [sum(r["evals"][i]["cpu"] for r in rs) / len(rs) for i in range(n)]
        for k in ("accuracy", "judge_accuracy"):
            curve = [sum(r["evals"][i][k] for r in rs) / len(rs) for i in range(n)]
            # times to exact's quality: defined only where exact gained (else any curve "reaches" it at once and
            # exact's own time is 0)
            nan = float("nan")
            gained = ex_gain[k] > 0
            row[f"cpu_to_exact_{k}"] = crossing(cpu, curve, ex_final[k]) if gained else nan
            row[f"steps_to_exact_{k}"] = crossing(steps, curve, ex_final[k]) if gained else nan
            row[f"cpu_to_exact_{k}_vs_exact_cpu"] = row[f"cpu_to_exact_{k}"] / ex_cpu
            # 90 % of exact's gain: defined even where the final accuracy itself is never reached
            ex_curve = summary_curve(by, own, "exact", k)
            target90 = ex_curve[0] + 0.9 * (ex_final[k] - ex_curve[0])
            row[f"cpu_to_90_{k}_vs_exact"] = (crossing(cpu, curve, target90)
                                              / crossing(ex_cpu_curve, ex_curve, target90)) if gained else nan
            row[f"curve_{k}"] = curve
        row["curve_steps"], row["curve_cpu"] = steps, cpu
        table[name] = row
    return {"seeds": seeds, "regime": regime, "exact_final": exact_final, "table": table}


def extended_time_to_quality(result: dict, extended: dict) -> dict:
    """Longer runs of a setting (``extended``: same seeds, more steps): per seed the CPU time at which it
    reaches that seed's exact final accuracy (linear between evaluations), as a ratio to exact's CPU time,
    and the same on the mean curves."""
    by = {(r["seed"], r["setting"]): r for r in result["runs"]}
    out = {}
    for name in sorted({r["setting"] for r in extended["runs"]}):
        rs = [r for r in extended["runs"] if r["setting"] == name and (r["seed"], "exact") in by]
        row = {"seeds": [r["seed"] for r in rs], "steps": len(rs[0]["cpu"])}
        for k in ("accuracy", "judge_accuracy"):
            ratios, steps = [], []
            for r in rs:
                ex = by[(r["seed"], "exact")]
                target = ex["evals"][-1][k]
                ev = r["evals"]
                ratios.append(crossing([e["cpu"] for e in ev], [e[k] for e in ev], target) / ex["cpu"][-1])
                steps.append(crossing([e["step"] for e in ev], [e[k] for e in ev], target))
            n = min(len(r["evals"]) for r in rs)
            cpu = [sum(r["evals"][i]["cpu"] for r in rs) / len(rs) for i in range(n)]
            curve = [sum(r["evals"][i][k] for r in rs) / len(rs) for i in range(n)]
            ex_final = sum(by[(s, "exact")]["evals"][-1][k] for s in row["seeds"]) / len(rs)
            ex_cpu = sum(by[(s, "exact")]["cpu"][-1] for s in row["seeds"]) / len(rs)
            # the same in steps, priced at the main study's CPU per step of this setting (same load as exact's runs)
            per_step = {r["seed"]: by[(r["seed"], name)]["cpu"][-1] / len(by[(r["seed"], name)]["cpu"]) for r in rs}
            priced = [st * per_step[r["seed"]] / by[(r["seed"], "exact")]["cpu"][-1] for st, r in zip(steps, rs)]
            mean_step = sum(per_step.values()) / len(rs)
            row[k + "_priced"] = {"per_seed_ratio": priced, "ratio_mean_ci": mean_ci(priced)}
            row[k] = {"per_seed_ratio": ratios, "per_seed_steps": steps, "reached": sum(not math.isnan(x) for x in ratios),
                      "ratio_mean_ci": mean_ci(ratios), "mean_curve_ratio": crossing(cpu, curve, ex_final) / ex_cpu,
                      "mean_curve_steps": crossing([rs[0]["evals"][i]["step"] for i in range(n)], curve, ex_final),
                      "mean_curve_ratio_priced": crossing([rs[0]["evals"][i]["step"] for i in range(n)], curve, ex_final)
                      * mean_step / ex_cpu,
                      "final": mean_ci([r["evals"][-1][k] for r in rs]),
                      "final_minus_exact60": mean_ci([r["evals"][-1][k] - by[(r["seed"], "exact")]["evals"][-1][k] for r in rs])}
        out[name] = row
    return out


def fmt(mc, digits=3) -> str:
    m, h = mc
    return f"{m:.{digits}f} ± {h:.{digits}f}" if not math.isnan(h) else f"{m:.{digits}f}"


def tables(summary: dict) -> str:
    t = summary["table"]
    lines = [f"seeds {summary['seeds']}; ± is the 95 % t interval over seeds", "",
             "| setting | seeds | classifier acc. start → final | gain | final − exact (paired) | judge acc. start → final | "
             "gain | final − exact (paired) | held-out reward gain | gain share (cls / judge) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in t.items():
        lines.append(f"| {name} | {len(r['seeds'])} | {r['accuracy_start'][0]:.3f} → {fmt(r['accuracy_final'])} | {fmt(r['accuracy_gain'])} | "
                     f"{fmt(r['accuracy_minus_exact'])} | {r['judge_accuracy_start'][0]:.3f} → {fmt(r['judge_accuracy_final'])} | "
                     f"{fmt(r['judge_accuracy_gain'])} | {fmt(r['judge_accuracy_minus_exact'])} | {fmt(r['reward_gain'])} | "
                     f"{r['accuracy_gain_share']:.2f} / {r['judge_accuracy_gain_share']:.2f} |")
    lines += ["", "| setting | CPU s, all steps | vs exact (per seed) | CPU s to exact's final acc. (classifier / judge) | "
              "as share of exact's CPU | steps to it | CPU to 90 % of exact's gain, vs exact (cls / judge) | "
              "cost-model limit | backward-pass ratio |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, r in t.items():
        lines.append(f"| {name} | {fmt(r['cpu_s'], 1)} | {fmt(r['cpu_vs_exact'], 2)} | "
                     f"{r['cpu_to_exact_accuracy']:.1f} / {r['cpu_to_exact_judge_accuracy']:.1f} | "
                     f"{r['cpu_to_exact_accuracy_vs_exact_cpu']:.2f} / {r['cpu_to_exact_judge_accuracy_vs_exact_cpu']:.2f} | "
                     f"{r['steps_to_exact_accuracy']:.0f} / {r['steps_to_exact_judge_accuracy']:.0f} | "
                     f"{r['cpu_to_90_accuracy_vs_exact']:.2f} / {r['cpu_to_90_judge_accuracy_vs_exact']:.2f} | "
                     f"{r['model_ratio']:.2f} | {r['backward_ratio']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 12))
    by = {(r["seed"], r["setting"]): r for r in result["runs"]}
    for name, r in summary["table"].items():
        for row, key, label in ((0, "accuracy", "classifier"), (1, "judge_accuracy", "judge")):
            per_seed = [[by[(s, name)]["evals"][i][key] for i in range(len(r["curve_steps"]))] for s in r["seeds"]]
            ci = [mean_ci(col)[1] for col in zip(*per_seed)]
            y = r[f"curve_{key}"]
            for col, x in ((0, r["curve_steps"]), (1, r["curve_cpu"])):
                ax = axes[row, col]
                ax.errorbar(x, y, yerr=ci, marker="o", capsize=3, label=name)
                ax.set_ylabel(f"held-out accuracy ({label})")
                ax.set_xlabel("optimizer step" if col == 0 else "process CPU s (training steps only, mean)")
                ax.grid(alpha=0.3)
        for col, key, label in ((0, "accuracy", "classifier"), (1, "judge_accuracy", "judge")):
            # paired: setting minus exact on the same seed, per evaluation point
            diffs = [[by[(s, name)]["evals"][i][key] - by[(s, "exact")]["evals"][i][key] for s in r["seeds"]]
                     for i in range(len(r["curve_steps"]))]
            ax = axes[2, col]
            ax.errorbar(r["curve_steps"], [mean_ci(d)[0] for d in diffs], yerr=[mean_ci(d)[1] for d in diffs],
                        marker="o", capsize=3, label=name)
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(f"held-out accuracy ({label}) minus exact's, same seed")
            ax.axhline(0, color="grey", lw=1)
            ax.grid(alpha=0.3)
    for row, key in ((0, "accuracy"), (1, "judge_accuracy")):
        for col in (0, 1):
            axes[row, col].axhline(summary["exact_final"][key], color="grey", ls=":", lw=1)
    axes[0, 0].legend(fontsize=8)
    prompt = result.get("args", {}).get("prompt")  # the one-prompt study names its prompt
    fig.suptitle(f"configs/{summary['regime']['config']}" + (f", one prompt: {prompt!r}" if prompt else "")
                 + f"\nexact GRPO vs JAGG, mean ± 95 % CI of seeds {summary['seeds']}")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "digits.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=8, help="samples per held-out prompt (30 prompts)")
    p.add_argument("--prompt", default=None, help="train on this one training prompt and evaluate on it")
    p.add_argument("--group-size", type=int, default=None, help="with --prompt: samples per step (config's if unset)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="time_to_quality.json", help="the raw JSON's file name under --out (the summary "
                   "and plot are named after it)")
    p.add_argument("--resume", action="store_true", help="keep the runs already in the JSON, do the rest")
    p.add_argument("--replot", nargs="+", default=None, help="saved JSONs (their runs merged; a repeated run is "
                   "taken from the first file)")
    p.add_argument("--extended", default=None, help="with --replot: a JSON of longer runs of a setting, same seeds")
    args = p.parse_args(argv)
    result = load_runs(args.replot) if args.replot else run(args)
    if not any(r["setting"] == "exact" for r in result["runs"]):
        print("no 'exact' runs to compare with: --replot this JSON with one that has them (or routing_study.py)")
        return
    summary = summarise(result)
    if args.extended:
        summary["extended"] = extended_time_to_quality(result, json.loads(Path(args.extended).read_text()))
        print(json.dumps(summary["extended"], indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(args.name).stem  # time_to_quality.json -> time_to_quality_summary.json, time_to_quality.png
    (out / f"{stem}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(result, summary, out / f"{stem}.png")
    print(tables(summary))


if __name__ == "__main__":
    main()
