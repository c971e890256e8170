"""docs/method.md section 11's cost model checked against ``time/<phase>`` (issue 58): a few of the league's methods, a
few training steps each on the digits job of the league (``configs/digits_all_steps.yaml``, one thread), every step's
wall seconds per phase from ``StepTimes``, against the passes the model counts (``league.COST``: R rollout forwards, G
update forwards with grad, N no-grad, P one-step backwards per sample and step).

Per method, over the steps after the first (the first pays one-time costs, and NFT's theta_old forward starts at the
second): F = time/rollout / R, one rollout forward of the step's samples (the rollout's SDE math and bookkeeping
included, which the model folds into F); the model then predicts time/update/forward = (G + N)·F and
time/update/backward = P·b·F with the CPU's b = B / F = 1.2 (docs/method.md section 5), and D = decode + reward +
optimizer + other (what no pass is) is measured. Reported: each phase's measured share of the step against the
model's, the measured b and update-forward cost per F, and the step time against exact's next to the model's ratio of
passes (the league's fitted D = 4.6 F).

    OMP_NUM_THREADS=1 python benchmarks/cost_model.py --methods exact jagg_w5_fused flash_tail nft --steps 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from league import B_OVER_F, COST, METHODS, run_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
D_FITTED = 4.6  # the league's least-squares D in F (benchmarks/results/league_summary.md)
GROUPS = {"rollout": ("rollout",), "update/forward": ("update/forward",), "update/backward": ("update/backward",),
          "D (decode, reward, optimizer, other)": ("decode", "reward", "optimizer", "collectives", "other")}


class PerStep(L.Callback):
    """Every step's ``time/*`` as StepTimes logged them (it runs first: each batch start flushes the step before)."""

    def __init__(self, timer):
        self.timer, self.steps = timer, []

    def _take(self):
        if self.timer.last and (not self.steps or self.timer.last is not self.steps[-1]):
            self.steps.append(self.timer.last)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._take()

    def on_train_end(self, trainer, pl_module):
        self._take()


def measure(base: dict, name: str, steps: int, seed: int, prompts) -> list[dict]:
    from jagg_lightning.callbacks import StepTimes
    from jagg_lightning.data import PromptDataModule
    from jagg_lightning.testbed.evaluate import module_from_config

    cfg = run_config(base, name)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    L.seed_everything(seed, verbose=False)
    try:
        module, _ = module_from_config(f.name, seed)
    finally:
        Path(f.name).unlink()
    timer = StepTimes()
    record = PerStep(timer)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, record])
    trainer.fit(module, PromptDataModule(prompts=prompts, batch_size=cfg["data"].get("batch_size", 16), seed=seed))
    return [{k[5:]: v for k, v in s.items() if k.startswith("time/")} for s in record.steps]


def analyse(name: str, steps: list[dict]) -> dict:
    R, G, N, P = COST[name]
    kept = steps[1:] or steps
    mean = {k: statistics.fmean(s[k] for s in kept) for k in kept[0]}
    measured = {g: sum(mean.get(p, 0.0) for p in parts) for g, parts in GROUPS.items()}
    step = sum(measured.values())
    F = measured["rollout"] / R
    predicted = {"rollout": R * F, "update/forward": (G + N) * F, "update/backward": P * B_OVER_F * F,
                 "D (decode, reward, optimizer, other)": measured["D (decode, reward, optimizer, other)"]}
    predicted_step = sum(predicted.values())
    return {
        "method": name, "what": METHODS[name]["what"], "passes": {"R": R, "G": G, "N": N, "P": P},
        "steps_measured": len(kept), "seconds_per_step": step, "phase_seconds": mean,
        "F_seconds": F, "measured_b": measured["update/backward"] / (P * F) if P else None,
        "update_forward_per_F": measured["update/forward"] / ((G + N) * F) if G + N else None,
        "D_in_F": measured["D (decode, reward, optimizer, other)"] / F,
        "measured_share": {g: v / step for g, v in measured.items()},
        "predicted_share": {g: v / predicted_step for g, v in predicted.items()},
        "predicted_step_over_measured": predicted_step / step,
        "passes_in_F": R + G + N + B_OVER_F * P,
    }


def table(rows: list[dict]) -> str:
    exact = next((r for r in rows if r["method"] == "exact"), None)
    head = ("| method | R / G+N / P | s per step | F (s) | b measured | update fwd per F | D in F | shares measured "
            "(predicted): rollout · update fwd · update bwd · D | step vs exact (passes + D 4.6 F) |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        shares = " · ".join(f"{100 * r['measured_share'][g]:.0f} ({100 * r['predicted_share'][g]:.0f})" for g in GROUPS)
        versus = "–"
        if exact is not None:
            model = (r["passes_in_F"] + D_FITTED) / (exact["passes_in_F"] + D_FITTED)
            versus = f"{r['seconds_per_step'] / exact['seconds_per_step']:.2f} ({model:.2f})"
        b = "–" if r["measured_b"] is None else f"{r['measured_b']:.2f}"
        u = "–" if r["update_forward_per_F"] is None else f"{r['update_forward_per_F']:.2f}"
        p = r["passes"]
        lines.append(f"| {r['method']} | {p['R']} / {p['G'] + p['N']} / {p['P']} | {r['seconds_per_step']:.2f} | "
                     f"{r['F_seconds']:.3f} | {b} | {u} | {r['D_in_F']:.1f} | {shares} | {versus} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/digits_all_steps.yaml"))
    parser.add_argument("--methods", nargs="+", default=["exact", "jagg_w5_fused", "flash_tail", "nft"],
                        choices=sorted(COST))
    parser.add_argument("--steps", type=int, default=4, help="training steps per method (the first is not counted)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/cost_model.json"))
    args = parser.parse_args(argv)
    from jagg_lightning.data import read_prompts

    torch.set_num_threads(1)
    base = yaml.safe_load(Path(args.config).read_text())
    prompts = read_prompts(base["data"]["prompts_file"])
    rows = []
    for name in args.methods:
        t0 = time.time()
        rows.append(analyse(name, measure(base, name, args.steps, args.seed, prompts)))
        print(f"{name}: {rows[-1]['seconds_per_step']:.2f} s per step ({time.time() - t0:.0f} s)", file=sys.stderr)
    result = {"config": Path(args.config).name, "steps": args.steps, "seed": args.seed, "b_assumed": B_OVER_F,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "methods": rows, "table": table(rows)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
