"""Held-out prompt following on the test beds: ODE samples of fixed seeds, read by the reward's reader and the judge.

Digits (:func:`heldout_accuracy`: the classifier, the digits judge) and scenes (:func:`heldout_geneval`: GenEval's
rules over the exact reader and over the scenes judge).

Plain torch on a :class:`~jagg_lightning.module.JAGGModule` (its sampler, policy and inference
weights), so a validation loop, a callback or a benchmark can all call it.
"""

from __future__ import annotations

import torch

from jagg_lightning.rewards.digits import DigitReward, prompt_digit
from jagg_lightning.testbed import HELDOUT_TEMPLATES, digit_prompts
from jagg_lightning.testbed.judge import DigitJudge


@torch.no_grad()
def sample_images(module, prompts: list[str], samples_per_prompt: int, seed: int, num_steps: int | None = None,
                  adapter: bool = True) -> torch.Tensor:
    """ODE (Euler) samples with the policy's guidance, prompt-major: [len(prompts) * samples, 3, H, W].

    Noise of sample i of prompt j depends only on (seed, j, i); ``adapter=False`` samples the base model.
    """
    steps = num_steps or module.sampling.num_steps

    def run():
        return module.sampler.ode_images(list(prompts), range(len(prompts)), samples_per_prompt, seed, 0, steps)

    if not adapter:
        with module.policy.adapter_disabled():
            return run()
    with module.inference_weights():
        return run()


@torch.no_grad()
def heldout_accuracy(module, reward: DigitReward, prompts: list[str] | None = None, samples_per_prompt: int = 2,
                     seed: int = 1234, num_steps: int | None = None, adapter: bool = True,
                     judge: DigitJudge | None = None) -> dict:
    """{"accuracy": share of samples read as the prompted digit, "reward": mean DigitReward score,
    "per_digit": [accuracy of digit 0..9], "samples": how many} over ``prompts`` (default: every held-out template x digit).

    With a ``judge`` (:mod:`jagg_lightning.testbed.judge`), on the same images: "judge_accuracy" (share the
    judge reads as the prompted digit) and "judge_agreement" (share where judge and reward's classifier
    read the same digit, right or wrong)."""
    prompts = list(prompts or digit_prompts(HELDOUT_TEMPLATES))
    images = sample_images(module, prompts, samples_per_prompt, seed, num_steps, adapter)
    per_sample = [p for p in prompts for _ in range(samples_per_prompt)]
    read = reward.log_probs(images).argmax(-1).cpu()
    target = torch.tensor([prompt_digit(p) for p in per_sample])
    correct = (read == target).float()
    scores = reward(images, per_sample)
    per_digit = [float(correct[target == d].mean()) if (target == d).any() else float("nan") for d in range(10)]
    result = {"accuracy": float(correct.mean()), "reward": float(scores.mean()), "per_digit": per_digit,
              "samples": len(per_sample)}
    if judge is not None:
        judged = judge(images).argmax(-1).cpu()
        result["judge_accuracy"] = float((judged == target).float().mean())
        result["judge_agreement"] = float((judged == read).float().mean())
    return result


@torch.no_grad()
def heldout_geneval(module, reward, prompts: list, samples_per_prompt: int = 2, seed: int = 1234,
                    num_steps: int | None = None, judge_reader=None) -> dict:
    """ODE samples of ``prompts`` (GenEval metadata prompts; noise from ``seed``, the inference weights) judged by
    ``reward`` (a :class:`~jagg_lightning.rewards.GenEvalReward`): {"accuracy": GenEval's overall score (the mean
    of the per-task accuracies), "per_task": {task: accuracy}, "reward": the mean of the reward's score,
    "samples": how many}; with a ``judge_reader``
    (:class:`~jagg_lightning.testbed.scenes.judge.SceneJudgeReader`, read by
    :func:`~jagg_lightning.testbed.scenes.judge.judge_geneval`) also "judge_accuracy" (its overall score on the same
    images), "judge_per_task" and "judge_agreement" (the share of images where judge and reward agree on
    correctness). The scenes'
    counterpart of :func:`heldout_accuracy`; :class:`~jagg_lightning.callbacks.GenEvalAccuracy` logs the same numbers
    during fit."""
    from jagg_lightning.rewards.geneval_rules import task_scores
    from jagg_lightning.testbed.scenes.judge import judge_geneval

    images = sample_images(module, prompts, samples_per_prompt, seed, num_steps)
    per_sample = [p for p in prompts for _ in range(samples_per_prompt)]
    judged = reward.judge_images(images, per_sample)
    scores = task_scores([j.tag for j in judged], [j.correct for j in judged])
    result = {"accuracy": scores.pop("overall"), "per_task": scores,
              "reward": float(reward.scores_of(judged).mean()), "samples": len(per_sample)}
    if judge_reader is not None:
        seen = judge_geneval(judge_reader, reward, images, per_sample)
        judge_scores = task_scores([j.tag for j in seen], [j.correct for j in seen])
        result["judge_accuracy"], result["judge_per_task"] = judge_scores.pop("overall"), judge_scores
        result["judge_agreement"] = sum(a.correct == b.correct for a, b in zip(seen, judged)) / len(seen)
    return result


def module_from_config(config_path, seed: int = 0, **jagg):
    """A :class:`JAGGModule` with the ``model`` section of a LightningCLI YAML (e.g. configs/digits.yaml),
    the run's seed (``model.seed``) set to ``seed`` and ``jagg`` overriding fields of its ``jagg`` section (a
    ``memory`` field goes to the ``memory`` section). The evaluation noise stays the config's (``evaluation.seed``,
    0 when it names none): the studies compare runs of different seeds on the same evaluation noise.

    A shipped name (``pretrained: digits``) or a relative path is resolved to the folder it names (:mod:`jagg_lightning.utils.assets`).
    Every field of the section is honoured (the optimizer's ``class_path`` and ``init_args`` too); a field
    this builder does not take (``lr_scheduler``) stops it with the field's name.
    Returns (module, the YAML as a dict).
    """
    import dataclasses
    import importlib
    from pathlib import Path

    import yaml

    from jagg_lightning.config import MemoryConfig
    from jagg_lightning.module import JAGGModule
    from jagg_lightning.utils.assets import find_local

    cfg = yaml.safe_load(Path(config_path).read_text())
    model = dict(cfg["model"])
    unsupported = set(model) - {"policy", "sampling", "grpo", "jagg", "reward", "optimizer", "ema_decay",
                                "reward_workers", "evaluation", "memory", "objective", "seed"}
    if unsupported:
        raise ValueError(f"module_from_config: model.{sorted(unsupported)[0]} is not supported here (use jagg fit)")
    model["policy"] = dict(model["policy"])
    if model["policy"].get("pretrained") is not None:  # a shipped name (digits) or a path from any directory
        found = find_local(model["policy"]["pretrained"])
        model["policy"]["pretrained"] = str(found.resolve()) if found is not None else model["policy"]["pretrained"]
    memory_fields = {f.name for f in dataclasses.fields(MemoryConfig)}
    model["memory"] = dict(model.get("memory") or {}) | {k: v for k, v in jagg.items() if k in memory_fields}
    model["jagg"] = dict(model.get("jagg") or {}) | {k: v for k, v in jagg.items() if k not in memory_fields}
    model["evaluation"] = {"seed": 0} | dict(model.get("evaluation") or {})
    model["seed"] = seed
    if model.get("optimizer"):  # a config the user wrote (not checkpoint data): its optimizer's module may be imported
        importlib.import_module(model["optimizer"]["class_path"].rpartition(".")[0])
    # JAGGModule takes the sections as dicts and the optimizer as {class_path, init_args}, as LightningCLI does
    module = JAGGModule(**model)
    module.configure_model()  # builds the policy now (the Trainer's own call is then a no-op)
    return module, cfg
