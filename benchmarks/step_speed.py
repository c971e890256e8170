"""Side-by-side cost of a GRPO update: exact (jagg_frac 0) vs JAGG, on the tiny SD3, in one run.

Times only the update phase (the JAGG window gradients over one rollout), which is what JAGG changes,
and the whole training step. Configurations run interleaved, repeated, and reported as ratios to
exact, next to the transformer pass counts the module logs. Not a test: run it by hand:

    python benchmarks/step_speed.py [--repeats 5] [--samples 16] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.method.jagg import accumulate_gradients
from jagg_lightning.policies import PolicyConfig

CONFIGS = {
    "exact": dict(jagg_frac=0.0),
    "jagg W=4 frac=0.5": dict(window_size=4, jagg_frac=0.5),
    "jagg W=4 frac=1": dict(window_size=4, jagg_frac=1.0),
    "jagg W=4 frac=1 chained": dict(window_size=4, jagg_frac=1.0, chained=True),
    "jagg W=4 frac=1 no cache": dict(window_size=4, jagg_frac=1.0, cache_interior=False),
    "jagg W=8 frac=1": dict(window_size=8, jagg_frac=1.0),
}


def build(jagg: dict, args) -> JAGGModule:
    module = JAGGModule(
        PolicyConfig(lora_rank=8, lora_alpha=16, guidance_scale=args.guidance, max_sequence_length=8),
        SamplingConfig(num_steps=args.steps + 1, group_size=args.samples // 2, rollout_batch_size=args.samples),
        GRPOConfig(train_batch_size=args.samples),
        JAGGConfig(**({"window_size": 4} | jagg)),
    )
    module.configure_model()
    return module


def update_once(module: JAGGModule, rollout) -> tuple[float, dict]:
    traj, cond, _, rewards, _ = rollout
    adv = module.updater.advantages(rewards)
    module.updater.route(traj, module.windows)
    loss_of_step = module.updater.step_loss_fn(traj, adv, None, 1.0 / len(module.trained_steps), [])
    cache = traj.velocities if module.jagg.cache_interior else None  # theta = theta_old: first update
    start = time.perf_counter()
    records = accumulate_gradients(module.sampler.velocity, traj.latents, traj.times, cond, loss_of_step,
                                   module.windows, cache, module.memory.anchors == "split")
    elapsed = time.perf_counter() - start
    module.policy.transformer.zero_grad(set_to_none=True)
    counts = {k: sum(getattr(r, k) for r in records) for k in ("backwards", "grad_forwards", "nograd_forwards")}
    return elapsed, counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16, help="trained steps (sampling steps - 1)")
    parser.add_argument("--guidance", type=float, default=1.0)
    args = parser.parse_args()
    modules = {name: build(cfg, args) for name, cfg in CONFIGS.items()}
    reference = next(iter(modules.values()))
    rollout = reference.sampler.rollout_and_score(["a cat", "a dog"], [0, 1], step=0, reward=reference.reward_fn)  # one shared rollout
    times = {name: [] for name in modules}
    counts = {}
    for _ in range(args.repeats):
        for name, module in modules.items():  # interleaved, so drift hits every configuration alike
            elapsed, counts[name] = update_once(module, rollout)
            times[name].append(elapsed)
    base = statistics.median(times["exact"])
    print(f"{args.samples} samples, {args.steps} trained steps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'configuration':28s} {'update s':>9s} {'vs exact':>9s} {'backward':>9s} {'grad fwd':>9s} {'nograd fwd':>10s}")
    for name in modules:
        t = statistics.median(times[name])
        c = counts[name]
        print(f"{name:28s} {t:9.3f} {t / base:9.2f} {c['backwards']:9d} {c['grad_forwards']:9d} {c['nograd_forwards']:10d}")


if __name__ == "__main__":
    main()
