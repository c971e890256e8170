"""GenEval's per-task scores on held-out prompts, logged while training: ``val/geneval/<task>`` and ``overall``.

At the start of fit, every ``every_n_steps`` training steps and at the end of fit it samples the prompts of a GenEval
metadata JSONL with fixed seeds (ODE, the policy's guidance, the inference weights:
:func:`jagg_lightning.testbed.evaluate.sample_images`), judges them with a
:class:`~jagg_lightning.rewards.GenEvalReward` of its own (GenEval's per-image correctness) and logs to every logger
``val/geneval/<task>`` (each task's accuracy), ``val/geneval/overall`` (their mean over tasks, as GenEval's
``summary_scores.py`` averages) and ``val/geneval/reward`` (the mean of the reward's ``score``: Flow-GRPO's dense
score by default).

On the scenes test bed the same images are also read by its independent judge
(:mod:`jagg_lightning.testbed.scenes.judge`, a learned detector GRPO never sees) under GenEval's same rules:
``val/judge_geneval/<task>``, ``val/judge_geneval/overall`` and ``val/judge_geneval/agreement`` (the share of images
where the judge and the reward's reader agree on GenEval's correctness) -- the reward-hacking watch, as
``val/judge_accuracy`` is on digits.
"""

from __future__ import annotations

import lightning as L

from jagg_lightning.callbacks.summary import KeptEvaluations
from jagg_lightning.utils.timing import CLOCK


class GenEvalAccuracy(KeptEvaluations, L.Callback):
    """GenEval's per-task held-out scores during fit and in validate / test.

    ``history`` keeps (global step, overall score) of every evaluation, ``evaluations`` (step, the logged values).

    Args:
        prompts_file: A GenEval metadata JSONL (or a shipped name: `scenes_heldout`, the default).
        prompts_per_task: Evaluate only this many rows of each task (evenly spaced in the file), >= 1; null = all.
        every_n_steps: Training steps between evaluations, >= 1 (also at the start and the end of fit).
        samples_per_prompt: Images per prompt, >= 1.
        images_per_task: At least this many images of every task, >= 1: a row of a task with few rows is drawn
            ceil(images_per_task / rows) times, each with its own noise (then `samples_per_prompt` times that);
            null = every row `samples_per_prompt` times. GenEval scores 80-100 prompts x 4 images a task: a
            task scored on a handful of images moves by +-0.1 with the seed. Each task's 95 % interval
            (Wilson) is logged as `val/geneval_ci95/<task>`.
        seed: The seed of the evaluation noise (the same every evaluation).
        num_steps: ODE steps per image; null = `sampling.num_steps`.
        reader: The `GenEvalReward` reader: `scenes`, `mask2former` or `owlv2`.
        score: The `GenEvalReward` score averaged into `val/geneval/reward`: `flow_grpo`, `strict` or `geneval`.
        detector_path: The detector's local folder (`mask2former`, `owlv2`).
        clip_path: The CLIP colour classifier's local folder (`mask2former`, `owlv2`).
        judge: Also read the images with the scenes test bed's independent judge (`val/judge_geneval/*`); null =
            on with the `scenes` reader, off otherwise (the judge reads rendered scenes only).
        judge_path: The judge's weights; null = the shipped `scenes_judge.safetensors`.
    """

    def __init__(self, prompts_file: str = "scenes_heldout", prompts_per_task: int | None = None,
                 every_n_steps: int = 10, samples_per_prompt: int = 2, images_per_task: int | None = None,
                 seed: int = 1234, num_steps: int | None = None,
                 reader: str = "scenes", score: str = "flow_grpo", detector_path: str | None = None,
                 clip_path: str | None = None, judge: bool | None = None, judge_path: str | None = None):
        super().__init__()
        from jagg_lightning.data import read_prompts
        from jagg_lightning.models.conditions import evenly_per_task, repeated_per_task

        for name, value in (("every_n_steps", every_n_steps), ("samples_per_prompt", samples_per_prompt),
                            ("prompts_per_task", 1 if prompts_per_task is None else prompts_per_task),
                            ("images_per_task", 1 if images_per_task is None else images_per_task)):
            if value < 1:
                raise ValueError(f"GenEvalAccuracy.{name} must be >= 1, got {value}")
        prompts = read_prompts(prompts_file, "GenEvalAccuracy.prompts_file")
        self.prompts = evenly_per_task(prompts, prompts_per_task)
        if images_per_task is not None:
            self.prompts = repeated_per_task(self.prompts, images_per_task)
        self.every_n_steps, self.samples_per_prompt, self.seed = every_n_steps, samples_per_prompt, seed
        self.num_steps = num_steps
        self.reward_args = {"reader": reader, "score": score, "detector_path": detector_path, "clip_path": clip_path}
        if judge and reader != "scenes":
            raise ValueError(f"GenEvalAccuracy.judge: the scenes judge reads rendered scenes only; it needs reader "
                             f"'scenes', got {reader!r} (set judge: false)")
        self.judge = reader == "scenes" if judge is None else judge
        self.judge_path, self.judge_reader = judge_path, None
        self.reward = None
        self.history: list[tuple[int, float]] = []
        self.evaluations: list[tuple[int, dict[str, float]]] = []  # (step, what was logged): RunSummary reads it

    def evaluate(self, trainer, pl_module, log: bool = True) -> dict[str, float]:
        from jagg_lightning.rewards.geneval import GenEvalReward
        from jagg_lightning.rewards.geneval_rules import task_intervals
        from jagg_lightning.testbed.evaluate import sample_images

        if self.reward is None:
            self.reward = GenEvalReward(**self.reward_args).to(pl_module.device)
        with CLOCK.phase("evaluation"):
            images = sample_images(pl_module, self.prompts, self.samples_per_prompt, self.seed, self.num_steps)
        per_sample = [p for p in self.prompts for _ in range(self.samples_per_prompt)]
        judged = self.reward.judge_images(images, per_sample)
        stage = "test" if trainer.state.fn == "test" else "val"
        metrics = GenEvalReward.metrics(judged, stage)
        metrics.update({f"{stage}/geneval_ci95/{task}": half for task, half in task_intervals(
            [j.tag for j in judged], [j.correct for j in judged]).items()})
        metrics[f"{stage}/geneval/reward"] = float(self.reward.scores_of(judged).mean())
        if self.judge:
            metrics.update(self._judge_metrics(images, per_sample, judged, stage, pl_module.device))
        step = trainer.global_step
        self.history.append((step, metrics[f"{stage}/geneval/overall"]))
        self.evaluations.append((step, metrics))
        if log and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        return metrics

    def _judge_metrics(self, images, prompts, judged, stage: str, device) -> dict[str, float]:
        from jagg_lightning.rewards.geneval import GenEvalReward
        from jagg_lightning.testbed.scenes.judge import (SCENES_JUDGE_PATH, SceneJudgeReader, judge_geneval,
                                                         load_scene_judge)

        if self.judge_reader is None:
            self.judge_reader = SceneJudgeReader(load_scene_judge(self.judge_path or SCENES_JUDGE_PATH).to(device))
        seen = judge_geneval(self.judge_reader, self.reward, images, prompts)
        metrics = {k.replace("/geneval/", "/judge_geneval/"): v for k, v in GenEvalReward.metrics(seen, stage).items()}
        metrics[f"{stage}/judge_geneval/agreement"] = sum(a.correct == b.correct for a, b in zip(seen, judged)) / len(
            seen)
        return metrics

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.state.fn not in ("validate", "test") or trainer.sanity_checking:
            return
        pl_module.log_dict(self.evaluate(trainer, pl_module, log=False), sync_dist=False)

    on_test_epoch_end = on_validation_epoch_end

    def on_fit_start(self, trainer, pl_module) -> None:
        self.evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.rollouts_done % self.every_n_steps == 0:  # the run's step count: a resumed fit keeps the schedule
            self.evaluate(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if pl_module.rollouts_done % self.every_n_steps:
            self.evaluate(trainer, pl_module)
