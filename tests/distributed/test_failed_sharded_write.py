"""A distributed (sharded) FSDP2 checkpoint whose write fails on one rank part-way (a real EFBIG on rank 1, as its
disk filling would) fails on every rank with one error naming the checkpoint -- no rank left waiting -- and leaves
every kept checkpoint folder (``step=1.ckpt``, ``last.ckpt``) byte for byte, with no temporary folder; training
resumes from it. The rank code: tests/support/write_fault_ranks.py."""

import json
from pathlib import Path

import pytest

from launch import run_ranks
from write_faults import digests

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "write_fault_ranks.py"


def test_sharded_checkpoint_failing_on_one_rank_keeps_the_previous_and_resumes(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    outputs = run_ranks(SCRIPT, "fail", str(tmp_path), str(seed), timeout=300)
    failed = tmp_path / "ckpt" / "step=2.ckpt"
    for rank, out in enumerate(outputs):
        assert f"WriteError: could not write {str(failed)!r}" in out, (rank, out[-2000:])
    assert "File too large" in outputs[1]
    recorded = json.loads((tmp_path / "record.json").read_text())
    assert {n.split("/")[0] for n in recorded} == {"step=1.ckpt", "last.ckpt"}
    assert digests(tmp_path / "ckpt") == recorded  # nothing changed, nothing added (no temporary folder)
    assert not failed.exists()
    out = run_ranks(SCRIPT, "resume", str(tmp_path), str(seed), world=1, timeout=300)[0]
    assert "start step 1" in out and "resumed ok" in out
