"""Resume from every checkpoint Lightning writes continues exactly as the uninterrupted run (issue 18): the default
epoch-end ModelCheckpoint, a step-based one (mid-epoch), `last.ckpt` and OnExceptionCheckpoint's (written when a step
fails part-way: that step is trained again) -- same prompts in the same order, same rewards and the same LoRA
weights, bit for bit."""

import random

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, PromptDataModule, SamplingConfig

from helpers import tiny_policy_config

PROMPTS = ["a cat", "a dog", "a tree", "a boat", "a red sun", "a hill"]


class Seen(Callback):
    """(global step after the step, prompt indices, reward mean) of every training step."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.rows.append((trainer.global_step, [int(i) for i in batch["index"]],
                          float(trainer.callback_metrics["train/reward_mean"])))


class FailInsideStep(Callback):
    """Raises after the rollout and the backward passes of the step after ``step``, before its optimizer step."""

    def __init__(self, step):
        self.step = step

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step == self.step:
            raise RuntimeError("a failure inside the training step")


def run(seed, root, steps, checkpoint=None, ckpt_path=None):
    module = JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=4),
                        GRPOConfig(train_batch_size=4), JAGGConfig(window_size=2),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=0.05), seed=seed)
    seen = Seen()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=checkpoint is not None, default_root_dir=root,
                        callbacks=[seen] + (list(checkpoint) if checkpoint else []))
    try:
        trainer.fit(module, PromptDataModule(prompts=PROMPTS[:4], batch_size=2, seed=seed), ckpt_path=ckpt_path)
    except RuntimeError as err:
        assert "inside the training step" in str(err)
    return seen.rows, [p.detach().clone() for p in module.policy.lora_parameters()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    seed = random.randrange(10_000)
    return seed, *run(seed, tmp_path_factory.mktemp("full"), 7)


@pytest.mark.parametrize("kind", ["epoch_end_default", "every_n_train_steps_mid_epoch", "last", "on_exception"])
def test_resume_continues_exactly(kind, uninterrupted, tmp_path):
    seed, full_rows, full_weights = uninterrupted
    ckpt = tmp_path / "ckpt"
    if kind == "epoch_end_default":  # what Lightning writes by default: epoch=1-step=4.ckpt at the epoch's end
        checkpoint, stop = [ModelCheckpoint(dirpath=ckpt)], 4
    elif kind == "every_n_train_steps_mid_epoch":
        checkpoint, stop = [ModelCheckpoint(dirpath=ckpt, every_n_train_steps=3, save_top_k=-1)], 3
    elif kind == "last":  # only last.ckpt, rewritten after every step
        checkpoint, stop = [ModelCheckpoint(dirpath=ckpt, every_n_train_steps=1, save_top_k=0, save_last=True)], 5
    else:  # the step after step 3 fails after its rollout and backward: the 3 finished steps are all that count
        checkpoint, stop = [OnExceptionCheckpoint(dirpath=ckpt), FailInsideStep(3)], 7
    first_rows, _ = run(seed, tmp_path / "first", stop, checkpoint)
    [path] = (tmp_path / "ckpt").glob("*.ckpt")
    second_rows, second_weights = run(seed, tmp_path / "second", 7, ckpt_path=str(path))
    assert first_rows + second_rows == full_rows, (path.name, first_rows + second_rows, full_rows)
    for a, b in zip(second_weights, full_weights):
        assert torch.equal(a, b)
