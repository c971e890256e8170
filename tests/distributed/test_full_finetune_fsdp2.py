"""Full fine-tuning on 2 CPU processes (gloo), float64 unless said: DDP and FSDP2 give the one-process update
(DDP with one gradient all-reduce per update), a distributed (sharded) checkpoint resumes bit for bit on the same
world size (3 + 3 steps = 6 straight, EMA, AdamW state, RNG) and loads on another (1 process), and under FSDP2
mixed precision the masters and AdamW state are float32 while every forward ran in bf16. The rank code:
tests/support/full_ft_ranks.py.

Both tests read one module-scoped set of runs (one fresh seed): a 2-process launch that runs DDP, bf16 and FSDP2
(with its resume) one after another, and a 1-process launch that runs the one-process reference (snapshots after 2
and 6 steps) and continues FSDP2's 2-rank checkpoint. Each launch pays the imports once."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import run_ranks
from helpers import fresh_seed, rel_error

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "full_ft_ranks.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(folder, seed, what each 2-rank process printed): every run both tests read."""
    folder, seed = tmp_path_factory.mktemp("full_ft"), fresh_seed() % 10_000
    print(f"seed={seed}")
    printed = run_ranks(SCRIPT, str(folder), str(seed), "ddp", "bf16", "fsdp", timeout=600)
    assert "reshard ok" in run_ranks(SCRIPT, str(folder), str(seed), "single", "reshard", world=1, timeout=300)[0]
    return folder, seed, printed


@pytest.fixture
def full_ft(runs, request):
    folder, seed, printed = runs
    request.node.user_properties.append(("rng_seed", seed))  # a failure prints the line that replays the seed
    return folder, printed


def update(tmp, name, start="single_start"):
    begin, end = load_file(tmp / f"{start}.safetensors"), load_file(tmp / f"{name}.safetensors")
    names = sorted(begin)
    return [end[n] - begin[n] for n in names]


def test_ddp_equals_one_process_and_fsdp2_bf16_mixed_precision(full_ft):
    tmp_path, printed = full_ft
    assert "ddp ok" in printed[0] and "bf16 ok" in printed[0]
    single = update(tmp_path, "single_step2")
    assert sum(float(u.abs().sum()) for u in single) > 0 and len(single) > 20  # every weight
    errors = {"ddp vs one process": rel_error(update(tmp_path, "ddp_step2"), single)}
    start = load_file(tmp_path / "single_start.safetensors")
    assert all(torch.equal(start[n], t) for n, t in load_file(tmp_path / "ddp_start.safetensors").items())
    bf16 = update(tmp_path, "bf16_end", "bf16_start")
    assert all(torch.isfinite(u).all() for u in bf16) and sum(float(u.abs().sum()) for u in bf16) > 0
    print("relative update differences:", errors)
    assert max(errors.values()) < 1e-6, errors  # float64, up to the float32 timestep embedding (distributed.md)


def test_fsdp2_sharded_checkpoint_resumes_bit_for_bit_and_reshards(full_ft):
    tmp_path, printed = full_ft
    assert "fsdp ok" in printed[0]
    checkpoint = tmp_path / "ckpt" / "step=3.ckpt"
    assert checkpoint.is_dir() and len(list(checkpoint.glob("*.distcp"))) == 2  # each rank wrote its shards
    fsdp6, resumed6 = load_file(tmp_path / "fsdp_step6.safetensors"), load_file(tmp_path / "resumed_step6.safetensors")
    assert all(torch.equal(fsdp6[n], resumed6[n]) for n in fsdp6)  # 3 + 3 = 6, bit for bit
    step3 = load_file(tmp_path / "fsdp_step3.safetensors")
    for name in ("resumed_start", "reshard_start"):  # what each world size loaded is what was written
        loaded = load_file(tmp_path / f"{name}.safetensors")
        assert all(torch.equal(step3[n], loaded[n]) for n in step3), name
    single = update(tmp_path, "single_step6")
    errors = {"fsdp2 vs one process, 6 steps": rel_error(update(tmp_path, "fsdp_step6"), single),
              "2-rank checkpoint continued on 1 rank vs one process": rel_error(update(tmp_path, "reshard_step6"), single)}
    print("relative update differences:", errors)
    assert max(errors.values()) < 1e-6, errors
