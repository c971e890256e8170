"""The HunyuanVideo 1.5 twins on 2 CPU processes (gloo), one launch: FSDP2 on text-to-video and image-to-video (the
SigLIP image encoder frozen, outside the shards) and DDP on image-to-video: each prompt (and its first frame) travels
to its rank, and one update equals one process's on the same prompts (float64, CFG and KL on, JAGG routed).
Context parallelism is refused for this family (no ``_cp_plan`` in diffusers' transformer)."""

import textwrap

import pytest

from launch import run_ranks
from helpers import sgd
from hunyuan_video15_twins import hunyuan_twin_dirs  # noqa: F401 (the shared fixture: both twins saved once)
from hunyuan_video15_twins import TWINS, module_for, prompts
from twin_ranks import assert_ranks_equal_one_process

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

RUNS = [("hunyuan_video15", "fsdp2"), ("hunyuan_video15_i2v", "fsdp2"), ("hunyuan_video15_i2v", "ddp")]
OPTIONS = dict(dtype="float64", jagg_frac=0.5, window_size=2, num_steps=4, kl_beta=0.5, train_batch_size=2)

RANK_SCRIPT = textwrap.dedent('''
    import sys
    from test_distributed_hunyuan_video15 import OPTIONS, RUNS
    from helpers import sgd
    from hunyuan_video15_twins import module_for, prompts
    from twin_ranks import train_on_ranks

    out, seed, twins = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    train_on_ranks(RUNS, lambda twin: module_for(twin, f"{twins}/{twin}", seed, optimizer=sgd, **OPTIONS), prompts,
                   out, image_to_video={"hunyuan_video15_i2v"})  # image-to-video's SigLIP
''')


def test_ddp_and_fsdp2_equal_one_process_on_the_hunyuan_video15_twins(hunyuan_twin_dirs, tmp_path, rng_seed):
    seed = rng_seed % 10_000
    assert {twin for twin, _ in RUNS} == set(TWINS)
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    run_ranks(script, str(tmp_path), str(seed), str(hunyuan_twin_dirs[RUNS[0][0]].parent), timeout=300)
    # one prompt per rank vs two in one batch (another count of padding columns dropped): float64 rounding
    assert_ranks_equal_one_process(
        RUNS, lambda twin: module_for(twin, hunyuan_twin_dirs[twin], seed, optimizer=sgd, **OPTIONS), prompts, tmp_path)
