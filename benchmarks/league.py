"""The league (issue 41): every method a user would pick, each ONE config choice over the same engine, on the digits
test bed in the paper's regime (``configs/digits_all_steps.yaml``: 10 sampling steps, all trained, 16 prompts x 8
samples per step, lr 1e-3, one optimizer step per rollout), measured side by side.

Per (seed, method) one run of ``--steps`` optimizer steps, one thread, seed-major with the methods interleaved (a
stopped league has whole seeds); time is the process CPU time of the training steps only. Every ``--eval-every``
steps both readers -- the reward's classifier (``val/digit_accuracy``) and the independent judge
(``val/judge_accuracy``) -- read the same fixed-noise ODE samples of the 30 HELD-OUT prompts (noise seed 1000 + seed).
``--config configs/scenes.yaml`` runs it on the scenes test bed (GenEval's overall score by the exact reader and by
the scenes judge: ``benchmarks/heldout.py``).
The recording is ``time_to_quality.py``'s (``fit_recorded``); the statistics, tables, the sweep's choice and the plot
``league_report.py``'s.

``METHODS`` is the table: a name -> the overrides of the config's ``sampling`` / ``grpo`` / ``jagg`` sections (every
entry names ``fused_rollout``: the base config turns it on). ``--methods`` picks names from it; an entry whose
``needs`` module is not importable is listed and skipped with the reason. ``--sweep`` runs a small tuning grid per method (``--lr`` x ``--group-size``)
on seeds outside the reported ones, into its own JSON; the summary reports it.

    OMP_NUM_THREADS=1 python benchmarks/league.py --seeds 0 2 4 --name league_a.json   # (benchmarks/README.md)
    python benchmarks/league.py --replot benchmarks/results/league_a.json benchmarks/results/league_b.json \
        --name league.json
    OMP_NUM_THREADS=1 python benchmarks/league.py --sweep --seeds 100 --methods exact flash_grpo \
        --lr 5e-4 1e-3 2e-3 --group-size 4 8 --name league_sweep.json
    OMP_NUM_THREADS=1 python benchmarks/league.py --tuned benchmarks/results/league_sweep.json \
        --methods exact flash_grpo --seeds 0 1 2 --name league_tuned.json   # each at the sweep's choice
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from league_report import (choose, cost_model, phase_table, plot, summarise, sweep_table, tables,  # noqa: E402
                           task_table, tuned_table)
from time_to_quality import fit_recorded  # noqa: E402  (the shared machinery)

ROOT = Path(__file__).resolve().parent.parent
FAST_WINDOW = dict(trained_steps=None, ode_after_trained=False)
FLASH_TAIL = dict(trained_steps=4, ode_after_trained=True, ode_solver="dpmpp_2m", ode_steps=2)
UNFUSED_EXACT = dict(jagg_frac=0.0, fused_rollout=False)
DPPO_TWO_UPDATES = dict(train_batch_size=32, micro_batches_per_update=2)  # configs/digits_flow_dppo.yaml

# name -> {"sampling": ..., "grpo": ..., "jagg": ..., "what": one line, "needs": a module that must import,
#          "updates_per_rollout": optimizer steps per rollout (1 if absent): the run makes --steps ROLLOUTS}
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
    # DGPO (issue 57): configs/digits_dgpo.yaml's settings -- DPM-Solver++ ODE rollout, K = 4 levels among the
    # schedule's first 5 times, beta_dpo 100, clip_dsm 0.01, KL 0.02, group-shared noise (the authors' config/dgpo.py)
    "dgpo": dict(sampling=dict(trained_steps=None, ode_after_trained=True, ode_solver="dpmpp_2m"),
                 grpo=dict(adv_std="group", adv_clip=5.0), jagg=UNFUSED_EXACT,
                 objective=dict(name="dgpo", num_levels=4, levels="schedule", dgpo_trunc_steps=4, dgpo_beta=100.0,
                                dgpo_clip_range=0.01, dgpo_old_rollout_after=500, dgpo_group_noise=True,
                                kl_beta=0.02),
                 what="DGPO: ODE rollout (DPM-Solver++), group DPO at 4 high-noise levels (configs/digits_dgpo.yaml)"),
    # Flow-DPPO (issue 57): configs/digits_flow_dppo.yaml's settings with its own exact line (jagg_frac 0): every
    # SDE step trained, the KL mask at 1e-5, two optimizer steps per rollout (4 micro-batches of 32, 2 per update)
    "flow_dppo": dict(grpo=dict(kl_beta=0.0, **DPPO_TWO_UPDATES), jagg=UNFUSED_EXACT, updates_per_rollout=2,
                      objective=dict(name="flow_dppo", dppo_threshold=1e-5),
                      what="exact Flow-DPPO: every step trained, KL mask 1e-5, two updates per rollout"),
    # JAGG under Flow-DPPO's loss, in the cheapest regime JAGG has (jagg_w4_flash_tail's rollout). Unfused: the fused
    # mode makes one update per rollout, at theta = theta_old, where the mask drops nothing and the gradient is
    # GRPO's (docs/method.md section 10) -- fused, this row would be jagg_w4_flash_tail's; two updates let the mask act
    "jagg_w4_flow_dppo": dict(sampling=FLASH_TAIL, grpo=dict(kl_beta=0.0, **DPPO_TWO_UPDATES),
                              jagg=dict(window_size=4, jagg_frac=1.0, fused_rollout=False), updates_per_rollout=2,
                              objective=dict(name="flow_dppo", dppo_threshold=1e-5),
                              what="JAGG W = 4, first 4 steps + the 2M tail, Flow-DPPO, two updates per rollout"),
}
# The cost levers (issue 57): the fastest methods with fewer rollout steps or noise levels, for a grid on one seed
# outside the ten (benchmarks/README.md, "The cost levers"); not in the default league
for _k in (1, 3):
    METHODS[f"jagg_w4_flash_tail_2m{_k}"] = dict(sampling=dict(FLASH_TAIL, ode_steps=_k), lever=True,
                                                jagg=METHODS["jagg_w4_flash_tail"]["jagg"],
                                                what=f"fused JAGG W = 4 over the first 4 steps + a {_k}-step 2M tail")
for _k in (1, 3, 5):
    METHODS[f"nft_k{_k}"] = dict(METHODS["nft"], objective=dict(METHODS["nft"]["objective"], num_levels=_k),
                                 lever=True, what=f"DiffusionNFT with {_k} noise level(s) per sample")
for _k in (3, 5):
    METHODS[f"awm_k{_k}"] = dict(METHODS["awm"], objective=dict(METHODS["awm"]["objective"], num_levels=_k),
                                 lever=True, what=f"AWM with {_k} noise levels per sample")

# The cost model (docs/method.md section 11): per sample and training step, (rollout forwards, the update's forwards with
# grad, its no-grad forwards, one-step backwards). Fused JAGG's rollout forwards carry the graphs (no update forward);
# its one backward call sweeps the 2 anchors of each routed window. NFT's theta_old forward per level is counted (it
# lags from the second step on). Predicted CPU = R + G + N + b B (in F, b = B / F) + D (decode, reward, optimizer).
COST = {"exact": (10, 10, 0, 10), "jagg_w5_fused": (10, 0, 0, 4), "jagg_w4_fused": (10, 2, 0, 6), "flow_grpo_fast": (10, 3, 0, 3), "mixgrpo": (10, 2, 0, 2), "flash_tail": (6, 4, 0, 4), "flash_grpo": (10, 1, 0, 1), "flash_grpo_group": (10, 1, 0, 1), "dance_fraction": (10, 6, 0, 6), "jagg_w5_guard": (10, 0, 0, 4), "exact_guard": (10, 10, 0, 10), "jagg_w4_flash_tail": (6, 0, 0, 2), "nft": (10, 9, 9, 9), "awm": (10, 9, 0, 9), "awm_k1": (10, 1, 0, 1), "awm_multi_t_jagg": (10, 6, 3, 6),
        # DGPO: K = 4 levels, each a forward with grad, an adapter-off reference forward (its l_ref, whatever kl_beta)
        # and theta_old's no-grad forward (theta_old lags theta from the second step on), one backward per level.
        # Flow-DPPO: per ROLLOUT (two optimizer steps, each sample in one of them), exact: GRPO's passes; JAGG W = 4
        # over the first 4 steps + the tail: 6 rollout forwards, the 2 anchors with grad, the 2 interiors from the
        # rollout's cache in the first update and by no-grad forwards in the second (theta moved): 1 a sample on average
        "dgpo": (10, 4, 8, 4), "flow_dppo": (10, 10, 0, 10), "jagg_w4_flow_dppo": (6, 2, 1, 2),
        "jagg_w4_flash_tail_2m1": (5, 0, 0, 2), "jagg_w4_flash_tail_2m3": (7, 0, 0, 2), "nft_k1": (10, 1, 1, 1),
        "nft_k3": (10, 3, 3, 3), "nft_k5": (10, 5, 5, 5), "awm_k3": (10, 3, 0, 3), "awm_k5": (10, 5, 0, 5)}
B_OVER_F = 1.2  # a LoRA-only backward against a forward on this CPU (docs/method.md section 5)


DEFAULT = [n for n, m in METHODS.items() if "needs" not in m and "lever" not in m and n != "exact_guard"]


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


def one_run(args, cfg: dict, label: str, name: str, seed: int, prompts, heldout) -> dict:
    from jagg_lightning.callbacks import StepTimes

    per = METHODS[name].get("updates_per_rollout", 1)  # --steps and --eval-every count rollouts for every method
    times = StepTimes()  # wall seconds per phase (the held-out evaluations are the Recorder's, outside the phases)
    rec = fit_recorded(cfg, seed, prompts, heldout, args.steps * per, args.eval_every * per, callbacks=[times])
    m = cfg["model"]
    return {"seed": seed, "setting": label, "method": name, "lr": m["optimizer"]["init_args"]["lr"],
            "group_size": m["sampling"]["group_size"], "overrides": {k: METHODS[name].get(k, {}) for k in
                                                                     ("sampling", "grpo", "jagg", "objective")},
            "train_reward": rec.train_reward, "cpu": rec.cpu, "evals": rec.evals, "passes": rec.passes,
            "phases": dict(times.totals)}


def tuned_settings(args, base: dict) -> dict:
    """``choose`` over the sweep JSONs ``args.tuned``; the methods whose choice differs from the config's setting
    (``rerun``) and the rest (``same``: their paper-setting rows are their tuned rows)."""
    from time_to_quality import load_runs

    chosen = choose(load_runs(args.tuned), args.methods)
    paper = (base["model"]["optimizer"]["init_args"]["lr"], base["model"]["sampling"]["group_size"])
    rerun = [n for n, c in chosen.items() if (c["lr"], c["group_size"]) != paper]
    return {"chosen": chosen, "rerun": rerun, "same": [n for n in chosen if n not in rerun],
            "unswept": [n for n in args.methods if n not in chosen]}


def run(args) -> dict:
    from heldout import heldout_for
    from jagg_lightning.data import read_prompts

    torch.set_num_threads(1)
    base = yaml.safe_load(Path(args.config).read_text())
    if args.balance_tasks:
        base["data"]["balance_tasks"] = True
    prompts = read_prompts(base["data"]["prompts_file"])
    heldout = heldout_for(base, args.eval_samples, images_per_task=args.images_per_task)
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
    tuned = tuned_settings(args, base) if args.tuned else None
    if tuned is not None:
        result["tuned"] = tuned
    done = {(r["seed"], r["setting"]) for r in result["runs"]}
    for seed in args.seeds:
        for name in (n for n in args.methods if n not in skipped and (tuned is None or n in tuned["rerun"])):
            for lr, k in ([tuned["chosen"][name]["lr"], tuned["chosen"][name]["group_size"]],) if tuned else grid:
                label = f"{name} tuned" if tuned else name if not args.sweep else f"{name} lr={lr} K={k}"
                if (seed, label) in done:
                    continue
                t0 = time.time()
                r = one_run(args, run_config(base, name, lr, k), label, name, seed, prompts, heldout)
                result["runs"].append(r)
                out.write_text(json.dumps(result) + "\n")
                e0, e1 = r["evals"][0], r["evals"][-1]
                print(f"seed {seed} {label}: acc {e0['accuracy']:.3f} -> {e1['accuracy']:.3f}, judge "
                      f"{e0['judge_accuracy']:.3f} -> {e1['judge_accuracy']:.3f}, {r['cpu'][-1]:.1f} s CPU "
                      f"({time.time() - t0:.0f} s wall incl. eval)", flush=True)
    out.write_text(json.dumps(result) + "\n")  # also when nothing was left to run (a tuned run that reran nothing)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "digits_all_steps.yaml"))
    p.add_argument("--methods", nargs="+", default=DEFAULT, choices=list(METHODS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=8, help="samples per held-out prompt (30 prompts)")
    p.add_argument("--images-per-task", type=int, default=None,
                   help="scenes: at least this many held-out images per GenEval task (rows repeated, one sample each; "
                        "replaces --eval-samples)")
    p.add_argument("--balance-tasks", action="store_true",
                   help="GenEval prompts: every task's train rows repeated to the largest task's count (data.balance_tasks)")
    p.add_argument("--sweep", action="store_true", help="a tuning grid per method (--lr x --group-size)")
    p.add_argument("--lr", type=float, nargs="+", default=None)
    p.add_argument("--group-size", type=int, nargs="+", default=None)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="league.json")
    p.add_argument("--resume", action="store_true", help="keep the runs already in the JSON, do the rest")
    p.add_argument("--tuned", nargs="+", default=None,
                   help="sweep JSONs: run each method at the setting `choose` picks from them (as '<method> tuned'; a "
                        "method whose choice is the paper's setting is not rerun)")
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
    text = tables(summary) + "\n\n" + cost_model(summary, COST, B_OVER_F)
    if any(name.endswith(" tuned") for name in summary["table"]):
        text += "\n\n" + tuned_table(summary, result)
    if phases := phase_table(result):
        text += "\n\n" + phases
    if task_table(result):
        text += "\n\nGenEval's tasks, first evaluation → final (reader / judge):\n\n" + task_table(result)
    (out / f"{stem}_summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
