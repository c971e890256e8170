"""The studies' held-out evaluation, one per test bed, picked by the config's reward.

Each evaluator is called as ``evaluator(module, seed)`` and returns {"accuracy", "reward", "judge_accuracy",
"judge_agreement", ...}: the reward's reader and the independent judge on the same fixed-noise ODE samples of the
test bed's HELD-OUT prompts.

* ``digits`` (``model.reward: digits``): the 30 held-out prompts, accuracy = the share of samples the classifier
  reads as the prompted digit, the judge :mod:`jagg_lightning.testbed.judge`
  (:func:`jagg_lightning.testbed.evaluate.heldout_accuracy`).
* ``scenes`` (``model.reward: geneval``, reader ``scenes``): the held-out GenEval metadata rows
  (``data.val_prompts_file``), accuracy = GenEval's overall score (the mean over its six tasks), the judge
  :mod:`jagg_lightning.testbed.scenes.judge` under the same rules
  (:func:`jagg_lightning.testbed.evaluate.heldout_geneval`).
"""

from __future__ import annotations


class DigitsHeldOut:
    def __init__(self, samples: int, prompts: list | None = None):
        from jagg_lightning.rewards import DigitReward
        from jagg_lightning.testbed import HELDOUT_TEMPLATES, digit_prompts
        from jagg_lightning.testbed.judge import load_judge

        self.reward, self.judge, self.samples = DigitReward(), load_judge(), samples
        self.prompts = prompts if prompts is not None else digit_prompts(HELDOUT_TEMPLATES)

    def __call__(self, module, seed: int) -> dict:
        from jagg_lightning.testbed.evaluate import heldout_accuracy

        return heldout_accuracy(module, self.reward, self.prompts, self.samples, seed=seed, judge=self.judge)


class ScenesHeldOut:
    """``images_per_task``: every task gets at least that many images (its rows repeated, one sample each, as
    ``GenEvalAccuracy(images_per_task=...)`` draws them) instead of ``samples`` per row."""

    def __init__(self, samples: int, prompts_file: str = "scenes_heldout", prompts: list | None = None,
                 images_per_task: int | None = None):
        from jagg_lightning.data import read_prompts
        from jagg_lightning.models.conditions import repeated_per_task
        from jagg_lightning.rewards.geneval import GenEvalReward
        from jagg_lightning.testbed.scenes.judge import SceneJudgeReader, load_scene_judge

        self.reward, self.judge = GenEvalReward(reader="scenes"), SceneJudgeReader(load_scene_judge())
        self.prompts = prompts if prompts is not None else read_prompts(prompts_file, "data.val_prompts_file")
        self.samples = samples
        if images_per_task:
            self.prompts, self.samples = repeated_per_task(self.prompts, images_per_task), 1

    def __call__(self, module, seed: int) -> dict:
        from jagg_lightning.testbed.evaluate import heldout_geneval

        return heldout_geneval(module, self.reward, self.prompts, self.samples, seed=seed, judge_reader=self.judge)


def heldout_for(config: dict, samples: int, prompts: list | None = None, images_per_task: int | None = None):
    """The evaluator of the test bed ``config`` (a LightningCLI YAML as a dict) trains on; ``prompts`` replace its
    held-out prompts; ``images_per_task`` (scenes only) as :class:`ScenesHeldOut` takes it."""
    reward = config["model"].get("reward")
    name = reward if isinstance(reward, str) else (reward or {}).get("class_path", "")
    if name == "digits" or name.endswith("DigitReward"):
        return DigitsHeldOut(samples, prompts)
    if name == "geneval" or name.endswith("GenEvalReward"):
        return ScenesHeldOut(samples, config.get("data", {}).get("val_prompts_file") or "scenes_heldout", prompts,
                             images_per_task)
    raise ValueError(f"model.reward: the studies evaluate the digits or the scenes test bed (reward 'digits' or "
                     f"'geneval'), got {reward!r}")


def one_prompt(config: dict, prompts: list, text: str, samples: int, group_size: int | None):
    """The one-prompt study (``time_to_quality.py --prompt``): ``config`` trains on the one training row whose
    prompt is ``text`` (every step, ``group_size`` samples: rollout and train batch one group) and is evaluated
    on that same row (``samples`` fixed-noise ODE samples). Returns (config, [row], evaluator)."""
    rows = [p for p in prompts if str(p) == text]
    if not rows:
        raise ValueError(f"--prompt: not one of the {len(prompts)} training prompts of data.prompts_file, got {text!r}")
    config = dict(config, data=dict(config.get("data", {}), batch_size=1))
    group = group_size or config["model"]["sampling"]["group_size"]
    config["model"] = dict(config["model"], sampling=dict(config["model"]["sampling"], group_size=group,
                                                          rollout_batch_size=group),
                           grpo=dict(config["model"].get("grpo", {}), train_batch_size=group))
    return config, rows[:1], heldout_for(config, samples, rows[:1])

