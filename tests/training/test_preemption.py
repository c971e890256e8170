"""A stop signal (SIGTERM, SIGUSR1) during fit: the run stops at the next safe point with a checkpoint, the adapter as
``lora/last`` (never ``final``) and exit status 128 + signal; resuming from that checkpoint ends with the same LoRA
weights, bit for bit, as a run never stopped -- whether the signal came during the rollout, the reward or the update,
fused or unfused, or at a random moment (issue 31)."""

import os
import random
import signal
import threading
import time

import lightning as L
import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, PromptDataModule, SamplingConfig
from jagg_lightning.callbacks import LoRAExport, Preemption
from jagg_lightning.faults.preemption import Preempted, active

from helpers import fresh_seed, tiny_policy_config
from preempt_faults import SignalAt, SignalingReward
from test_resume_kinds import Seen

PROMPTS = ["a cat", "a dog", "a tree", "a boat", "a red sun", "a hill"]
STEPS = 5


def run(seed, root, *, fused=False, reward=None, faults=(), ckpt_path=None, steps=STEPS, **trainer_args):
    """(rows seen, final LoRA weights, the exception that stopped fit or None) of a tiny fit under Preemption."""
    module = JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=2),
                        GRPOConfig(train_batch_size=2 if not fused else 4, adv_std="group"), JAGGConfig(window_size=2, fused_rollout=fused),
                        reward=reward or SignalingReward(), optimizer=lambda p: torch.optim.AdamW(p, lr=0.05), seed=seed)
    seen = Seen()  # before Preemption: a stop at the step's end still records the finished step
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                        callbacks=[seen, *faults, LoRAExport(), Preemption()], **trainer_args)
    stopped = None
    try:
        trainer.fit(module, PromptDataModule(prompts=PROMPTS[:4], batch_size=2, seed=seed), ckpt_path=ckpt_path)
    except Preempted as err:
        stopped = err
    assert active() is None, "the stop handlers outlived fit"
    return seen.rows, [p.detach().clone() for p in module.policy.lora_parameters()], stopped


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    seed = fresh_seed() % 10_000
    out = {}
    for fused in (False, True):
        rows, weights, stopped = run(seed, tmp_path_factory.mktemp("full"), fused=fused)
        assert stopped is None
        out[fused] = rows, weights
    return seed, out


def stop_and_resume(seed, tmp_path, fused, **fault):
    rows, _, stopped = run(seed, tmp_path, fused=fused, **fault)
    assert stopped is not None, "the signal did not stop the run"
    ckpt = tmp_path / "checkpoints" / "preempted.ckpt"
    assert ckpt.is_file() and (tmp_path / "lora" / "last").is_dir() and not (tmp_path / "lora" / "final").exists()
    more, weights, again = run(seed, tmp_path / "resumed", fused=fused, ckpt_path=str(ckpt))
    assert again is None
    return stopped, rows + more, weights


def assert_same(result, reference):
    rows, weights = result
    full_rows, full_weights = reference
    assert rows == full_rows
    assert all(torch.equal(a, b) for a, b in zip(weights, full_weights))


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_signal_during_the_rollout_abandons_the_step(fused, uninterrupted, tmp_path):
    seed, full = uninterrupted
    step, forward = random.randrange(1, STEPS - 1), random.randrange(8)  # 2 micro-batches x 4 sampling steps
    stopped, rows, weights = stop_and_resume(seed, tmp_path, fused, faults=[SignalAt(step, "rollout", forward)])
    assert stopped.code == 143 and stopped.step == step and "rollout micro-batch" in stopped.where, stopped.where
    assert_same((rows, weights), full[fused])


def test_signal_while_the_reward_scores(uninterrupted, tmp_path):
    seed, full = uninterrupted
    call = random.randrange(2, 2 * (STEPS - 1))  # 2 reward calls (micro-batches) a step
    stopped, rows, weights = stop_and_resume(seed, tmp_path, False, reward=SignalingReward(at_call=call))
    assert stopped.step == call // 2 and "rollout micro-batch" in stopped.where
    assert_same((rows, weights), full[False])


def test_signal_during_the_update_finishes_the_step(uninterrupted, tmp_path):
    seed, full = uninterrupted
    step = random.randrange(0, STEPS - 1)
    stopped, rows, weights = stop_and_resume(seed, tmp_path, False,
                                             faults=[SignalAt(step, "update", 0, int(signal.SIGUSR1))])
    # the update had begun: the step is finished and the stop comes at its end (SIGUSR1: 128 + 10)
    assert stopped.code == 138 and stopped.step == step + 1 and stopped.where == "the end of the step"
    assert_same((rows, weights), full[False])


def test_signal_at_a_random_moment(uninterrupted, tmp_path):
    """SIGTERM from a timer anywhere in a whole fit (model build and teardown included). Outside training the
    test's own handler takes it (Preemption's are installed only while it trains) and the run ends normally."""
    seed, full = uninterrupted
    started = time.perf_counter()
    run(seed, tmp_path / "timing")
    delay = random.uniform(0.05, 1.0) * (time.perf_counter() - started)
    outside = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: outside.append(signum))
    timer = threading.Timer(delay, lambda: signal.raise_signal(signal.SIGTERM))
    timer.start()
    try:
        rows, weights, stopped = run(seed, tmp_path / "first")
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGTERM, previous)
    if stopped is None:  # before training, after it, or during the last step (which ends fit normally)
        assert_same((rows, weights), full[False])
        return
    assert not outside
    more, weights, _ = run(seed, tmp_path / "resumed", ckpt_path=str(tmp_path / "first/checkpoints/preempted.ckpt"))
    assert_same((rows + more, weights), full[False])


def test_no_signal_no_checkpoint_and_handlers_restored(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    _, _, stopped = run(fresh_seed() % 10_000, tmp_path, steps=2)
    assert stopped is None and not (tmp_path / "checkpoints").exists() and (tmp_path / "lora" / "final").is_dir()
    assert signal.getsignal(signal.SIGTERM) == before


def test_bad_signal_names_the_field():
    with pytest.raises(ValueError, match="signals: 'SIGNOPE' is not a signal name"):
        Preemption(signals=["SIGNOPE"])


def test_slurm_requeue_signal_requeues_and_the_job_resumes_by_itself(uninterrupted, tmp_path, monkeypatch):
    """Under SLURM (Lightning's SLURMEnvironment, auto_requeue): SIGUSR1 writes Lightning's hpc_ckpt_1.ckpt, rank 0
    runs `scontrol requeue <job>` (here a recording stand-in for the scheduler's command), and the requeued job --
    the same command, no --ckpt_path -- resumes from it to the weights of a run never stopped."""
    seed, full = uninterrupted
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "4242",
                       "SLURM_JOB_NAME": "grpo", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                       "SLURM_NODELIST": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    call = random.randrange(2, 2 * (STEPS - 1))
    rows, _, stopped = run(seed, tmp_path, reward=SignalingReward(at_call=call, signum=int(signal.SIGUSR1)))
    assert stopped is not None and stopped.code == 138
    assert (tmp_path / "hpc_ckpt_1.ckpt").is_file() and not (tmp_path / "checkpoints").exists()
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    more, weights, again = run(seed, tmp_path)  # the requeued job: the same call, in the same folder
    assert again is None
    assert_same((rows + more, weights), full[False])
