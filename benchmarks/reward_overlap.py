"""Scoring that overlaps sampling: one training step with a slow served reward, sequential vs overlapped.

A real reward (Flow-GRPO's OCR reward, PP-OCR under onnxruntime) is served from a second process by
``jagg serve-reward``; the training process scores through ``RemoteReward`` either after each rollout
micro-batch in the training thread (``reward_workers: 0``) or in the reward pool while the next
micro-batch samples (``reward_workers: 2``). Each repeat runs both, interleaved, on the same rollout
(same seed, same step): rollout + decode + score, advantages and the unfused update. Reported: median wall
and process CPU time (of the training process) per step, the reward's own wall time in the sequential step
(time spent waiting for scores), and the hidden share = (sequential - overlapped) / reward time.

    python benchmarks/reward_overlap.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers import randomize_lora_b, tiny_policy_config  # noqa: E402

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig# noqa: E402
from jagg_lightning.rewards import RemoteReward  # noqa: E402
from jagg_lightning.training.rollout import plan_rollout  # noqa: E402
from jagg_lightning.training.update import UpdateHooks  # noqa: E402

PROMPTS = ['a sign that says "open late"', 'a poster with the word "jagg"', 'a mug printed "hello"',
           'a banner reading "sale"']


def serve() -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "jagg_lightning", "serve-reward", "--reward", "ocr",
                               "--init_args", '{"threads": 1}', "--host", "127.0.0.1", "--port", "0"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = server.stdout.readline()
    if " on http://" not in line:
        server.kill()
        raise SystemExit(f"the OCR server did not start: {line!r}")
    return server, line.split(" on ")[-1].strip()


def build(url: str, workers: int, args) -> JAGGModule:
    module = JAGGModule(
        tiny_policy_config(seed=0, resolution=args.resolution),
        SamplingConfig(num_steps=args.steps, group_size=args.group_size, rollout_batch_size=args.rollout_batch_size),
        GRPOConfig(train_batch_size=args.rollout_batch_size, adv_std="group"),
        JAGGConfig(window_size=2, jagg_frac=1.0),
        reward=RemoteReward(url, name="ocr", timeout=300), reward_workers=workers,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(0))
    return module


def step(module: JAGGModule, reward_clock: list[float]) -> tuple[float, float]:
    """One rollout + score + advantages + update (the optimizer step left out: the weights stay, every repeat
    sees the same rollout); returns (wall s, process CPU s)."""
    prompts, indices = PROMPTS[: module.bench_prompts], list(range(module.bench_prompts))
    plan = plan_rollout(module.sampling, module.jagg, 0)
    wall, cpu = time.perf_counter(), time.process_time()
    traj = module.updater.step(prompts, indices, 0, plan, module.reward_fn, UpdateHooks()).trajectory
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    for p in module.policy.lora_parameters():
        p.grad = None
    if reward_clock is not None:  # the reward alone, on this rollout's images, one micro-batch at a time
        t = time.perf_counter()
        size = module.sampling.rollout_batch_size
        for i in range(0, traj.latents.shape[1], size):
            part = [p for p in prompts for _ in range(module.sampling.group_size)][i : i + size]
            module.sampler.decode_and_score(module.reward_fn, traj.latents[-1, i : i + size], part)
        reward_clock.append(time.perf_counter() - t)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--rollout-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "reward_overlap.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    server, url = serve()
    try:
        modules = {w: build(url, w, args) for w in (0, 2)}
        for m in modules.values():
            m.bench_prompts = args.prompts
        times = {0: [], 2: []}
        reward_clock: list[float] = []
        step(modules[0], None), step(modules[2], None)  # warm-up (first forwards, the server's first request)
        for _ in range(args.repeats):
            for w in (0, 2):
                times[w].append(step(modules[w], reward_clock if w == 0 else None))
        modules[2].sampler.close()
    finally:
        server.kill()
        server.wait()
    wall = {w: statistics.median(t[0] for t in times[w]) for w in times}
    cpu = {w: statistics.median(t[1] for t in times[w]) for w in times}
    reward = statistics.median(reward_clock)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
              "wall_s": wall, "cpu_s": cpu, "reward_wall_s": reward,
              "hidden_share": (wall[0] - wall[2]) / reward, "ratio_wall": wall[2] / wall[0], "raw": times}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("| reward_workers | wall s (median) | CPU s (median) | wall vs sequential |")
    print("|---|---|---|---|")
    for w in (0, 2):
        print(f"| {w} | {wall[w]:.3f} | {cpu[w]:.3f} | {wall[w] / wall[0]:.2f} |")
    print(f"reward (decode + served OCR, sequential): {reward:.3f} s wall per step; hidden share "
          f"{result['hidden_share']:.0%}")


if __name__ == "__main__":
    main()
