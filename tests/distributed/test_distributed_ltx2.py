"""LTX-2 on 2 CPU processes (gloo), one launch: DDP on the text-to-video twin and FSDP2 on the image-to-video twin (the
same transformer class; the joint audio+video latent, each prompt's first frame travelling to its rank; CFG and KL
on, JAGG routed, float64) give the one-process update on the same prompts; under FSDP2 every LoRA weight of the
transformer is a DTensor. (Context parallelism is refused for LTX-2:
tests/distributed/test_context_parallel_checks.py.)"""

import textwrap

import pytest

from family_cases import CONDITIONED_PROMPTS
from launch import run_ranks
from helpers import sgd
from ltx2_twins import ltx2_i2v_twin_dir, ltx2_twin_dir  # noqa: F401 (the shared fixtures: each twin saved once)
from ltx2_twins import PROMPTS, module_for
from twin_ranks import assert_ranks_equal_one_process

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

RUNS = [("ltx2", "ddp"), ("ltx2_i2v", "fsdp2")]
OPTIONS = dict(dtype="float64", jagg_frac=0.5, window_size=2, num_steps=4, kl_beta=0.5, train_batch_size=2)


def prompts(twin):
    return CONDITIONED_PROMPTS if twin == "ltx2_i2v" else PROMPTS


RANK_SCRIPT = textwrap.dedent('''
    import sys
    from test_distributed_ltx2 import OPTIONS, RUNS, prompts
    from helpers import sgd
    from ltx2_twins import module_for
    from twin_ranks import train_on_ranks

    out, seed, dirs = sys.argv[1], int(sys.argv[2]), dict(zip(("ltx2", "ltx2_i2v"), sys.argv[3:5]))
    train_on_ranks(RUNS, lambda twin: module_for(dirs[twin], seed, optimizer=sgd, **OPTIONS), prompts, out)
''')


def test_ddp_and_fsdp2_equal_one_process_on_the_ltx2_twins(ltx2_twin_dir, ltx2_i2v_twin_dir, tmp_path, rng_seed):
    seed = rng_seed % 10_000
    dirs = {"ltx2": ltx2_twin_dir, "ltx2_i2v": ltx2_i2v_twin_dir}
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    run_ranks(script, str(tmp_path), str(seed), str(ltx2_twin_dir), str(ltx2_i2v_twin_dir), timeout=300)
    # one prompt per rank vs two in one batch: float64 up to the float32 parts of LTX-2's forward (its RoPE, its
    # RMSNorm's variance, the time embedding)
    assert_ranks_equal_one_process(RUNS, lambda twin: module_for(dirs[twin], seed, optimizer=sgd, **OPTIONS), prompts,
                                   tmp_path)
