"""Held-out prompt-following accuracy on the digits test bed, logged while training.

A stand-in for a validation loop (fold :func:`jagg_lightning.testbed.evaluate.heldout_accuracy` into
``validation_step`` when one exists): at the start of fit, every ``every_n_steps`` training steps and
at the end of fit it samples the held-out prompts with fixed seeds (ODE, the policy's guidance, the
inference weights) and logs ``val/digit_accuracy`` and ``val/digit_reward`` to every logger.
"""

from __future__ import annotations

import lightning as L

from jagg_lightning.rewards.digits import DigitReward


class DigitAccuracy(L.Callback):
    """prompts: held-out prompts (default: every held-out template x digit); ``history`` keeps
    (global step, accuracy, reward) of every evaluation."""

    def __init__(self, prompts: list[str] | None = None, every_n_steps: int = 10, samples_per_prompt: int = 2,
                 seed: int = 1234, num_steps: int | None = None, classifier_path: str | None = None):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"DigitAccuracy.every_n_steps must be >= 1, got {every_n_steps}")
        if samples_per_prompt < 1:
            raise ValueError(f"DigitAccuracy.samples_per_prompt must be >= 1, got {samples_per_prompt}")
        if prompts is not None and not prompts:
            raise ValueError("DigitAccuracy.prompts must not be empty")
        self.prompts, self.every_n_steps, self.samples_per_prompt = prompts, every_n_steps, samples_per_prompt
        self.seed, self.num_steps, self.classifier_path = seed, num_steps, classifier_path
        self.reward: DigitReward | None = None
        self.history: list[tuple[int, float, float]] = []
        self._step = 0

    def evaluate(self, trainer, pl_module) -> dict:
        from jagg_lightning.testbed.evaluate import heldout_accuracy

        if self.reward is None:
            self.reward = DigitReward(self.classifier_path).to(pl_module.device)
        result = heldout_accuracy(pl_module, self.reward, self.prompts, self.samples_per_prompt, self.seed,
                                  self.num_steps)
        step = trainer.global_step
        self.history.append((step, result["accuracy"], result["reward"]))
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"val/digit_accuracy": result["accuracy"], "val/digit_reward": result["reward"]},
                                   step=step)
        return result

    def on_fit_start(self, trainer, pl_module) -> None:
        self.evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step += 1
        if self._step % self.every_n_steps == 0:
            self.evaluate(trainer, pl_module)
            pl_module.log("val_acc", self.history[-1][1], prog_bar=True, logger=False)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self._step % self.every_n_steps:
            self.evaluate(trainer, pl_module)
