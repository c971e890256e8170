"""How much does ``jagg.interpolate_reference`` (the KL reference interpolated inside routed windows) cost in
accuracy? Measured on the pretrained digits test bed (docs/testbed.md), 3 seeds.

Per seed: a short fine-tune of configs/digits_fidelity.yaml (all 9 SDE steps trained) with kl_beta 0.04 (so theta has moved away from the
reference), then a fresh rollout with every reference velocity taken, W = 4 windows all routed, and

* the error of the interpolated reference at interior steps, relative to the reference itself and
  to v_theta - v_ref (what the KL gradient is made of);
* the update gradient (JAGG, beta 0.04) with interpolated vs taken references: cosine and relative error,
  of the whole gradient and of its KL part alone (the gradient with the policy term removed);
* the reference forwards each makes.

    python benchmarks/kl_reference.py [--seeds 0 1 2] [--train-steps 10]
"""

from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def update_gradient(module, traj, cond, advantages, ref, policy_term: bool = True) -> torch.Tensor:
    """The first-update JAGG gradient over the whole rollout, flattened (weights and .grad untouched)."""
    from jagg_lightning.method.jagg import flat_gradient

    adv = advantages if policy_term else torch.zeros_like(advantages)
    mb = copy.copy(traj)
    mb.ref_velocities = ref
    loss = module.updater.step_loss_fn(mb, adv, ref, 1.0 / len(module.plan.trained_steps), [])
    return flat_gradient(module.policy.velocity, module.policy.lora_parameters(), traj.latents, traj.times, cond, loss,
                         module.plan.windows, cached_velocities=traj.velocities)


def measure(seed: int, train_steps: int) -> dict:
    import lightning as L

    from jagg_lightning.data import PromptDataModule, read_prompts
    from jagg_lightning.method.jagg import gradient_agreement
    from jagg_lightning.testbed.evaluate import module_from_config
    from jagg_lightning.training.passes import pass_steps_before_routing
    from jagg_lightning.training.rollout import plan_rollout

    torch.manual_seed(seed)
    module, _ = module_from_config(ROOT / "configs/digits_fidelity.yaml", seed=seed, window_size=4, jagg_frac=1.0)
    module.grpo.kl_beta = 0.04
    prompts = read_prompts(ROOT / "configs/prompts/digits.txt")
    trainer = L.Trainer(max_steps=train_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=prompts, batch_size=4, seed=seed))

    batch = [prompts[(7 * seed + i) % len(prompts)] for i in range(4)]
    with torch.no_grad():  # the sampler holds the training guidance
        plan = module.plan = plan_rollout(module.sampling, module.jagg, 10_000 + seed)
        module.windows = plan.windows
        traj, cond, _, rewards, _ = module.sampler.rollout_and_score(batch, list(range(4)), 10_000 + seed,
                                                                     plan.step_kinds, plan.trained_steps,
                                                                     reward=module.reward_fn)
        advantages = module.updater.advantages(rewards)
        module.updater.route(traj, plan.windows)
        exact_ref = traj.ref_velocities
        interp = copy.copy(traj)
        taken = pass_steps_before_routing(plan.windows, module.jagg, interiors=False)
        interp.ref_velocities = torch.where(
            torch.tensor([k in taken for k in range(exact_ref.shape[0])]).view(-1, *[1] * (exact_ref.ndim - 1)),
            exact_ref, torch.zeros_like(exact_ref))
        module.updater.complete_reference(interp, cond, plan.windows, taken)
    interior = sorted({k for w in plan.windows if w.routed for k in w.interior})
    diff = (interp.ref_velocities - exact_ref)[interior].flatten(2).norm(dim=-1)
    rel_ref = float((diff / exact_ref[interior].flatten(2).norm(dim=-1)).mean())
    rel_kl = float((diff / (traj.velocities - exact_ref)[interior].flatten(2).norm(dim=-1)).mean())
    g_exact = update_gradient(module, traj, cond, advantages, exact_ref)
    g_interp = update_gradient(module, traj, cond, advantages, interp.ref_velocities)
    kl_exact = update_gradient(module, traj, cond, advantages, exact_ref, policy_term=False)
    kl_interp = update_gradient(module, traj, cond, advantages, interp.ref_velocities, policy_term=False)
    cos, err = gradient_agreement(g_interp, g_exact)
    kl_cos, kl_err = gradient_agreement(kl_interp, kl_exact)
    return dict(seed=seed, interior_steps=len(interior), trained_steps=len(plan.trained_steps), ref_rel=rel_ref,
                ref_rel_to_kl_offset=rel_kl, grad_cosine=cos, grad_rel_error=err, kl_grad_cosine=kl_cos,
                kl_grad_rel_error=kl_err, kl_share=float(kl_exact.norm() / g_exact.norm()),
                reference_forwards=f"{len(taken)} of {len(plan.trained_steps)} steps")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(seed, args.train_steps) for seed in args.seeds]
    keys = [k for k in rows[0] if k != "seed"]
    print("| seed | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for r in rows:
        print(f"| {r['seed']} | " + " | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys)
              + " |")
    for k in ("ref_rel", "ref_rel_to_kl_offset", "grad_cosine", "grad_rel_error", "kl_grad_cosine", "kl_grad_rel_error"):
        print(f"mean {k}: {statistics.mean(r[k] for r in rows):.4g}")


if __name__ == "__main__":
    main()
