"""How long `jagg fit` takes from a stop signal to its exit, and whether each stop resumes to the uninterrupted run.

Runs `jagg fit --config configs/tiny.yaml` (shortened) once uninterrupted, then ``--tries`` times with SIGTERM sent
from outside at a random moment of training, each stopped run resumed with ``--ckpt_path``; reports per try the
signal's delay, the safe point it stopped at, the seconds from the signal to the process's exit, the exit status, and
whether the resumed run's final adapter equals the uninterrupted one bit for bit. Raw rows go to --out (JSON).

    python benchmarks/preemption.py --tries 5 --out benchmarks/results/preemption.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--trainer.max_steps", "12", "--trainer.callbacks", "[]", "--trainer.logger", "false",
         "--trainer.enable_progress_bar", "false"]


def command(root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jagg_lightning", "fit", "--config", str(ROOT / "configs/tiny.yaml"), *SHORT,
            "--trainer.default_root_dir", str(root), "--lora_export.dirpath", str(root / "lora"), *extra]


def adapter(root: Path) -> dict:
    return {(f.name, k): v for f in sorted((root / "lora/final").glob("**/*.safetensors")) for k, v in load_file(f).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        started = time.monotonic()
        subprocess.run(command(tmp / "full"), env=env, check=True, capture_output=True)
        full_s = time.monotonic() - started
        reference = adapter(tmp / "full")
        for i in range(args.tries):
            root = tmp / f"try{i}"
            process = subprocess.Popen(command(root), env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                       text=True)
            delay = random.uniform(0.5, 0.9) * full_s
            time.sleep(delay)
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=600)
            exit_s = time.monotonic() - sent
            stop_line = next((line for line in err.splitlines() if "stopped by" in line), "")
            row = {"delay_s": round(delay, 2), "exit_status": process.returncode, "signal_to_exit_s": round(exit_s, 2),
                   "stopped_at": stop_line.split("(", 1)[-1].split("):")[0] if stop_line else None}
            ckpt = root / "checkpoints/preempted.ckpt"
            if ckpt.is_file():
                subprocess.run(command(root, "--ckpt_path", str(ckpt)), env=env, check=True, capture_output=True)
                resumed = adapter(root)
                row["resumed_bit_for_bit"] = resumed.keys() == reference.keys() and all(
                    torch.equal(resumed[k], reference[k]) for k in reference)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {"uninterrupted_run_s": round(full_s, 1), "tries": rows,
               "max_signal_to_exit_s": max(r["signal_to_exit_s"] for r in rows)}
    print(json.dumps({k: v for k, v in summary.items() if k != "tries"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
