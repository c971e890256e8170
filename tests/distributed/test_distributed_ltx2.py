"""LTX-2 on 2 CPU processes (gloo), one launch: DDP and FSDP2 on the twin (the joint audio+video latent, CFG and KL
on, JAGG routed, float64) give the one-process update on the same prompts; under FSDP2 every LoRA weight of the
transformer is a DTensor."""

import textwrap

import pytest

from launch import run_ranks
from helpers import sgd
from ltx2_twins import ltx2_twin_dir  # noqa: F401 (the shared fixture: the twin saved once)
from ltx2_twins import PROMPTS, module_for
from twin_ranks import assert_ranks_equal_one_process

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

RUNS = [("ltx2", "ddp"), ("ltx2", "fsdp2")]
OPTIONS = dict(dtype="float64", jagg_frac=0.5, window_size=2, num_steps=4, kl_beta=0.5, train_batch_size=2)

RANK_SCRIPT = textwrap.dedent('''
    import sys
    from test_distributed_ltx2 import OPTIONS, RUNS
    from helpers import sgd
    from ltx2_twins import PROMPTS, module_for
    from twin_ranks import train_on_ranks

    out, seed, twin_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    train_on_ranks(RUNS, lambda twin: module_for(twin_dir, seed, optimizer=sgd, **OPTIONS), lambda twin: PROMPTS, out)
''')


def test_ddp_and_fsdp2_equal_one_process_on_the_ltx2_twin(ltx2_twin_dir, tmp_path, rng_seed):
    seed = rng_seed % 10_000
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    run_ranks(script, str(tmp_path), str(seed), str(ltx2_twin_dir), timeout=300)
    # one prompt per rank vs two in one batch: float64 up to the float32 parts of LTX-2's forward (its RoPE, its
    # RMSNorm's variance, the time embedding)
    assert_ranks_equal_one_process(RUNS, lambda twin: module_for(ltx2_twin_dir, seed, optimizer=sgd, **OPTIONS),
                                   lambda twin: PROMPTS, tmp_path)
