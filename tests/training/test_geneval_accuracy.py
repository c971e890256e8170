"""GenEvalAccuracy: GenEval's per-task held-out scores of the policy's own samples, logged during fit."""

import numpy as np
import pytest
from lightning.pytorch.loggers import CSVLogger

from jagg_lightning.callbacks import GenEvalAccuracy
from jagg_lightning.rewards import GenEvalReward
from jagg_lightning.rewards.geneval import read_and_judge
from jagg_lightning.rewards.geneval_rules import TASKS
from jagg_lightning.testbed.evaluate import heldout_geneval, sample_images
from jagg_lightning.testbed.scenes.judge import THRESHOLDS, SceneJudgeReader, load_scene_judge

from modules import make_module


@pytest.mark.slow
def test_per_task_scores_of_the_models_samples_are_logged(tmp_path, rng_seed):
    """One row per task of the scenes' held-out file, evaluated at the start and after each step; the last
    evaluation equals GenEval's rules applied by hand to the same samples (same seed, same weights)."""
    import lightning as L

    from jagg_lightning.data import PromptDataModule

    module = make_module(rng_seed)
    callback = GenEvalAccuracy(prompts_per_task=1, every_n_steps=1, samples_per_prompt=1, seed=rng_seed, num_steps=3)
    assert sorted(p.metadata["tag"] for p in callback.prompts) == sorted(TASKS)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=CSVLogger(tmp_path), callbacks=[callback],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=["a red cat", "a blue dog"], batch_size=2, shuffle=False))
    assert [step for step, _ in callback.history] == [0, 1]
    step, logged = callback.evaluations[-1]
    assert set(logged) == {f"val/geneval/{t}" for t in (*TASKS, "overall", "reward")} | {
        f"val/judge_geneval/{t}" for t in (*TASKS, "overall", "agreement")} | {
        f"val/geneval_ci95/{t}" for t in (*TASKS, "overall")}
    images = sample_images(module, callback.prompts, 1, rng_seed, 3)
    judged = GenEvalReward().judge_images(images, callback.prompts)
    expected = GenEvalReward.metrics(judged)
    assert {k: v for k, v in logged.items() if k.startswith("val/geneval/") and k != "val/geneval/reward"} == \
        pytest.approx(expected)
    # the independent judge read the same images under the same rules
    seen = read_and_judge(SceneJudgeReader(load_scene_judge()), images, callback.prompts, THRESHOLDS)
    assert logged["val/judge_geneval/overall"] == pytest.approx(GenEvalReward.metrics(seen)["val/geneval/overall"])
    assert logged["val/judge_geneval/agreement"] == pytest.approx(
        np.mean([a.correct == b.correct for a, b in zip(seen, judged)]))
    assert logged["val/geneval/reward"] == pytest.approx(sum(j.score for j in judged) / len(judged))
    # the studies' evaluation (benchmarks/heldout.py) reports the same numbers for the same samples
    study = heldout_geneval(module, GenEvalReward(), callback.prompts, 1, rng_seed, 3, SceneJudgeReader(load_scene_judge()))
    assert (study["accuracy"], study["judge_accuracy"], study["judge_agreement"], study["reward"]) == pytest.approx(
        (logged["val/geneval/overall"], logged["val/judge_geneval/overall"], logged["val/judge_geneval/agreement"],
         logged["val/geneval/reward"]))
    assert study["per_task"] == pytest.approx({t: logged[f"val/geneval/{t}"] for t in TASKS})
    assert study["judge_per_task"] == pytest.approx({t: logged[f"val/judge_geneval/{t}"] for t in TASKS})
    assert "val/geneval/overall" in (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()


def test_images_per_task_gives_every_task_that_many_images(rng_seed):
    """images_per_task: each task of the held-out file gets at least that many images (its rows repeated evenly,
    each repeat its own noise: a different position in the sampled list), and no task more rows than needed."""
    wanted = int(np.random.default_rng(rng_seed).integers(20, 90))
    callback = GenEvalAccuracy(images_per_task=wanted, samples_per_prompt=1)
    rows = GenEvalAccuracy(samples_per_prompt=1).prompts
    for task in TASKS:
        mine = [p for p in rows if p.metadata["tag"] == task]
        drawn = [p for p in callback.prompts if p.metadata["tag"] == task]
        repeats = -(-wanted // len(mine))
        assert len(drawn) == repeats * len(mine) >= wanted, (rng_seed, task)
        assert [str(p) for p in drawn] == [str(p) for p in mine for _ in range(repeats)]
    with pytest.raises(ValueError, match="GenEvalAccuracy.images_per_task must be >= 1"):
        GenEvalAccuracy(images_per_task=0)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="GenEvalAccuracy.prompts_per_task must be >= 1"):
        GenEvalAccuracy(prompts_per_task=0)
    with pytest.raises(ValueError, match="GenEvalAccuracy.judge: .* needs reader 'scenes', got 'owlv2'"):
        GenEvalAccuracy(reader="owlv2", judge=True)
    assert not GenEvalAccuracy(reader="owlv2").judge and GenEvalAccuracy().judge
