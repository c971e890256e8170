"""Held-out prompt-following accuracy on the digits test bed, logged while training.

A stand-in for a validation loop (fold :func:`jagg_lightning.testbed.evaluate.heldout_accuracy` into
``validation_step`` when one exists): at the start of fit, every ``every_n_steps`` training steps and
at the end of fit it samples the held-out prompts with fixed seeds (ODE, the policy's guidance, the
inference weights) and logs ``val/digit_accuracy`` and ``val/digit_reward`` to every logger, and the
independent judge's reading of the same images (:mod:`jagg_lightning.testbed.judge`, never seen by GRPO):
``val/judge_accuracy`` and ``val/judge_agreement``.
"""

from __future__ import annotations

import lightning as L

from jagg_lightning.callbacks.summary import KeptEvaluations

from jagg_lightning.rewards.digits import DigitReward
from jagg_lightning.testbed.judge import JUDGE_PATH, DigitJudge, load_judge
from jagg_lightning.utils.timing import CLOCK


class DigitAccuracy(KeptEvaluations, L.Callback):
    """Held-out prompt-following accuracy on the digits test bed, during fit and in validate / test.

    ``history`` keeps (global step, accuracy, reward) of every evaluation, ``results`` the whole result of each
    (``jagg_lightning.testbed.evaluate.heldout_accuracy``, judge included), ``evaluations`` (step, the logged
    ``val/*`` values) of each.

    Args:
        prompts: The held-out prompts; null = every held-out template x digit.
        every_n_steps: Training steps between evaluations, >= 1 (also at the start and the end of fit).
        samples_per_prompt: Images per prompt, >= 1.
        seed: The seed of the evaluation noise (the same every evaluation).
        num_steps: ODE steps per image; null = `sampling.num_steps`.
        classifier_path: The digit classifier's weights; null = the shipped one (`DigitReward`'s).
        judge_path: The independent judge's weights (never seen by GRPO); null = the shipped one.
    """

    def __init__(self, prompts: list[str] | None = None, every_n_steps: int = 10, samples_per_prompt: int = 2,
                 seed: int = 1234, num_steps: int | None = None, classifier_path: str | None = None,
                 judge_path: str | None = None):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"DigitAccuracy.every_n_steps must be >= 1, got {every_n_steps}")
        if samples_per_prompt < 1:
            raise ValueError(f"DigitAccuracy.samples_per_prompt must be >= 1, got {samples_per_prompt}")
        if prompts is not None and not prompts:
            raise ValueError("DigitAccuracy.prompts must not be empty")
        self.prompts, self.every_n_steps, self.samples_per_prompt = prompts, every_n_steps, samples_per_prompt
        self.seed, self.num_steps, self.classifier_path, self.judge_path = seed, num_steps, classifier_path, judge_path
        self.reward: DigitReward | None = None
        self.judge: DigitJudge | None = None
        self.history: list[tuple[int, float, float]] = []
        self.results: list[dict] = []
        self.evaluations: list[tuple[int, dict[str, float]]] = []  # (step, what was logged): RunSummary reads it
        self.base_result: dict | None = None  # the base model (adapter off), measured once, for sample grids

    def evaluate(self, trainer, pl_module, log: bool = True) -> dict:
        from jagg_lightning.testbed.evaluate import heldout_accuracy

        if self.reward is None:
            self.reward = DigitReward(self.classifier_path).to(pl_module.device)
            self.judge = load_judge(self.judge_path or JUDGE_PATH).to(pl_module.device)
        with CLOCK.phase("evaluation"):
            result = heldout_accuracy(pl_module, self.reward, self.prompts, self.samples_per_prompt, self.seed,
                                      self.num_steps, judge=self.judge)
        step = trainer.global_step
        self.history.append((step, result["accuracy"], result["reward"]))
        self.results.append(result)
        metrics = self.metrics(result, "test" if trainer.state.fn == "test" else "val")
        self.evaluations.append((step, metrics))
        if log and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        return result

    @staticmethod
    def metrics(result: dict, stage: str = "val") -> dict[str, float]:
        """The logged names of an evaluation's result."""
        return {f"{stage}/digit_accuracy": result["accuracy"], f"{stage}/digit_reward": result["reward"],
                f"{stage}/judge_accuracy": result["judge_accuracy"], f"{stage}/judge_agreement": result["judge_agreement"]}

    def column_scores(self) -> dict | None:
        """{"base": held-out accuracy of the base model, "fine-tuned": of the latest evaluation, "samples": how many
        samples each is over (held-out prompts x ``samples_per_prompt``)} (SampleImages writes them on its grids,
        beside its own count of the pictured samples), or None before the first evaluation."""
        if not self.history or self.base_result is None:
            return None
        return {"base": self.base_result["accuracy"], "fine-tuned": self.history[-1][1],
                "samples": self.results[-1].get("samples")}

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        """``jagg validate`` / ``jagg test``: the same evaluation as during fit (same prompts, seeds and samples),
        so an exported adapter validated with ``--model.policy.adapter`` shows the accuracy its fit logged."""
        if trainer.state.fn not in ("validate", "test") or trainer.sanity_checking:
            return
        self.evaluate(trainer, pl_module, log=False)
        pl_module.log_dict(self.evaluations[-1][1], sync_dist=False)

    on_test_epoch_end = on_validation_epoch_end

    def on_fit_start(self, trainer, pl_module) -> None:
        result = self.evaluate(trainer, pl_module)
        if self.base_result is None:  # the base model: the first evaluation itself unless an adapter is loaded
            from jagg_lightning.testbed.evaluate import heldout_accuracy

            fresh = trainer.ckpt_path is None and trainer.global_step == 0 and pl_module.policy_config.adapter is None
            self.base_result = result if fresh else heldout_accuracy(
                pl_module, self.reward, self.prompts, self.samples_per_prompt, self.seed, self.num_steps,
                adapter=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.rollouts_done % self.every_n_steps == 0:  # the run's step count: a resumed fit keeps the schedule
            self.evaluate(trainer, pl_module)
            pl_module.log("val_acc", self.history[-1][1], prog_bar=True, logger=False)

    def on_fit_end(self, trainer, pl_module) -> None:
        if pl_module.rollouts_done % self.every_n_steps:
            self.evaluate(trainer, pl_module)
