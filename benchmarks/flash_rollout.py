"""The cheaper rollout on the digits job as shipped (issue 29, deliverable 2): the whole training step's CPU time with
the ODE tail after the 4 trained steps sampled by DPM-Solver++(2M) in fewer steps (``sampling.ode_solver`` /
``sampling.ode_steps``, MixGRPO-Flash), exact GRPO and fused JAGG W = 4, as ratios to exact GRPO with today's sampler
(Euler on the schedule's 6 remaining steps).

``configs/digits.yaml``'s ``model`` section (the trained digits pipeline, DigitReward, 16 prompts x 8 samples, 10
sampling steps, the first 4 SDE and trained; fused needs ``adv_std: group``, which the config has), one thread. Each
(setting, repeat) runs in its own process; repeats are interleaved round by round, so drift on a shared machine hits
every setting alike. A process runs ``--steps`` real ``Trainer`` steps on the same prompts; the first is a warm-up,
the rest are timed (process CPU time of the training step, median). Per setting: the rollout's transformer
evaluations (velocity calls per rollout micro-batch), the passes the module logged, the share of the step spent in
decode + reward and in the update's engine, and the training reward of the FIRST step -- its rollout is sampled by
the same policy from the same noise in every setting (the trained steps' states are identical), so it compares what
the tails make of them. Not a test: run it by hand:

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/flash_rollout.py --repeats 5 \\
        --json benchmarks/results/flash_rollout_digits.json
    OMP_NUM_THREADS=1 python benchmarks/flash_rollout.py --config configs/digits_all_steps.yaml --repeats 3 \\
        --only exact "exact fused" W=5 "W=5 fused" --json benchmarks/results/whole_step_all_steps.json
    python benchmarks/flash_rollout.py --report benchmarks/results/flash_rollout_digits.json   # the table again
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, whichever one the environment installed

# name -> (sampling overrides, jagg overrides); every setting names fused_rollout and jagg_frac
SETTINGS = {
    "exact": ({}, dict(jagg_frac=0.0, fused_rollout=False)),
    "exact, 2M tail n=3": (dict(ode_solver="dpmpp_2m", ode_steps=3), dict(jagg_frac=0.0, fused_rollout=False)),
    "exact, 2M tail n=2": (dict(ode_solver="dpmpp_2m", ode_steps=2), dict(jagg_frac=0.0, fused_rollout=False)),
    "W=4 fused": ({}, dict(window_size=4, jagg_frac=1.0, fused_rollout=True)),
    "W=4 fused, 2M tail n=3": (dict(ode_solver="dpmpp_2m", ode_steps=3),
                               dict(window_size=4, jagg_frac=1.0, fused_rollout=True)),
    "W=4 fused, 2M tail n=2": (dict(ode_solver="dpmpp_2m", ode_steps=2),
                               dict(window_size=4, jagg_frac=1.0, fused_rollout=True)),
    # the paper's regime (--config configs/digits_all_steps.yaml --only ...: every step trained, no tail): how much
    # of fused JAGG's saving is the fusion alone ("exact fused": the same gradient as exact, every step's graph kept)
    "exact fused": ({}, dict(jagg_frac=0.0, fused_rollout=True)),
    "W=5": ({}, dict(window_size=5, jagg_frac=1.0, fused_rollout=False)),
    "W=5 fused": ({}, dict(window_size=5, jagg_frac=1.0, fused_rollout=True)),
    # routing on W = 4 (time_to_quality.py's "W=4 fused, half routed"): one of the two full windows trained exactly
    "W=4 fused, half routed": ({}, dict(window_size=4, jagg_frac=0.5, fused_rollout=True)),
}


def child(args) -> None:
    import lightning as L
    import torch
    import yaml
    from lightning.pytorch.callbacks import Callback

    from jagg_lightning.data import PromptDataModule, read_prompts
    from jagg_lightning.testbed.evaluate import module_from_config

    torch.set_num_threads(1)
    sampling, jagg = SETTINGS[args.setting]
    cfg = yaml.safe_load(Path(args.config).read_text())
    cfg["model"]["sampling"] = dict(cfg["model"]["sampling"], **sampling)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    L.seed_everything(args.seed, verbose=False)
    module, _ = module_from_config(f.name, args.seed, **jagg)
    Path(f.name).unlink()
    spent = {"decode + reward": 0.0, "update": 0.0}
    calls = [0]

    def timed(obj, name, phase):
        inner = getattr(obj, name)

        def wrapper(*a, **kw):
            cpu = time.process_time()
            try:
                return inner(*a, **kw)
            finally:
                spent[phase] += time.process_time() - cpu

        setattr(obj, name, wrapper)

    timed(module.sampler, "decode_and_score", "decode + reward")
    timed(module.updater, "engine_pass", "update")
    velocity, rollout = module.sampler.velocity, module.sampler.rollout

    def counted(*a, **kw):
        calls[0] += 1
        return velocity(*a, **kw)

    def rollout_counted(*a, **kw):  # the rollout takes sampler.velocity when called: only its calls are counted
        module.sampler.velocity = counted
        try:
            return rollout(*a, **kw)
        finally:
            del module.sampler.velocity

    module.sampler.rollout = rollout_counted

    class StepTimer(Callback):
        def __init__(self):
            self.steps = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            for p in spent:
                spent[p] = 0.0
            calls[0] = 0
            self.cpu, self.wall = time.process_time(), time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics = trainer.callback_metrics
            self.steps.append(dict(
                cpu=time.process_time() - self.cpu, wall=time.perf_counter() - self.wall, phases=dict(spent),
                rollout_velocity_calls=calls[0], reward_mean=float(metrics["train/reward_mean"]),
                passes={k[len("train/passes/"):]: float(v) for k, v in metrics.items() if k.startswith("train/passes/")}))

    timer = StepTimer()
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    prompts = read_prompts(cfg["data"]["prompts_file"])
    batch = cfg["data"].get("batch_size", 16)
    trainer.fit(module, PromptDataModule(prompts=prompts[:batch], batch_size=batch, shuffle=False))
    print("RESULT " + json.dumps({"steps": timer.steps, "micro_batches": -(-batch * cfg["model"]["sampling"]["group_size"]
                                                                          // module.sampling.rollout_batch_size)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "configs" / "digits.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="training steps per process (the first is not timed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", help="only these settings (names as in the table)")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--report", type=Path, help="print the table of a saved JSON again (nothing is run)")
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setting:
        return child(args)
    if args.report:
        saved = json.loads(args.report.read_text())
        args.config, args.repeats, args.steps = saved["args"]["config"], int(saved["args"]["repeats"]), int(
            saved["args"]["steps"])
        return report(args, saved["results"])
    default = [n for n in SETTINGS if "tail" in n or n in ("exact", "W=4 fused")]  # the digits job's settings
    names = [n for n in SETTINGS if (n in args.only if args.only else n in default)]
    results = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            cmd = [sys.executable, __file__, "--setting", name, "--config", args.config, "--steps", str(args.steps),
                   "--seed", str(args.seed)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not line:
                raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
            results[name].append(json.loads(line[0][len("RESULT "):]))
            print(f"{name}: {[round(s['cpu'], 2) for s in results[name][-1]['steps']]} s CPU", flush=True)
    report(args, results)
    if args.json:
        import torch

        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
                                         "settings": {k: list(v) for k, v in SETTINGS.items()},
                                         "results": results}, indent=1) + "\n")


def report(args, results) -> None:
    def timed(runs):  # every timed step (the first of each process is the warm-up)
        return [s for r in runs for s in r["steps"][1:]]

    base = statistics.median(s["cpu"] for s in timed(results.get("exact", next(iter(results.values())))))
    base_min = min(s["cpu"] for s in timed(results.get("exact", next(iter(results.values())))))
    print(f"digits job ({Path(args.config).name}), 1 thread, {args.repeats} processes x {args.steps - 1} timed steps "
          "per setting")
    print("| setting | rollout evaluations | CPU s median | vs exact (today) | CPU s min | vs exact, min | decode + "
          "reward % | update % | backward | first-step reward |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        steps = timed(runs)
        med, low = statistics.median(s["cpu"] for s in steps), min(s["cpu"] for s in steps)
        share = {p: 100 * statistics.median(s["phases"][p] / s["cpu"] for s in steps) for p in steps[0]["phases"]}
        evaluations = steps[0]["rollout_velocity_calls"] / runs[0]["micro_batches"]
        first = statistics.mean(r["steps"][0]["reward_mean"] for r in runs)
        print(f"| {name} | {evaluations:.0f} | {med:.2f} | {med / base:.2f} | {low:.2f} | {low / base_min:.2f} | "
              f"{share['decode + reward']:.0f} | {share['update']:.0f} | {steps[0]['passes'].get('backward', 0):.0f} | "
              f"{first:.4f} |")


if __name__ == "__main__":
    main()
