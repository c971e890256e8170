"""Non-finite values never reach the weights (issue 31, item 3): a NaN or Inf injected at each stage of an update
-- the sampled latents, the reward, the advantages, a per-sample loss, the gradient -- skips that update (weights, optimizer state, EMA
and scheduler as they were; counted in ``train/skipped_nonfinite``), a later finite update trains, and
``grpo.max_nonfinite_in_a_row`` skipped in a row stop the run with one line naming the stage and samples."""

import copy
import random

import lightning as L
import pytest
import torch

from jagg_lightning import GRPOConfig
from jagg_lightning.data import PromptDataModule
from jagg_lightning.faults.nonfinite import NonFiniteError

from faults import PoisonedReward, StepCounter, poison_advantages, poison_gradient, poison_log_probs, poison_rollout
from helpers import MeanIntensity
from modules import make_module

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun", "a white boat", "a black car",
           "a pink cup", "a grey owl"]
K, PER_STEP = 3, 6  # group size, samples per step (2 prompts)
NAN, INF = float("nan"), float("inf")


class StateAfterEachStep(L.Callback):
    """Weights, optimizer state, EMA shadow, scheduler state and train/skipped_nonfinite after each training step."""

    def __init__(self):
        self.states = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        scheduler = module.lr_schedulers()
        self.states.append({
            "weights": [p.detach().clone() for p in module.policy.lora_parameters()],
            "optimizer": copy.deepcopy(module.optimizers().optimizer.state_dict()),
            "ema": copy.deepcopy(module.ema.state_dict()) if module.ema is not None else None,
            "scheduler": None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
            "skipped": float(trainer.callback_metrics["train/skipped_nonfinite"]),
            "global_step": trainer.global_step,
        })


def same(a, b) -> bool:
    """Nested tensors / containers equal exactly."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def module_for(seed, fused=False, **grpo):
    fused_settings = {"adv_std": "group"} if fused else {}  # a global std needs the whole rollout (check_fused)
    # a continuous reward: the loss case poisons each group's lowest-reward sample, which a tied group (JPEG sizes of
    # tiny images can tie) would skip with its zero advantage, so the poison would never reach a loss
    module = make_module(seed, rollout_batch_size=3, ema_decay=0.9, jagg={"fused_rollout": True} if fused else None,
                         reward=MeanIntensity(), **(fused_settings | grpo))
    module.lr_scheduler_factory = lambda optimizer: torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.5)
    return module


def inject(module, stage, faults, value, rng):
    """Put ``value`` at ``stage`` for the samples ``faults[step]``; returns {step: the samples a message names}."""
    if stage == "rollout":
        poison_rollout(module, faults, value)
    elif stage == "reward":
        module.reward_fn = PoisonedReward(module, faults, value)
    elif stage == "advantages":
        poison_advantages(module, faults, value)
    elif stage == "loss":  # -inf old log-prob: ratio inf, so the loss of a negative-advantage sample is +inf
        # the group's lowest reward: a sample whose advantage is exactly 0 gets no pass (skip_zero_advantage), so a
        # NaN there never reaches a loss (a reward can equal its group's mean)
        return poison_log_probs(module, faults, NAN if value != value else -INF, negative_advantage=True)
    else:
        poison_gradient(module, set(faults), value)
        return {step: list(range(PER_STEP)) for step in faults}  # a gradient names the update's samples
    return faults


def named(step, samples):
    """How the message names a step's samples: prompt (dataset index) and member of its group."""
    return ", ".join(f"prompt {2 * step + i // K} sample {i % K}" for i in sorted(set(samples))[:4])


def fit(module, steps, callbacks=()):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[StepCounter(), *callbacks])
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False))
    return trainer


CASES = [("rollout", NAN), ("reward", NAN), ("reward", INF), ("reward", -INF), ("advantages", NAN), ("advantages", INF),
         ("loss", NAN), ("loss", INF), ("gradient", NAN), ("gradient", INF)]


FUSED = [("rollout", INF), ("reward", NAN), ("advantages", INF), ("loss", INF), ("gradient", NAN)]
SKIP_CASES = [(s, v, False) for s, v in CASES] + [(s, v, True) for s, v in FUSED]
STOP_CASES = [("rollout", NAN), ("reward", NAN), ("advantages", INF), ("loss", INF), ("gradient", NAN)]


@pytest.mark.parametrize("stage,value,fused", SKIP_CASES,
                         ids=[f"{s}-{v}-{'fused' if f else 'unfused'}" for s, v, f in SKIP_CASES])
def test_a_nonfinite_update_is_skipped_and_the_next_one_trains(stage, value, fused, rng_seed):
    rng = random.Random(rng_seed)
    module = module_for(rng_seed % 10_000, fused)
    inject(module, stage, {1: rng.sample(range(PER_STEP), rng.randint(1, 2))}, value, rng)
    states = StateAfterEachStep()
    with pytest.warns(UserWarning, match=rf"update at step 1 skipped \(1 in a row, 1 in all.*{stage}"):
        trainer = fit(module, 3, [states])
    before, skipped, after = states.states
    for key in ("weights", "optimizer", "ema", "scheduler"):
        assert same(before[key], skipped[key]), key  # the skipped update moved nothing
    assert [s["skipped"] for s in states.states] == [0, 1, 1]
    assert not same(skipped["weights"], after["weights"])  # the next, finite update trains
    assert all(torch.isfinite(p).all() for p in module.policy.lora_parameters())
    assert [s["global_step"] for s in states.states] == [1, 2, 3]  # a skipped update still counts as a global step
    assert trainer.global_step == 3


@pytest.mark.parametrize("stage,value", STOP_CASES, ids=[f"{s}-{v}" for s, v in STOP_CASES])
def test_max_in_a_row_stops_the_run_naming_where_it_first_appeared(stage, value, rng_seed):
    rng = random.Random(rng_seed)
    module = module_for(rng_seed % 10_000, max_nonfinite_in_a_row=2)
    faults = {step: sorted(rng.sample(range(PER_STEP), rng.randint(1, 2))) for step in (1, 2)}
    names = inject(module, stage, faults, value, rng)
    states = StateAfterEachStep()
    with pytest.raises(NonFiniteError) as stop:
        fit(module, 5, [states])
    message = str(stop.value)
    assert "\n" not in message
    assert "2 update(s) in a row skipped" in message and "grpo.max_nonfinite_in_a_row: 2" in message
    assert f"the first, at step 1: " in message
    words = {"rollout": "non-finite sampled latents", "reward": "non-finite reward poisoned_reward", "advantages": "non-finite advantages",
             "loss": "non-finite per-sample loss", "gradient": "a non-finite gradient"}[stage]
    assert words in message
    if stage != "gradient":
        assert f"({'NaN' if value != value else 'Inf'})" in message
    assert named(1, names[1]) in message
    assert f"({len(set(names[1]))} sample" in message
    assert len(states.states) == 2  # step 2 raised: step 1's skipped update left step 0's state
    assert same(states.states[0]["weights"], [p.detach() for p in module.policy.lora_parameters()])


def test_updates_of_one_rollout_skip_only_where_the_value_is(rng_seed):
    """Two updates per rollout (train_batch_size 3 of 6): a non-finite loss skips the update holding that sample, the
    other trains; a non-finite reward under the global std spreads to every advantage, so both skip."""
    rng = random.Random(rng_seed)
    module = module_for(rng_seed % 10_000, train_batch_size=3, micro_batches_per_update=1)
    inject(module, "loss", {0: [rng.randrange(PER_STEP)]}, NAN, rng)
    states = StateAfterEachStep()
    initial = [p.detach().clone() for p in module.policy.lora_parameters()]
    fit(module, 2, [states])  # max_steps counts updates: one rollout of two
    (one,) = states.states
    assert one["skipped"] == 1 and one["global_step"] == 2
    assert not same(initial, one["weights"])  # the other update trained

    module = module_for(rng_seed % 10_000, train_batch_size=3, micro_batches_per_update=1)
    inject(module, "reward", {0: [rng.randrange(PER_STEP)]}, NAN, rng)
    states = StateAfterEachStep()
    initial = [p.detach().clone() for p in module.policy.lora_parameters()]
    with pytest.warns(UserWarning, match="2 in a row"):
        fit(module, 2, [states])
    assert states.states[0]["skipped"] == 2
    assert same(initial, states.states[0]["weights"])


def test_max_nonfinite_in_a_row_is_checked():
    for bad in (0, -1, 2.5, None):
        with pytest.raises(ValueError, match="grpo.max_nonfinite_in_a_row"):
            GRPOConfig(max_nonfinite_in_a_row=bad)
