"""How much of one step's gradient is signal, per method (issue 54, item 2: why GRPO does not climb where NFT does).

At fixed weights (the learning rate set to 1e-30, so theta and theta_old never move), ``--rollouts`` training steps
of one method on the SAME batch of prompts, each with its own rollout noise: K independent estimates g_1 .. g_K of the
method's gradient at the base, read before the optimizer sees them (``on_before_optimizer_step``). With g_k = s + n_k
(s the expected gradient, n_k zero-mean and independent), the mean cosine between two estimates is about
||s||^2 / E||g||^2, the share of a step's squared gradient that is signal: near 0 a step is noise and Adam's
normalised steps walk at random; and the norm of the mean of K estimates shrinks as 1 / sqrt(K) where there is no
signal. Reported per method: mean and range of the pairwise cosines, the signal share estimated as
(K ||mean g||^2 - mean ||g_k||^2) / ((K - 1) mean ||g_k||^2) (unbiased for ||s||^2 / E||g||^2), the gradient norms
and each step's ``train/*`` metrics (rewards, advantages).

    OMP_NUM_THREADS=1 python benchmarks/gradient_snr.py --methods exact nft --rollouts 4 --balance-tasks \\
        --name gradient_snr_scenes.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from league import METHODS, run_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class GradientTap(L.Callback):
    """Each step's LoRA gradient (flattened, float64) as the optimizer is about to see it, and the step's logged
    ``train/*`` metrics."""

    def __init__(self):
        self.gradients, self.metrics = [], []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        grads = [p.grad.detach().reshape(-1).double() for p in module.policy.lora_parameters() if p.grad is not None]
        self.gradients.append(torch.cat(grads) if grads else None)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()
                             if k.startswith("train/") and v.numel() == 1})


def signal_share(gradients: list[torch.Tensor]) -> float:
    """(K ||mean||^2 - mean ||g||^2) / ((K - 1) mean ||g||^2): E over the noise of K^2 ||mean||^2 is
    K^2 ||s||^2 + K E||n||^2, so this estimates ||s||^2 / E||g||^2 without bias."""
    k = len(gradients)
    mean_sq = sum(float(g.square().sum()) for g in gradients) / k
    mean = torch.stack(gradients).mean(0)
    return (k * float(mean.square().sum()) - mean_sq) / ((k - 1) * mean_sq)


def one_method(base: dict, name: str, seed: int, rollouts: int, prompts: list[str]) -> dict:
    from jagg_lightning.data import PromptDataModule
    from jagg_lightning.testbed.evaluate import module_from_config

    cfg = run_config(base, name)
    # theta (and NFT's theta_old) stay at the base: lr must be > 0, and Adam's steps of ~1e-30 are below float32's
    # resolution of any weight but LoRA B's zeros, which they leave 1e-30 off zero
    cfg["model"]["optimizer"]["init_args"]["lr"] = 1e-30
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    try:
        L.seed_everything(seed, verbose=False)
        module, _ = module_from_config(f.name, seed)
    finally:
        Path(f.name).unlink()
    tap = GradientTap()
    batch = len(prompts)  # one batch, the same prompts every step: only the rollout's noise differs
    data = PromptDataModule(prompts=prompts * rollouts, batch_size=batch, shuffle=False, seed=seed)
    trainer = L.Trainer(max_steps=rollouts, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[tap])
    started = time.process_time()
    trainer.fit(module, data)
    gradients = [g for g in tap.gradients if g is not None]
    cosines = [float(torch.nn.functional.cosine_similarity(a, b, dim=0))
               for a, b in itertools.combinations(gradients, 2)]
    return {"method": name, "seed": seed, "steps": len(gradients), "cpu_s": time.process_time() - started,
            "cosines": cosines, "cosine_mean": sum(cosines) / len(cosines), "signal_share": signal_share(gradients),
            "grad_norms": [float(g.norm()) for g in gradients], "metrics": tap.metrics}


def main(argv=None):
    from jagg_lightning.data import PromptDataModule, read_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "scenes.yaml"))
    p.add_argument("--methods", nargs="+", default=["exact", "nft"], choices=list(METHODS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollouts", type=int, default=4, help="independent gradient estimates per method (>= 2)")
    p.add_argument("--balance-tasks", action="store_true", help="draw the batch from the task-balanced rows")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="gradient_snr.json")
    args = p.parse_args(argv)
    if args.rollouts < 2:
        p.error("--rollouts must be >= 2 (cosines need two estimates)")
    torch.set_num_threads(1)
    base = yaml.safe_load(Path(args.config).read_text())
    rows = read_prompts(base["data"]["prompts_file"])
    if args.balance_tasks:  # as data.balance_tasks repeats them
        rows = PromptDataModule(prompts=rows, balance_tasks=True).prompts
    batch = base["data"].get("batch_size", 16)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [rows[i] for i in torch.randperm(len(rows), generator=generator)[:batch].tolist()]
    result = {"args": vars(args), "config": Path(args.config).name, "torch": torch.__version__, "runs": []}
    for name in args.methods:
        r = one_method(base, name, args.seed, args.rollouts, prompts)
        result["runs"].append(r)
        print(f"{name}: cosine {r['cosine_mean']:+.3f} ({min(r['cosines']):+.3f} .. {max(r['cosines']):+.3f}), "
              f"signal share {r['signal_share']:+.3f}, {r['cpu_s']:.0f} s CPU", flush=True)
        out = Path(args.out) / args.name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
