"""Flash-GRPO through the module (float64, one SGD step): each group trains its own drawn step (iso-temporal), and the
update equals the handwritten one -- per sample one forward and backward at its group's step, its policy term weighted
by Flash-GRPO's (1 / c_k) / mean (1 / c), the mean over all samples of their one trained step."""

import copy

import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.method.grpo import StepRecord, rectification_weights, step_loss
from jagg_lightning.training.rollout import group_steps
from jagg_lightning.utils.batching import batch_slice

from helpers import float64_reward, lora_grads, randomize_lora_b, rel_error, tiny_policy_config
from modules import PROMPTS, fit


@pytest.mark.slow
def test_flash_grpo_group_draw_step_equals_handwritten(rng_seed):
    seed, lr, group = rng_seed % 10_000, 0.5, 3
    sampling = SamplingConfig(num_steps=8, group_size=group, rollout_batch_size=6, sde_window_size=1,
                              sde_window_range=[0, 6], sde_window_draw="group")
    module = JAGGModule(tiny_policy_config(dtype="float64"), sampling,
                        GRPOConfig(train_batch_size=6, max_grad_norm=None, temporal_rectification=True,
                                   adv_std="group", skip_zero_advantage=False),
                        JAGGConfig(window_size=2, jagg_frac=0.0), optimizer=lambda p: torch.optim.SGD(p, lr=lr),
                        reward=float64_reward("float64"), seed=seed)
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    reference = copy.deepcopy(module)
    before = [p.detach().clone() for p in module.policy.lora_parameters()]
    prompts = PROMPTS[:2]
    fit(module, prompts=prompts)  # one training step
    # the step's draw: one step per prompt from (seed, step, prompt index), shared by the group
    steps = module.updater.row_steps
    assert steps.view(-1, group).eq(steps.view(-1, group)[:, :1]).all()
    batch = module.last_rollout
    # the dataset's item i has index i (PromptDataset): the draw of prompts 0 and 1 at step 0
    assert steps.tolist() == [k for k in group_steps(module.sampling, 0, [0, 1]) for _ in range(group)]
    update = [p.detach() - b for p, b in zip(module.policy.lora_parameters(), before)]

    # by hand, at theta_old: sample i at its own step only
    traj, cond, adv = batch.trajectory, batch.cond, batch.advantages
    times = traj.times.tolist()
    weights = rectification_weights(times, range(0, 6), range(0, 6), "sde", module.sampling.noise_level)
    policy = reference.policy
    policy.transformer.zero_grad(set_to_none=True)
    n = adv.shape[0]
    for i, k in enumerate(steps.tolist()):
        rows = slice(i, i + 1)
        v = policy.velocity(traj.latents[k, rows], traj.times[k].expand(1), batch_slice(cond, rows))
        rec = StepRecord(traj.latents[k, rows], traj.latents[k + 1, rows], times[k], times[k + 1],
                         traj.log_probs[k, rows], adv[rows], policy_weight=weights[k])
        (step_loss(v, rec)[0].sum() / n).backward()
    expected = [-lr * g for g in lora_grads(policy)]
    assert sum(float(u.abs().sum()) for u in expected) > 0
    assert rel_error(update, expected) < 1e-10
    # each sample's log-prob is non-zero at its own step only
    assert ((traj.log_probs != 0) == (torch.arange(8)[:, None] == steps[None, :])).all()
