"""JAGG over noise levels (docs/method.md §10) on the shipped digits model: how far the one-backward gradient of a
forward-process objective (AWM / DiffusionNFT, K levels of one eps per sample) is from its K-pass gradient, and what
each costs in process CPU time, measured side by side in one run (one thread).

    python benchmarks/objective_jagg.py --objective awm --levels 9 --samples 16 --repeats 3

Prints one JSON line per (objective, repeat): cosine and relative error of the JAGG gradient against the exact one,
and the CPU seconds of each (the rollout and the reward are shared, not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def gradient(updater, params, x0, eps, adv, cond, times, jagg: bool) -> tuple[torch.Tensor, float]:
    """The flat LoRA gradient of one update over the samples, and its process CPU seconds."""
    from jagg_lightning.training.update import StepReport

    updater.config.jagg = jagg
    total = [torch.zeros_like(p) for p in params]

    def collect(loss):
        for buf, g in zip(total, torch.autograd.grad(loss, params, allow_unused=True)):
            if g is not None:
                buf += g

    start = time.process_time()
    updater.backward_points(x0, eps, adv, cond, times, x0.shape[0], StepReport(cond), collect,
                            torch.arange(x0.shape[0]), None)
    return torch.cat([t.flatten().double() for t in total]), time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objective", choices=["awm", "nft"], default="awm")
    parser.add_argument("--levels", type=int, default=9)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=None, help="objective.jagg_window (default: all the levels)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("JAGG_NUM_THREADS", "1")))

    from jagg_lightning import JAGGModule, ObjectiveConfig, PolicyConfig, SamplingConfig
    from jagg_lightning.objectives.forward_process import noise_levels

    targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
               "attn.add_v_proj", "attn.to_add_out", "proj_out"]
    group = 4
    module = JAGGModule(PolicyConfig(pretrained="digits", lora_rank=8, lora_alpha=16, lora_targets=targets,
                                     guidance_scale=1.0, max_sequence_length=4),
                        SamplingConfig(num_steps=10, group_size=group, rollout_batch_size=args.samples),
                        reward="digits", seed=args.seed,
                        objective=ObjectiveConfig(name=args.objective, num_levels=args.levels, shared_noise=True,
                                                           jagg_window=args.window))
    module.configure_model()
    updater, sampler = module.updater, module.sampler
    params = list(module.policy.lora_parameters())
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():  # a LoRA away from its zero init, so both factors get gradients
        for p in params:
            p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    prompts = [f"a handwritten digit {d}" for d in range(args.samples // group)]
    traj, cond = sampler.trajectories(prompts, list(range(len(prompts))), 0, ["ode"] * 10)
    rewards, components = sampler.decode_and_score(module.reward_fn, traj.latents[-1],
                                                   [p for p in prompts for _ in range(group)])
    adv, _ = updater.reward_advantages(rewards, components, module.reward_fn)
    x0 = traj.latents[-1]
    updater.guard.start_rollout(list(range(len(prompts))), sampler.device)
    for repeat in range(args.repeats):
        eps = torch.randn(x0.shape[0], 1, *x0.shape[1:], generator=gen, dtype=x0.dtype)
        times = noise_levels("schedule", args.levels, sampler.times.cpu(), 1.0, gen)
        exact, exact_s = gradient(updater, params, x0, eps, adv, cond, times, False)
        jagg, jagg_s = gradient(updater, params, x0, eps, adv, cond, times, True)
        cosine = float(exact @ jagg / (exact.norm() * jagg.norm()))
        print(json.dumps({"objective": args.objective, "levels": args.levels, "window": args.window, "samples": args.samples,
                          "repeat": repeat, "cosine": round(cosine, 4),
                          "rel_error": round(float((jagg - exact).norm() / exact.norm()), 4),
                          "exact_cpu_s": round(exact_s, 2), "jagg_cpu_s": round(jagg_s, 2),
                          "cpu_ratio": round(jagg_s / exact_s, 3)}), flush=True)


if __name__ == "__main__":
    main()
