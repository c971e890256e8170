"""Dropping the module into an existing Lightning project (docs/drop_in.md): a plain callable reward, a DataLoader of
plain prompt strings (indexed by the documented rule), TensorBoard and ModelCheckpoint -- the documented snippet run
as written."""

import hashlib
import re
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.data import prompt_index, unpack_prompt_batch
from jagg_lightning.rewards import CallableReward
from jagg_lightning.rewards.base import RewardError

from helpers import tiny_policy_config

ROOT = Path(__file__).resolve().parents[2]


def test_plain_prompt_strings_take_the_documented_index():
    # the rule as docs/drop_in.md states it, computed here independently
    expected = int.from_bytes(hashlib.sha256("a cat".encode("utf-8")).digest()[:4], "little") >> 1
    assert prompt_index("a cat") == expected and 0 <= expected < 2**31
    assert prompt_index("a dog") != expected and prompt_index("a cat ") != expected  # the exact text
    cat, dog = prompt_index("a cat"), prompt_index("a dog")
    assert unpack_prompt_batch(["a cat", "a dog"]) == (["a cat", "a dog"], [cat, dog])
    assert unpack_prompt_batch(("a dog", "a cat")) == (["a dog", "a cat"], [dog, cat])  # follows the prompt
    assert unpack_prompt_batch("a cat") == (["a cat"], [cat])
    assert unpack_prompt_batch({"prompt": ["a dog"]}) == (["a dog"], [dog])
    assert unpack_prompt_batch({"prompt": ["a dog"], "index": [7]}) == (["a dog"], [7])  # given indices are kept
    [batch] = DataLoader(["a cat", "a dog"], batch_size=2)  # what a default-collated loader of strings yields
    assert unpack_prompt_batch(batch) == (["a cat", "a dog"], [cat, dog])
    for bad in ([1, 2], torch.tensor([1, 2]), {"prompt": [1]}, [], None):
        with pytest.raises(TypeError, match="prompt"):
            unpack_prompt_batch(bad)


def brightness(images, prompts):
    return images.mean(dim=(1, 2, 3))


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.dropout = nn.Linear(3, 1), nn.Dropout(0.5)

    def forward(self, images, prompts):
        return self.linear(self.dropout(images.mean(dim=(2, 3)))).squeeze(1)


def small_module(reward, seed=0) -> JAGGModule:
    return JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=4),
                      GRPOConfig(train_batch_size=4), JAGGConfig(window_size=2), reward=reward, seed=seed)


def test_a_plain_callable_reward_is_wrapped_named_and_frozen():
    images, prompts = torch.rand(3, 3, 8, 8), ["a", "b", "c"]
    module = small_module(brightness)  # __init__ only validates: no model is built
    reward = module.reward_fn
    assert isinstance(reward, CallableReward) and reward.name == "brightness"
    assert torch.equal(reward(images, prompts), images.mean(dim=(1, 2, 3)))
    assert "not_rebuildable" in module.hparams["reward"]  # a function is not plain data: pass reward= again
    assert small_module(lambda images, prompts: [0.5] * len(prompts)).reward_fn.name == "lambda"
    assert torch.equal(small_module(lambda i, p: [0.5] * len(p)).reward_fn(images, prompts), torch.full((3,), 0.5))

    scorer = Scorer()
    module = small_module(scorer)
    wrapped = module.reward_fn
    assert wrapped.name == "Scorer" and wrapped.fn is scorer
    assert not any(p.requires_grad for p in scorer.parameters()) and not scorer.training
    module.train()  # the Trainer's train(): the reward stays in eval mode (dropout off: scores repeat)
    assert not scorer.training and torch.equal(wrapped(images, prompts), wrapped(images, prompts))
    assert not any(n.startswith("reward_fn") for n, p in module.named_parameters() if p.requires_grad)

    with pytest.raises(RuntimeError, match="reward brightness: returned 2 scores for 3 images"):
        CallableReward(lambda i, p: torch.zeros(2), name="brightness")(images, prompts)
    with pytest.raises(RewardError, match=r"reward lambda \(CallableReward\) failed: KeyError"):
        CallableReward(lambda i, p: {}["x"])(images, prompts)
    with pytest.raises(ValueError, match="reward must be one of"):
        small_module("brightness")  # a name is still looked up in the registry


@pytest.mark.slow
def test_a_plain_prompt_draws_the_same_noise_wherever_the_loader_puts_it(rng_seed):
    """One training step on the same two prompts in both orders: each prompt's samples start from the same noise."""
    seed, prompts = rng_seed % 10_000, ["a red cat", "a blue dog"]

    def first_noise(order):
        module = small_module(brightness, seed)
        L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(module, DataLoader(order, batch_size=2))
        noise = module.last_rollout.trajectory.latents[0]  # [prompts x group, ...], prompt-major
        return dict(zip(order, noise.chunk(2)))

    forward, backward = first_noise(prompts), first_noise(prompts[::-1])
    for prompt in prompts:
        assert torch.equal(forward[prompt], backward[prompt]), prompt
    assert not torch.equal(forward[prompts[0]], forward[prompts[1]])


@pytest.mark.slow
def test_the_documented_drop_in_snippet_runs_as_written(tmp_path, monkeypatch):
    """docs/drop_in.md's block, as written (20 steps of 8 samples on the digits model, ~11 s of CPU): a checkpoint at
    the steps ModelCheckpoint(every_n_train_steps=10) names -- 10 and 20, each after that step's update -- and no
    Lightning warning about a "pre-optimization state" (issue 44: the module says what a step counts instead)."""
    import warnings

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [snippet] = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "drop_in.md").read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "__main__"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(snippet, "docs/drop_in.md", "exec"), scope)
    assert not [w for w in caught if "pre-optimization" in str(w.message)], [str(w.message)[:200] for w in caught]
    trainer, module = scope["trainer"], scope["module"]
    assert trainer.global_step == 20 and module.rollouts_done == 20 and module.reward_fn.name == "brightness"
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert checkpoints == ["epoch=4-step=10.ckpt", "epoch=9-step=20.ckpt"], checkpoints
    saved = torch.load(tmp_path / "checkpoints" / "epoch=4-step=10.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 10
    events = EventAccumulator(str(tmp_path / "logs" / "lightning_logs" / "version_0")).Reload()
    rewards = [e.value for e in events.Scalars("train/reward/brightness")]
    assert len(rewards) == 20 and all(0.0 <= r <= 1.0 for r in rewards)
    assert np.allclose(rewards, [e.value for e in events.Scalars("train/reward_mean")])
    # the checkpoint resumes with the function given again (it is not recorded)
    again = JAGGModule.load_from_checkpoint(tmp_path / "checkpoints" / "epoch=9-step=20.ckpt", reward=scope["brightness"])
    assert again.reward_fn.name == "brightness"
