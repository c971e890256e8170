"""Fault injection for the non-finite guard's tests: a NaN or Inf put into one stage of chosen steps' updates.

Each injector wraps a real part's output (the reward's scores, the advantages, the recorded log-probs a loss is
made of) or hooks a real gradient; nothing is mocked away. Samples are numbered within a step's rollout
(prompt-major: sample i is prompt i // K, member i % K)."""

from __future__ import annotations

import lightning as L
import torch

from jagg_lightning.rewards import Reward


class StepCounter(L.Callback):
    """``module.fault_step``: the training step (rollout) running now, for injectors that act at chosen steps."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        module.fault_step = module.rollouts_done


class PoisonedReward(Reward):
    """The module's reward, with ``value`` for the samples ``faults[step]`` of chosen steps (scored in order)."""

    name = "poisoned_reward"

    def __init__(self, module, faults: dict[int, list[int]], value: float):
        super().__init__()
        self.base, self.faults, self.value = module.reward_fn, faults, value
        self.step_of = lambda: module.fault_step  # not a submodule: the module holds this reward
        self.seen = {}  # step -> samples scored so far

    def score(self, images, prompts):
        step = self.step_of()
        out = self.base(images, prompts).clone()
        start = self.seen.get(step, 0)
        for j in range(len(out)):
            if start + j in self.faults.get(step, ()):
                out[j] = self.value
        self.seen[step] = start + len(out)
        return out


def poison_advantages(module, faults: dict[int, list[int]], value: float) -> None:
    """The advantages of the samples ``faults[step]`` become ``value`` (the real advantages otherwise)."""
    real = module.updater.reward_advantages

    def reward_advantages(rewards, components, reward, collectives=None):
        advantages, parts = real(rewards, components, reward, collectives)
        rows = _rows_of_call(module, rewards.shape[0], "advantages")
        for i in faults.get(module.fault_step, ()):
            if i in rows:
                advantages = advantages.clone()
                advantages[rows.index(i)] = value
        return advantages, parts

    module.updater.reward_advantages = reward_advantages


def _rows_of_call(module, n: int, key: str) -> list[int]:
    """The step's rollout rows a call over ``n`` samples covers (the calls of a step come in row order)."""
    seen = module.__dict__.setdefault("fault_rows", {})
    step_seen = seen.setdefault((key, module.fault_step), 0)
    seen[(key, module.fault_step)] = step_seen + n
    return list(range(step_seen, step_seen + n))


def poison_log_probs(module, faults: dict[int, list[int]], value: float, negative_advantage: bool = False) -> dict:
    """The recorded log-prob, at the first trained step, of the samples ``faults[step]`` becomes ``value`` once
    they are scored (the loss recomputes the ratio against it). ``negative_advantage``: instead the sample with the
    lowest reward of each group listed (its advantage is negative: with value -inf its loss is +inf). Returns
    {step: the rows poisoned}."""
    real, poisoned = module.sampler.scored, {}

    def scored(micro_batches, reward, prompts, ahead=None):
        for mb in real(micro_batches, reward, prompts, ahead):
            step, k = module.fault_step, module.plan.trained_steps[0]
            for i in faults.get(step, ()):
                if mb.rows.start <= i < mb.rows.stop:
                    row = i
                    if negative_advantage:
                        K = module.sampling.group_size
                        group = slice(i - i % K - mb.rows.start, i - i % K - mb.rows.start + K)
                        row = i - i % K + int(mb.rewards[group].argmin())
                    mb.sampled.trajectory.log_probs[k, row] = value
                    poisoned.setdefault(step, []).append(row)
            yield mb

    module.sampler.scored = scored
    return poisoned


def poison_gradient(module, steps: set[int], value: float) -> None:
    """Every backward of the chosen steps puts ``value`` into the gradient of the first trainable weight."""
    param = module.policy.lora_parameters()[0]
    param.register_hook(lambda g: torch.full_like(g, value) if module.fault_step in steps else g)


def poison_rollout(module, faults: dict[int, list[int]], value: float) -> None:
    """The final sampled latents of the samples ``faults[step]`` get ``value`` at one element, as each micro-batch
    ends (before it is decoded and scored): what a bf16 overflow while sampling leaves."""
    real = module.sampler.rollout

    def rollout(*args, **kwargs):
        for mb in real(*args, **kwargs):
            for i in faults.get(module.fault_step, ()):
                if mb.rows.start <= i < mb.rows.stop:
                    mb.final[i - mb.rows.start].view(-1)[0] = value
            yield mb

    module.sampler.rollout = rollout
