"""A GenEval metadata JSONL as the data file: each row's prompt trains and its metadata reaches GenEvalReward."""

import csv
import json

import numpy as np

from in_process import tiny_fit_with_reward
from jagg_lightning.data import PromptDataModule
from jagg_lightning.testbed.scenes import TRAIN_METADATA


def test_a_geneval_metadata_jsonl_trains_with_the_scenes_reader(tmp_path, capfd, monkeypatch, rng_seed):
    """Rows with GenEval's own fields only (no image): the prompts read as the rows' texts, each carrying its row;
    a 2-step `jagg fit` scores them with GenEvalReward (which refuses a prompt without metadata) and logs the reward
    and the validation's per-task scores' source."""
    rows = [json.loads(line) for line in TRAIN_METADATA.read_text().splitlines()]
    rng = np.random.default_rng(rng_seed)
    chosen = [rows[i] for i in rng.choice(len(rows), 3, replace=False)]
    data_file = tmp_path / "evaluation_metadata.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    module = PromptDataModule(prompts_file=str(data_file))
    assert module.prompts == [r["prompt"] for r in chosen] and [p.metadata for p in module.prompts] == chosen

    proc, root = tiny_fit_with_reward({"class_path": "jagg_lightning.rewards.GenEvalReward",
                                       "init_args": {"reader": "scenes", "score": "flow_grpo"}}, tmp_path, capfd,
                                      monkeypatch, data={"prompts_file": str(data_file), "batch_size": 1})
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(root / "lightning_logs" / "version_0" / "metrics.csv") as fh:
        logged = [float(r["train/reward_mean"]) for r in csv.DictReader(fh) if r.get("train/reward_mean")]
    assert logged and all(np.isfinite(v) and v <= 1 for v in logged)


def test_metadata_travels_through_batches_and_pickles_and_the_reward_rebuilds():
    """The shipped names read the scenes' metadata files; a row survives a DataLoader batch and a pickle (gathers
    across processes), and the reward's description (the hyper-parameters) rebuilds it."""
    import pickle

    from torch.utils.data import DataLoader

    from jagg_lightning.data import PromptDataset, unpack_prompt_batch
    from jagg_lightning.rewards import GenEvalReward
    from jagg_lightning.rewards.registry import build_reward

    module = PromptDataModule(prompts_file="scenes_train", val_prompts_file="scenes_heldout")
    assert len(module.prompts) == 332 and len(module.val_prompts) == 132
    prompts, _ = unpack_prompt_batch(next(iter(DataLoader(PromptDataset(module.val_prompts[-3:]), batch_size=3))))
    again = pickle.loads(pickle.dumps(prompts))
    assert [p.metadata for p in again] == [p.metadata for p in module.val_prompts[-3:]]
    assert all(p.metadata["prompt"] == p for p in again)
    reward = GenEvalReward(score="strict", position_threshold=0.2)
    rebuilt = build_reward(reward.describe())
    assert rebuilt.kind == "strict" and rebuilt.thresholds == reward.thresholds


def test_plain_prompts_are_refused_before_training_naming_the_field_and_prompt(tmp_path, capfd, monkeypatch):
    """Plain prompts cannot be scored by GenEval's rules: the run stops at setup (the data field named, no step
    taken, no log written), not at the first score."""
    import pytest

    with pytest.raises(ValueError, match="data.prompts: prompt 'a cat' carries no GenEval metadata"):
        tiny_fit_with_reward("geneval", tmp_path, capfd, monkeypatch)
    assert not list((tmp_path / "run").rglob("metrics.csv"))
