"""The digits test bed: the shipped pipeline, DigitReward, and a short JAGG fine-tune on it.

Everything here loads the weights shipped in the package (trained once by
``python -m jagg_lightning.testbed.train``); nothing is retrained. scikit-learn (test extra) provides
the real digit images of the held-out test split.
"""

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from jagg_lightning.data import PromptDataModule, read_prompts
from jagg_lightning.rewards import DigitReward, JpegCompressibility, WeightedReward, build_reward
from jagg_lightning.rewards.base import RewardError
from jagg_lightning.rewards.digits import prompt_digit, to_digit_grid
from jagg_lightning.testbed import HELDOUT_TEMPLATES, INFO_PATH, PIPELINE_DIR, digit_prompts
from jagg_lightning.testbed.evaluate import heldout_accuracy, module_from_config, sample_images
from jagg_lightning.testbed.judge import load_judge

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "digits.yaml"
# Measured base accuracy of the shipped model under the configured sampling is in training_info.json
# and docs/testbed.md; the tests ask for a margin well inside it (chance is 0.10).
CHANCE = 0.10
MARGIN = 0.20
# The fine-tune check (test_short_jagg_finetune_raises_heldout_reward_and_accuracy): FINETUNE_STEPS of
# configs/digits.yaml with its own settings (16 prompts x 8 samples per step, lr 1e-3, the first 4 SDE steps
# trained as one JAGG window) for each of FINETUNE_SEEDS fresh seeds; held-out reward and accuracy on the
# same fixed sampling noise (EVAL_SAMPLES per held-out prompt, 240 samples) before and after, so each gain
# is paired: an unchanged model scores exactly the same.
# Measured with this very procedure (2026-12-01, one thread, 16 random base seeds x 3 = 48 runs, about
# 33 s each), gain after 30 steps: held-out reward +0.103 +- 0.024 per seed (min +0.037), 3-seed means
# +0.074 to +0.123; held-out accuracy +0.110 +- 0.030 per seed (min +0.042), 3-seed means +0.068 to +0.126.
# Thresholds: a 3-seed mean gain of 0.05 in both is 3.9 (reward) and 3.5 (accuracy) standard deviations
# of the 3-seed mean below the measured mean, and each seed's reward gain > 0 is 4.4 sd below it.
# Evaluation noise: a paired gain that is pure sampling noise (the fine-tuned model no better, only
# different on the discordant samples) has std sqrt(#discordant) / 240 ~ 0.023-0.03 per seed here,
# 0.016 for the 3-seed mean in a test run (a per-prompt bootstrap gives a little more, 0.023-0.04 per
# seed; reward 0.02-0.03), so 0.05 is ~3 of those; the test also checks the accuracy gain against 3x the
# noise of its own run.
# The independent judge (jagg_lightning.testbed.judge) reads the same images. Measured with this procedure
# (2026-12-01, 16 seeds, 30 steps): judge accuracy gain +0.042 +- 0.056 per seed (3 of 16 negative, the
# lowest -0.121 while the reward's classifier gained +0.046), so the 3-seed mean has sd 0.032: it cannot be
# asked to rise, only not to fall, -0.07 being 3.5 sd below the measured mean. A fall past that while the
# reward rises would be the reward hacking the judge is there to catch (docs/testbed.md).
# Fewer steps were measured and refused (2026-12-03, one thread, 16 fresh seeds, held-out evaluations of each run
# after 10..30 steps, every triple of seeds through this test's five checks): 30 steps fail 2 of 560 triples
# (reward +0.086 +- 0.015 per seed, accuracy +0.099 +- 0.033), 25 steps 7 (reward +0.073 +- 0.014, accuracy
# +0.083 +- 0.032, 1.8 sd of the 3-seed mean above MIN_MEAN_ACCURACY_GAIN), 20 steps 223.
FINETUNE_STEPS = 30
EVAL_SAMPLES = 8
FINETUNE_SEEDS = 3
MIN_MEAN_REWARD_GAIN = 0.05
MIN_MEAN_ACCURACY_GAIN = 0.05
MIN_SEED_REWARD_GAIN = 0.0
MIN_MEAN_JUDGE_GAIN = -0.07


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Batches here are tiny: one thread is as fast, and far faster on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def digits_test_split():
    """Real images of the recipe's held-out test split as [N, 3, 32, 32] in [0, 1], and their labels."""
    from sklearn.datasets import load_digits

    from jagg_lightning.testbed.train import to_rgb

    data = load_digits()
    index = json.loads(INFO_PATH.read_text())["data"]["test_indices"]
    images = torch.tensor(data.images[index], dtype=torch.float32) / 16.0
    return to_rgb(images), torch.tensor(data.target[index])


@pytest.fixture(scope="session")
def reward():
    return DigitReward()


def test_prompt_digit_parsing():
    assert prompt_digit("a handwritten digit 7") == 7
    assert prompt_digit("The number SEVEN") == 7
    assert prompt_digit("number 0, handwritten") == 0
    for p in digit_prompts() + digit_prompts(HELDOUT_TEMPLATES):
        assert 0 <= prompt_digit(p) <= 9
    for bad in ("a cat on a mat", "digit 17", "someone", "a 3 next to a seven"):
        with pytest.raises(ValueError, match="reward digits: prompt"):
            prompt_digit(bad)


def test_digit_reward_ranks_the_named_class_first(digits_test_split, reward, rng_seed):
    images, labels = digits_test_split
    gen = torch.Generator().manual_seed(rng_seed)
    pairs = 64
    i = torch.randint(0, len(labels), (pairs,), generator=gen)
    j = torch.randint(0, len(labels), (pairs * 4,), generator=gen)
    j = torch.stack([j[(labels[j] != labels[a])][k] for k, a in enumerate(i)])  # another class
    prompts = [f"the number {['zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine'][int(d)]}"
               for d in labels[i]]
    right, wrong = reward(images[i], prompts), reward(images[j], prompts)
    assert right.shape == (pairs,) and ((0 <= right) & (right <= 1)).all()
    assert (right > wrong).float().mean() >= 0.9  # classifier: 98.9 % on this split
    assert reward.correct(images[i], prompts).float().mean() >= 0.9
    log_reward = DigitReward(score="log_prob")
    assert torch.allclose(log_reward(images[i], prompts).exp(), right, atol=1e-5)


def test_digit_reward_rejects_prompts_without_a_digit(digits_test_split, reward):
    images, _ = digits_test_split
    with pytest.raises(RewardError, match="prompt 'a photo of a cat' names no digit"):
        reward(images[:2], ["a handwritten digit 3", "a photo of a cat"])
    with pytest.raises(ValueError, match="score must be"):
        DigitReward(score="accuracy")
    with pytest.raises(FileNotFoundError, match="classifier_path"):
        DigitReward(classifier_path="/nonexistent/classifier.safetensors")


def test_digit_reward_is_registered_and_combines(digits_test_split, reward):
    images, labels = digits_test_split
    prompts = [f"digit {int(d)}" for d in labels[:6]]
    assert isinstance(build_reward("digits"), DigitReward)
    combined = WeightedReward([DigitReward(), JpegCompressibility()], [1.0, 0.1])
    total, parts = combined.score_with_components(images[:6], prompts)
    assert set(parts) == {"digits", "jpeg_compressibility"}
    assert torch.allclose(parts["digits"], reward(images[:6], prompts))
    assert torch.allclose(total, parts["digits"] + 0.1 * parts["jpeg_compressibility"])


def test_judge_is_the_recipes_fit_and_reads_the_test_split(digits_test_split, rng_seed):
    """The shipped judge: what ``python -m jagg_lightning.testbed.judge`` fits, ported exactly from scikit-learn."""
    from sklearn.linear_model import LogisticRegression

    from jagg_lightning.testbed.judge import fit_judge, judge_metadata
    from jagg_lightning.testbed.train import load_split, to_rgb

    images, labels = digits_test_split
    judge = load_judge()
    accuracy = float((judge(images).argmax(-1) == labels).float().mean())
    assert accuracy >= 0.9 and abs(accuracy - float(judge_metadata()["test_accuracy"])) < 0.5 / len(labels)
    x_train, y_train, *_ = load_split(0)
    grids = to_digit_grid(to_rgb(x_train))
    refit = fit_judge(grids, y_train)
    assert (refit(images).argmax(-1) == judge(images).argmax(-1)).float().mean() >= 0.99
    # the port: same probabilities as scikit-learn's own predict_proba, on fresh random images
    reference = LogisticRegression(C=1.0, max_iter=1000).fit(grids.flatten(1).double().numpy(), y_train.numpy())
    noise = torch.rand(16, 3, 32, 32, generator=torch.Generator().manual_seed(rng_seed))
    expected = torch.from_numpy(reference.predict_proba(to_digit_grid(noise).flatten(1).double().numpy()))
    assert torch.allclose(refit(noise).softmax(-1).double(), expected, atol=1e-5)
    prompts = [f"digit {int(d)}" for d in labels[:8]]
    assert torch.equal(judge.correct(images[:8], prompts), judge(images[:8]).argmax(-1) == labels[:8])
    with pytest.raises(FileNotFoundError, match="judge_path"):
        load_judge("/nonexistent/judge.safetensors")


@pytest.fixture(scope="session")
def digits_module():
    module, _ = module_from_config(CONFIG, seed=0)
    return module


def test_module_from_config_honours_the_optimizer_and_refuses_what_it_cannot_build(digits_module, tmp_path):
    cfg = yaml.safe_load(CONFIG.read_text())
    optimizer = digits_module.configure_optimizers()
    [group] = optimizer.param_groups
    assert type(optimizer).__name__ == cfg["model"]["optimizer"]["class_path"].split(".")[-1]
    assert group["lr"] == cfg["model"]["optimizer"]["init_args"]["lr"]
    cfg["model"]["optimizer"] = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.25, "momentum": 0.5}}
    cfg["model"]["ema_decay"] = 0.9
    (tmp_path / "sgd.yaml").write_text(yaml.safe_dump(cfg))
    module, _ = module_from_config(tmp_path / "sgd.yaml")
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["momentum"] == 0.5
    assert module.ema is not None and module.ema.decay == 0.9
    cfg["model"]["lr_scheduler"] = {"class_path": "torch.optim.lr_scheduler.ConstantLR"}
    (tmp_path / "sched.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="model.lr_scheduler"):
        module_from_config(tmp_path / "sched.yaml")


@pytest.mark.slow
def test_digit_accuracy_logs_what_it_measures_with_the_judge(tmp_path, rng_seed):
    """DigitAccuracy in a real fit: at the start, every n steps and at the end it logs held-out accuracy, reward
    and the judge's reading of the same images; each logged value is what heldout_accuracy measures."""
    from lightning.pytorch.loggers import CSVLogger

    from jagg_lightning.callbacks import DigitAccuracy

    seed = rng_seed % 100_000
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["model"]["sampling"] |= {"group_size": 2, "rollout_batch_size": 4}
    cfg["model"]["grpo"]["train_batch_size"] = 4
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(cfg))
    module, _ = module_from_config(tmp_path / "small.yaml", seed=seed)
    prompts = digit_prompts(HELDOUT_TEMPLATES)[::3]
    callback = DigitAccuracy(prompts=prompts, every_n_steps=2, samples_per_prompt=2, seed=seed)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path), callbacks=[callback],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=digit_prompts()[:4], batch_size=2, seed=seed))
    assert [step for step, *_ in callback.history] == [0, 2, 3]
    last = callback.results[-1]
    judge = load_judge()
    assert heldout_accuracy(module, DigitReward(), prompts, 2, seed, judge=judge) == last
    # the judge's numbers, recomputed from the images themselves
    images = sample_images(module, prompts, 2, seed)
    per_sample = [p for p in prompts for _ in range(2)]
    judged, read = judge(images).argmax(-1), DigitReward().log_probs(images).argmax(-1)
    assert last["judge_accuracy"] == pytest.approx(float(judge.correct(images, per_sample).float().mean()))
    assert last["judge_agreement"] == pytest.approx(float((judged == read).float().mean()))
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        logged = {int(row["step"]): row for row in csv.DictReader(f) if row.get("val/judge_accuracy")}
    assert sorted(logged) == [0, 2, 3]
    for key in ("accuracy", "reward", "judge_accuracy", "judge_agreement"):
        name = "val/" + ("digit_" + key if key in ("accuracy", "reward") else key)
        assert [float(logged[s][name]) for s in (0, 2, 3)] == pytest.approx([r[key] for r in callback.results])


def test_shipped_pipeline_loads_through_policy_config_and_beats_chance(digits_module, reward, rng_seed):
    policy = digits_module.policy
    assert policy.config.pretrained == str(PIPELINE_DIR) and PIPELINE_DIR.is_dir()
    assert policy.latent_shape == (4, 8, 8) and policy.resolution == (32, 32)
    result = heldout_accuracy(digits_module, reward, samples_per_prompt=2, seed=rng_seed % 100_000, adapter=False)
    print(f"base held-out accuracy {result['accuracy']:.3f} per digit {result['per_digit']}")
    assert result["accuracy"] >= CHANCE + MARGIN


def test_shipped_pipeline_loads_through_diffusers_and_beats_chance(reward, rng_seed):
    from diffusers import StableDiffusion3Pipeline

    cfg = json.loads(INFO_PATH.read_text())
    # the pipeline has no T5: diffusers wants the absent components named (docs/testbed.md)
    pipe = StableDiffusion3Pipeline.from_pretrained(str(PIPELINE_DIR), text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    prompts = digit_prompts(HELDOUT_TEMPLATES)
    gens = [torch.Generator().manual_seed(rng_seed + i) for i in range(len(prompts))]
    images = pipe(prompt=prompts, num_inference_steps=10, guidance_scale=cfg["base_heldout_ode"]["guidance_scale"],
                  height=32, width=32, generator=gens, output_type="pt",
                  max_sequence_length=cfg["max_sequence_length"]).images
    assert images.shape == (len(prompts), 3, 32, 32)
    accuracy = float(reward.correct(images.clamp(0, 1), prompts).float().mean())
    print(f"diffusers pipeline held-out accuracy {accuracy:.3f}")
    assert accuracy >= CHANCE + MARGIN


def test_training_info_records_the_recipe():
    info = json.loads(INFO_PATH.read_text())
    assert info["data"]["train_images"] + info["data"]["test_images"] == 1797
    assert len(info["data"]["test_indices"]) == info["data"]["test_images"]
    for stage in ("classifier", "vae", "transformer"):
        assert info[stage]["steps"] > 0
    assert 0.0 < info["transformer"]["final_flow_loss"] < 1.0
    per_digit = info["base_heldout_ode"]["per_digit"]
    assert len(per_digit) == 10 and CHANCE < info["base_heldout_ode"]["accuracy"] < 1.0


@pytest.mark.slow
def test_short_jagg_finetune_raises_heldout_reward_and_accuracy(rng_seed, reward):
    """A short JAGG run of configs/digits.yaml on DigitReward raises held-out prompt following, over 3 fresh
    seeds (rollouts, LoRA init, prompt order and the evaluation noise all drawn from each seed).

    Held-out = the 3 templates GRPO never sees x 10 digits, EVAL_SAMPLES ODE samples each with fixed noise:
    the base model (adapter off) and the fine-tuned one see the same noise, so a gain is a paired difference.
    Margins and the measured distribution behind them: the comment above FINETUNE_STEPS."""
    prompts = digit_prompts(HELDOUT_TEMPLATES)
    per_sample = [p for p in prompts for _ in range(EVAL_SAMPLES)]

    judge = load_judge()

    def heldout(module, seed, adapter):
        images = sample_images(module, prompts, EVAL_SAMPLES, seed, adapter=adapter)
        return reward.correct(images, per_sample).float(), reward(images, per_sample), judge.correct(images, per_sample)

    reward_gains, accuracy_gains, judge_gains, discordant = [], [], [], 0
    for i in range(FINETUNE_SEEDS):
        seed = (rng_seed + 7919 * i) % 100_000
        L.seed_everything(seed, verbose=False)
        module, cfg = module_from_config(CONFIG, seed=seed)
        correct_before, reward_before, judged_before = heldout(module, seed + 1, adapter=False)
        trainer = L.Trainer(max_steps=FINETUNE_STEPS, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        train_prompts = read_prompts(cfg["data"]["prompts_file"])  # a shipped name
        lora_before = [p.detach().clone() for p in module.policy.lora_parameters()]
        trainer.fit(module, PromptDataModule(prompts=train_prompts, batch_size=cfg["data"]["batch_size"], seed=seed))
        moved = max(float((p.detach() - q).abs().max()) for p, q in zip(module.policy.lora_parameters(), lora_before))
        assert moved > 0, "the LoRA did not train"
        correct_after, reward_after, judged_after = heldout(module, seed + 1, adapter=True)
        reward_gains.append(float(reward_after.mean() - reward_before.mean()))
        accuracy_gains.append(float(correct_after.mean() - correct_before.mean()))
        judge_gains.append(float(judged_after.float().mean() - judged_before.float().mean()))
        discordant += int((correct_after != correct_before).sum())
        print(f"seed {seed}: held-out accuracy {float(correct_before.mean()):.3f} -> "
              f"{float(correct_after.mean()):.3f}, reward {float(reward_before.mean()):.4f} -> "
              f"{float(reward_after.mean()):.4f}, judge {float(judged_before.float().mean()):.3f} -> "
              f"{float(judged_after.float().mean()):.3f}")
    mean_reward_gain = sum(reward_gains) / FINETUNE_SEEDS
    mean_accuracy_gain = sum(accuracy_gains) / FINETUNE_SEEDS
    mean_judge_gain = sum(judge_gains) / FINETUNE_SEEDS
    # std of the 3-seed mean accuracy gain if every discordant sample were a fair coin (no real change)
    noise = discordant ** 0.5 / (FINETUNE_SEEDS * len(per_sample))
    print(f"3-seed mean gains: reward {mean_reward_gain:+.4f}, accuracy {mean_accuracy_gain:+.3f} "
          f"(evaluation-noise std {noise:.3f}), judge {mean_judge_gain:+.3f}")
    assert mean_reward_gain >= MIN_MEAN_REWARD_GAIN, reward_gains
    assert mean_accuracy_gain >= MIN_MEAN_ACCURACY_GAIN, accuracy_gains
    assert mean_accuracy_gain >= 3 * noise, (accuracy_gains, noise)
    assert min(reward_gains) > MIN_SEED_REWARD_GAIN, reward_gains
    assert mean_judge_gain >= MIN_MEAN_JUDGE_GAIN, judge_gains
