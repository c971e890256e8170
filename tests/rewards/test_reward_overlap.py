"""Scoring that overlaps sampling, multi-reward advantages and the reward-hacking watch (issue 21, 3-5).

Overlapped scoring (``reward_workers`` > 0: decode + score of micro-batch i in the reward pool while i + 1
samples) must give the sequential path's rewards, advantages and update bit for bit, unfused and fused.
Per-reward advantages are checked against a hand computation in plain Python; a monitor reward must never
change the update; the watch must fire on a constructed divergence and not without one.
"""

import math
import random
import statistics
import threading
import warnings

import lightning as L
import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.callbacks import RewardHackingWatch
from jagg_lightning.data import PromptDataModule
from jagg_lightning.method.grpo import combined_advantages
from jagg_lightning.rewards import (
    JpegCompressibility, JpegIncompressibility, MonitoredReward, Reward, WeightedReward,
)

from helpers import randomize_lora_b, tiny_policy_config

PROMPTS = ["a red cat", "a blue dog", "a green boat"]
K = 3


class Brightness(Reward):
    """A real, prompt-free reward: mean image brightness. Notes the thread that scored it."""

    name = "brightness"

    def __init__(self):
        super().__init__()
        self.threads = set()
        self.freeze()

    def score(self, images, prompts):
        self.threads.add(threading.current_thread().name)
        return images.mean(dim=(1, 2, 3))


def build(seed, reward, workers=0, fused=False, multi_reward="weighted_sum", rollout_batch_size=3, jagg_frac=1.0):
    module = JAGGModule(
        tiny_policy_config(),
        SamplingConfig(num_steps=5, group_size=K, rollout_batch_size=rollout_batch_size),
        GRPOConfig(train_batch_size=3, adv_std="group", multi_reward=multi_reward, max_grad_norm=None),
        JAGGConfig(window_size=2, jagg_frac=jagg_frac, fused_rollout=fused),
        reward=reward,
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),  # the update is minus the gradient
        reward_workers=workers,
        seed=seed,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def fit_once(module, steps=1, callbacks=()):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    before = [p.detach().clone() for p in module.policy.lora_parameters()]
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=len(PROMPTS), shuffle=False))
    update = [p.detach() - b for p, b in zip(module.policy.lora_parameters(), before)]
    return trainer, update


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_overlapped_scoring_gives_the_sequential_step_bit_for_bit(fused, rng_seed):
    seed = rng_seed % 10_000
    runs = {}
    for workers in (0, 2):
        bright = Brightness()
        module = build(seed, WeightedReward([bright, JpegCompressibility()], [1.0, 0.01]), workers, fused)
        trainer, update = fit_once(module)
        runs[workers] = (trainer.callback_metrics, module.last_rollout.advantages, update, bright.threads)
    (m0, a0, u0, t0), (m2, a2, u2, t2) = runs[0], runs[2]
    assert t0 == {threading.main_thread().name} and t2 and all(t.startswith("jagg-reward") for t in t2)
    for key in ("train/reward_mean", "train/reward/brightness", "train/reward/jpeg_compressibility"):
        assert torch.equal(m0[key], m2[key]), key
    assert torch.equal(a0, a2) and a0.abs().sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(u0, u2)) and any(a.abs().sum() > 0 for a in u0)


def test_reward_pool_is_bounded_and_names_failures(rng_seed):
    """The pool holds at most 2 x workers unfinished jobs; a failing reward in a worker still stops the step
    with the reward's name."""
    module = build(rng_seed % 10_000, "jpeg_compressibility", workers=1, rollout_batch_size=1)
    started, release = threading.Semaphore(0), threading.Event()

    class Gate(Reward):
        name = "gate"

        def score(self, images, prompts):
            started.release()
            release.wait(30)
            if prompts[0] == "boom":
                raise RuntimeError("scorer exploded")
            return images.mean(dim=(1, 2, 3))

    gate, final = Gate().freeze(), torch.zeros(1, *module.policy.latent_shape)
    jobs = [module.sampler.score_later(gate, final, ["a"]) for _ in range(2)]  # 1 running + 1 queued
    assert started.acquire(timeout=30)
    blocked = threading.Thread(target=lambda: jobs.append(module.sampler.score_later(gate, final, ["boom"])))
    blocked.start()
    blocked.join(0.5)
    assert blocked.is_alive() and len(jobs) == 2  # the third waits for a free place
    release.set()
    blocked.join(30)
    with pytest.raises(RuntimeError, match="reward gate .*scorer exploded"):
        jobs[2].result(30)
    module.sampler.close()


def hand_group_normalised(values, eps):
    """(r - group mean) / (population std of the group + eps), plain Python; exactly 0 for a tied group."""
    out = []
    for i in range(0, len(values), K):
        group = values[i : i + K]
        if len(set(group)) == 1:
            out += [0.0] * K
            continue
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        out += [(r - mean) / (std + eps) for r in group]
    return out


def test_per_reward_advantages_equal_a_hand_computation(rng_seed):
    eps, clip = 1e-4, 1.5
    # hand-made: reward "ocr" spreads 0.02 inside its groups, "aesthetic" 2.0; the second group ties on "ocr"
    ocr = [0.90, 0.92, 0.94, 0.50, 0.50, 0.50]
    aesthetic = [5.0, 7.0, 6.0, 4.0, 6.0, 4.0]
    weights = {"ocr": 1.0, "aesthetic": 0.5}
    a_ocr, a_aes = hand_group_normalised(ocr, eps), hand_group_normalised(aesthetic, eps)
    # first group by hand: ocr -> (-0.02, 0, 0.02) / (0.01633 + eps); aesthetic -> (-1, 1, 0) / (0.8165 + eps)
    assert a_ocr[0] == pytest.approx(-0.02 / (math.sqrt(2 / 3) * 0.02 + eps), rel=1e-12)
    expected = [max(-clip, min(clip, 1.0 * o + 0.5 * a)) for o, a in zip(a_ocr, a_aes)]
    components = {"ocr": torch.tensor(ocr, dtype=torch.float64), "aesthetic": torch.tensor(aesthetic, dtype=torch.float64)}
    total = components["ocr"] + 0.5 * components["aesthetic"]
    adv, parts = combined_advantages(total, components, weights, K, "per_reward", "group", eps, clip)
    assert adv.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert parts["aesthetic"].tolist() == pytest.approx([0.5 * a for a in a_aes], rel=1e-12)
    # the weighted sum instead: the large-spread reward drowns the small one (its share of the signal)
    ws, ws_parts = combined_advantages(total, components, weights, K, "weighted_sum", "group", eps, clip)
    summed = hand_group_normalised(total.tolist(), eps)
    assert ws.tolist() == pytest.approx([max(-clip, min(clip, s)) for s in summed], rel=1e-12, abs=1e-12)
    unclipped = (ws_parts["ocr"] + ws_parts["aesthetic"]).tolist()
    assert unclipped == pytest.approx(summed, rel=1e-9, abs=1e-12)  # the parts add up to the advantage
    assert ws_parts["ocr"].abs().mean() < 0.05 * ws_parts["aesthetic"].abs().mean()
    share = parts["ocr"].abs().mean() / (parts["ocr"].abs().mean() + parts["aesthetic"].abs().mean())
    assert share > 0.3  # per reward: a fair share of the signal
    # a fresh random batch, global std this time
    rnd = random.Random(rng_seed)
    r1, r2 = [rnd.gauss(0, 0.01) for _ in range(12)], [rnd.gauss(3, 2) for _ in range(12)]
    w = {"a": rnd.uniform(0.5, 2), "b": rnd.uniform(0.5, 2)}
    comps = {"a": torch.tensor(r1, dtype=torch.float64), "b": torch.tensor(r2, dtype=torch.float64)}
    adv, _ = combined_advantages(w["a"] * comps["a"] + w["b"] * comps["b"], comps, w, K, "per_reward", "global", eps, 5.0)
    hand = []
    for r, n in ((r1, "a"), (r2, "b")):
        std = statistics.pstdev(r)
        hand.append([w[n] * (x - statistics.fmean(r[i // K * K : i // K * K + K])) / (std + eps) for i, x in enumerate(r)])
    assert adv.tolist() == pytest.approx([max(-5, min(5, x + y)) for x, y in zip(*hand)], rel=1e-10, abs=1e-12)


def test_per_reward_mode_refuses_unknown_weights(rng_seed):
    with pytest.raises(ValueError, match="grpo.multi_reward"):
        GRPOConfig(multi_reward="mean")

    class Served(Reward):  # reports components it does not weight, as a served WeightedReward does
        name = "served"

        def score_with_components(self, images, prompts):
            a, b = images.mean(dim=(1, 2, 3)), images.std(dim=(1, 2, 3))
            return a + b, {"a": a, "b": b}

    module = build(rng_seed % 10_000, Served(), multi_reward="per_reward")
    with pytest.raises(ValueError, match="grpo.multi_reward 'per_reward' needs the weight of every reward"):
        fit_once(module)


def test_a_monitor_never_changes_the_update(rng_seed):
    """per_reward (a monitor must get no weight) with the monitor scored in the reward pool; the per-component
    advantage statistics are logged for the trained rewards only."""
    seed = rng_seed % 10_000
    updates, metrics = [], None
    for monitored in (False, True):
        trained = WeightedReward([Brightness(), JpegCompressibility()], [1.0, 0.01])
        reward = MonitoredReward(trained, [JpegIncompressibility(), Brightness()]) if monitored else trained
        module = build(seed, reward, multi_reward="per_reward", workers=1 if monitored else 0)
        trainer, update = fit_once(module)
        updates.append((update, module.last_rollout.advantages))
        metrics = trainer.callback_metrics
    (u0, a0), (u1, a1) = updates
    assert torch.equal(a0, a1) and a0.abs().sum() > 0 and all(torch.equal(a, b) for a, b in zip(u0, u1))
    for name in ("monitor/jpeg_incompressibility", "monitor/brightness"):
        assert f"train/reward/{name}" in metrics and f"train/advantage/{name}/share" not in metrics
    assert float(metrics["train/reward/monitor/brightness"]) == float(metrics["train/reward/brightness"])
    for name in ("brightness", "jpeg_compressibility"):
        for stat in ("share", "std", "corr"):
            assert torch.isfinite(metrics[f"train/advantage/{name}/{stat}"]), (name, stat)
    shares = sum(float(metrics[f"train/advantage/{n}/share"]) for n in ("brightness", "jpeg_compressibility"))
    assert shares == pytest.approx(1.0, abs=1e-6)
    # and on validation
    module.evaluation.num_steps, module.evaluation.grid_prompts = 2, 0
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, PromptDataModule(prompts=PROMPTS, val_prompts=PROMPTS[:2], batch_size=2))
    assert "val/reward/monitor/jpeg_incompressibility" in trainer.callback_metrics


def test_watch_fires_on_a_constructed_divergence_only(rng_seed):
    rnd = random.Random(rng_seed)
    watch = RewardHackingWatch(margin=0.5, window=3)
    base = rnd.uniform(-2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):
            trend = step / 11  # trained reward +2 over the run; "judge" -1.5, "steady" -0.3 (within the margin)
            noise = rnd.uniform(-0.01, 0.01)
            watch.observe({"train/reward_mean": torch.tensor(base + 2 * trend + noise),
                           "train/reward/monitor/judge": torch.tensor(5 - 1.5 * trend + noise),
                           "train/reward/monitor/steady": torch.tensor(1 - 0.3 * trend)}, step)
    fired = [str(w.message) for w in caught if "reward hacking" in str(w.message)]
    assert len(fired) == 1 and "monitor judge fell" in fired[0], fired
    assert [a[1] for a in watch.alerts] == ["judge"]
    # both falling (the policy just got worse): no warning
    quiet = RewardHackingWatch(margin=0.5, window=2)
    for step in range(8):
        quiet.observe({"train/reward_mean": torch.tensor(-step * 1.0), "train/reward/monitor/judge": torch.tensor(-step * 1.0)},
                      step)
    assert quiet.alerts == []
    with pytest.raises(ValueError, match="RewardHackingWatch.margin"):
        RewardHackingWatch(margin=0)


def test_watch_in_a_real_run_fires_exactly_when_the_monitor_diverges(rng_seed):
    """Train JPEG compressibility (-kB) and monitor JPEG incompressibility (+kB): the monitor falls by exactly
    what the trained reward gains, so the watch must fire iff the trained reward rose by more than the margin."""
    module = build(rng_seed % 10_000, MonitoredReward(JpegCompressibility(), [JpegIncompressibility()]), jagg_frac=0.5)
    margin = 1e-3
    watch = RewardHackingWatch(margin=margin, window=1)
    fit_once(module, steps=3, callbacks=[watch])
    trained, judge = watch.history["reward_mean"], watch.history["jpeg_incompressibility"]
    assert len(trained) == 3 and trained == pytest.approx([-j for j in judge], rel=1e-6)
    rose = [trained[i] - trained[0] > margin for i in range(1, 3)]
    assert bool(watch.alerts) == any(rose)
