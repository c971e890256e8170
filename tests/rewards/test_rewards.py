"""Rewards on tiny random versions of each architecture, saved locally and loaded through the very code
users call with real checkpoints."""

import json

import lightning as L
import pytest
import torch
from transformers import CLIPModel, CLIPProcessor

from jagg_lightning.data import PromptDataModule
from jagg_lightning.faults.nonfinite import NonFiniteError
from jagg_lightning.rewards import (
    AestheticReward,
    CLIPScoreReward,
    HPSv2Reward,
    JpegCompressibility,
    JpegIncompressibility,
    PickScoreReward,
    Reward,
    WeightedReward,
)
from jagg_lightning.rewards.aesthetic import AestheticMLP

from modules import make_module

PROMPTS = ["a red cat on a mat", "a lighthouse at night", "a bowl of ramen", "an astronaut on a horse", "sunflowers"]


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory):
    """A tiny OpenCLIP architecture registered through hpsv2's own factory, and its HPS-style checkpoint."""
    from hpsv2.src.open_clip import create_model_and_transforms
    from hpsv2.src.open_clip.factory import add_model_config

    root = tmp_path_factory.mktemp("hps")
    arch = {"embed_dim": 8, "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "head_width": 8, "patch_size": 8},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1}}
    (root / "tiny-hps.json").write_text(json.dumps(arch))
    add_model_config(str(root / "tiny-hps.json"))
    torch.manual_seed(4321)
    model, _, _ = create_model_and_transforms("tiny-hps", pretrained=None, precision="fp32", device="cpu",
                                              output_dict=True)
    torch.save({"state_dict": model.state_dict()}, root / "hps.pt")
    return root, model


@pytest.fixture(scope="module")
def aesthetic_head(tmp_path_factory):
    root = tmp_path_factory.mktemp("aesthetic")
    torch.manual_seed(99)
    head = AestheticMLP(embed_dim=8)
    torch.save(head.state_dict(), root / "head.pth")
    return root / "head.pth"


@pytest.fixture(scope="module")
def rewards(clip_dir, hps_files, aesthetic_head):
    root, _ = hps_files
    return {
        "hpsv2": HPSv2Reward(str(root / "hps.pt"), model_name="tiny-hps", model_config=str(root / "tiny-hps.json"),
                             batch_size=2),
        "pickscore": PickScoreReward(str(clip_dir)),
        "clipscore": CLIPScoreReward(str(clip_dir)),
        "aesthetic": AestheticReward(str(aesthetic_head), clip_path=str(clip_dir)),
        "jpeg_compressibility": JpegCompressibility(),
        "jpeg_incompressibility": JpegIncompressibility(),
    }


def images(gen, n=5, side=32):
    return torch.rand(n, 3, side, side, generator=gen)


@pytest.mark.parametrize("name", ["hpsv2", "pickscore", "clipscore", "aesthetic", "jpeg_compressibility",
                                  "jpeg_incompressibility"])
def test_shape_dtype_determinism_batch_invariance_and_frozen(rewards, name, rng_seed):
    reward = rewards[name]
    gen = torch.Generator().manual_seed(rng_seed)
    imgs = images(gen)
    scores = reward(imgs, PROMPTS)
    assert scores.shape == (5,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    assert torch.equal(scores, reward(imgs, PROMPTS))
    one_by_one = torch.cat([reward(imgs[i : i + 1], PROMPTS[i : i + 1]) for i in range(5)])
    torch.testing.assert_close(one_by_one, scores, rtol=1e-4, atol=1e-4)
    assert scores.unique().numel() > 1  # it looks at the images
    assert all(not p.requires_grad for p in reward.parameters())
    reward.train()
    assert not any(m.training for m in reward.modules())


@pytest.mark.parametrize("name", ["hpsv2", "pickscore", "clipscore"])
def test_text_conditioned_scores_depend_on_the_prompt(rewards, name, rng_seed):
    imgs = images(torch.Generator().manual_seed(rng_seed))
    a = rewards[name](imgs, PROMPTS)
    b = rewards[name](imgs, ["old trains"] * 5)
    assert (a - b).abs().max() > 1e-6


def test_hpsv2_loads_the_checkpoint_and_scores_like_the_model(hps_files, rewards, rng_seed):
    """The score is <image features, text features> of the *saved* weights through hpsv2's preprocessing."""
    from hpsv2.src.open_clip import get_tokenizer

    _, model = hps_files
    reward = rewards["hpsv2"]
    for (name, a), b in zip(reward.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    imgs = images(torch.Generator().manual_seed(rng_seed), n=3)
    from jagg_lightning.rewards import to_pil

    pixels = torch.stack([reward.preprocess(p) for p in to_pil(imgs)])
    with torch.no_grad():
        out = model.eval()(pixels, get_tokenizer("tiny-hps")(PROMPTS[:3]))
    expected = torch.diagonal(out["image_features"] @ out["text_features"].T)
    torch.testing.assert_close(reward(imgs, PROMPTS[:3]), expected, rtol=1e-5, atol=1e-6)


def test_pickscore_and_clipscore_formulas(rewards, clip_dir, rng_seed):
    imgs = images(torch.Generator().manual_seed(rng_seed), n=2)
    model = CLIPModel.from_pretrained(clip_dir).eval()
    processor = CLIPProcessor.from_pretrained(clip_dir)
    from jagg_lightning.rewards import to_pil

    with torch.no_grad():
        out = model(**processor(text=PROMPTS[:2], images=to_pil(imgs), return_tensors="pt", padding=True))
    cos = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds, dim=-1)
    torch.testing.assert_close(rewards["pickscore"](imgs, PROMPTS[:2]), model.logit_scale.exp() * cos,
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rewards["clipscore"](imgs, PROMPTS[:2]), (100 * cos).clamp_min(0), rtol=1e-3, atol=1e-3)


def test_weighted_combination_adds_up(rewards, rng_seed):
    imgs = images(torch.Generator().manual_seed(rng_seed))
    combo = WeightedReward([rewards["pickscore"], rewards["jpeg_compressibility"]], weights=[2.0, -0.5])
    total, parts = combo.score_with_components(imgs, PROMPTS)
    assert set(parts) == {"pickscore", "jpeg_compressibility"}
    torch.testing.assert_close(total, 2.0 * parts["pickscore"] - 0.5 * parts["jpeg_compressibility"])
    torch.testing.assert_close(combo(imgs, PROMPTS), total)
    with pytest.raises(ValueError, match="weights must have 2 entries"):
        WeightedReward([rewards["pickscore"], rewards["aesthetic"]], weights=[1.0])
    with pytest.raises(ValueError, match="distinct names"):
        WeightedReward([JpegCompressibility(), JpegCompressibility()])


def test_missing_or_wrong_checkpoint_names_reward_and_path(tmp_path, clip_dir, hps_files):
    with pytest.raises(FileNotFoundError, match=r"pickscore.*model_path.*nowhere"):
        PickScoreReward(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"hpsv2: checkpoint is required"):
        HPSv2Reward(None)
    with pytest.raises(FileNotFoundError, match=r"aesthetic.*head_path"):
        AestheticReward(str(tmp_path / "head.pth"), clip_path=str(clip_dir))
    wrong = tmp_path / "wrong.pth"
    torch.save(AestheticMLP(embed_dim=5).state_dict(), wrong)
    with pytest.raises(ValueError, match=r"aesthetic.*wrong\.pth"):
        AestheticReward(str(wrong), clip_path=str(clip_dir))
    root, _ = hps_files
    with pytest.raises(ValueError, match=r"hpsv2.*wrong\.pth.*does not fit"):
        HPSv2Reward(str(wrong), model_name="tiny-hps", model_config=str(root / "tiny-hps.json"))


def test_bad_images_are_refused(rewards, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    reward = rewards["jpeg_compressibility"]
    with pytest.raises(ValueError, match=r"jpeg_compressibility.*\[0, 1\]"):
        reward(images(gen) * 2, PROMPTS)
    with pytest.raises(ValueError, match=r"pickscore.*\[B, 3, H, W\]"):
        rewards["pickscore"](torch.rand(5, 32, 32, generator=gen), PROMPTS)
    with pytest.raises(ValueError, match="5 images but 2 prompts"):
        reward(images(gen), PROMPTS[:2])


class NaNAfterFirstCall(Reward):
    """A user reward that breaks: finite once, then NaN."""

    name = "flaky_user_reward"

    def __init__(self):
        super().__init__()
        self.calls = 0

    def score(self, images, prompts):
        self.calls += 1
        out = images.mean(dim=(1, 2, 3))
        return out if self.calls == 1 else out * float("nan")


def test_nan_score_stops_the_step_with_the_reward_name(rng_seed):
    """A NaN score is the non-finite guard's (jagg_lightning/faults/nonfinite.py): with grpo.max_nonfinite_in_a_row 1 the
    first such update stops the run, naming the reward and the samples, and the weights never saw it."""
    module = make_module(rng_seed % 10_000, max_nonfinite_in_a_row=1)
    module.reward_fn = NaNAfterFirstCall()
    module.sampling.rollout_batch_size = 3  # one micro-batch per prompt: the second one is NaN
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    before = [p.detach().clone() for p in module.policy.lora_parameters()]
    with pytest.raises(NonFiniteError, match=r"non-finite reward flaky_user_reward \(NaN\) in prompt 1 sample 0"):
        trainer.fit(module, PromptDataModule(prompts=PROMPTS[:2], batch_size=2, shuffle=False))
    assert all(torch.equal(a, b) for a, b in zip(before, module.policy.lora_parameters()))


def test_threaded_scoring_equals_synchronous(rewards, rng_seed):
    seed = rng_seed % 10_000
    sync, threaded = make_module(seed), make_module(seed)
    combo = WeightedReward([rewards["pickscore"], rewards["hpsv2"], rewards["jpeg_compressibility"]], [1.0, 1.0, 0.1])
    sync.reward_fn, threaded.reward_fn = combo, combo
    threaded.reward_workers = 2
    sync.sampling.rollout_batch_size = threaded.sampling.rollout_batch_size = 2
    a = sync.sampler.rollout_and_score(PROMPTS[:3], [0, 1, 2], step=3, reward=sync.reward_fn)
    b = threaded.sampler.rollout_and_score(PROMPTS[:3], [0, 1, 2], step=3, reward=threaded.reward_fn)
    threaded.teardown("fit")
    assert torch.equal(a[3], b[3])
    assert set(a[4]) == {"pickscore", "hpsv2", "jpeg_compressibility"}
    for name in a[4]:
        assert torch.equal(a[4][name], b[4][name])


def test_reward_weights_stay_out_of_the_lora_checkpoint(rewards, rng_seed):
    module = make_module(rng_seed % 10_000)
    module.reward_fn = WeightedReward([rewards["pickscore"], rewards["aesthetic"]])
    checkpoint = {"state_dict": module.state_dict()}
    assert any(k.startswith("reward_fn.") for k in checkpoint["state_dict"])
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["state_dict"] and not any(k.startswith("reward_fn.") for k in checkpoint["state_dict"])
    assert all("lora" in k for k in checkpoint["state_dict"])


def test_cli_builds_a_weighted_reward_from_class_paths(clip_dir, hps_files, tmp_path):
    from pathlib import Path

    from jagg_lightning.cli import cli_main

    root, _ = hps_files
    reward = {"class_path": "jagg_lightning.rewards.WeightedReward", "init_args": {
        "rewards": [
            {"class_path": "jagg_lightning.rewards.HPSv2Reward",
             "init_args": {"checkpoint": str(root / "hps.pt"), "model_name": "tiny-hps",
                           "model_config": str(root / "tiny-hps.json")}},
            {"class_path": "jagg_lightning.rewards.PickScoreReward", "init_args": {"model_path": str(clip_dir)}},
        ],
        "weights": [1.0, 0.5]}}
    repo = Path(__file__).resolve().parents[2]
    cli = cli_main(["--config", str(repo / "configs/tiny.yaml"), "--model.reward", json.dumps(reward),
                    "--data.prompts_file", str(repo / "configs/prompts/tiny.txt"), "--trainer.logger", "false",
                    "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path),
                    "--lora_export.dirpath", str(tmp_path / "lora")], run=False)
    assert isinstance(cli.model.reward_fn, WeightedReward)
    assert cli.model.reward_fn.weights == {"hpsv2": 1.0, "pickscore": 0.5}
    cli.trainer.fit(cli.model, cli.datamodule)
    logged = cli.trainer.callback_metrics
    assert "train/reward/hpsv2" in logged and "train/reward/pickscore" in logged
