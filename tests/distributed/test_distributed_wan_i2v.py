"""The image-to-video twins on 2 CPU processes (gloo), one launch: FSDP2 on Wan2.1 I2V (its CLIP image encoder
frozen, outside the shards) and on Wan2.2 TI2V-5B (expand_timesteps), and DDP on TI2V: each prompt's first frame
travels with it to its rank, and one update equals one process's on the same prompts (float64, CFG and KL on,
JAGG routed)."""

import textwrap

import pytest

from launch import run_ranks
from helpers import sgd
from twin_ranks import assert_ranks_equal_one_process
from wan_i2v_twins import PROMPTS, TWINS, build, module_for

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

RUNS = [("wan_i2v", "fsdp2"), ("wan22_ti2v", "fsdp2"), ("wan22_ti2v", "ddp")]
OPTIONS = dict(dtype="float64", jagg_frac=0.5, window_size=2, num_steps=4, kl_beta=0.5, train_batch_size=2)

RANK_SCRIPT = textwrap.dedent('''
    import sys
    from test_distributed_wan_i2v import OPTIONS, RUNS
    from helpers import sgd
    from twin_ranks import train_on_ranks
    from wan_i2v_twins import PROMPTS, module_for

    out, seed = sys.argv[1], int(sys.argv[2])
    train_on_ranks(RUNS, lambda twin: module_for(twin, f"{out}/{twin}", seed, optimizer=sgd, **OPTIONS),
                   lambda twin: PROMPTS, out, image_to_video={"wan_i2v"})  # Wan2.1 I2V's CLIP; TI2V has none
''')


def test_ddp_and_fsdp2_equal_one_process_on_the_image_to_video_twins(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    assert {twin for twin, _ in RUNS} == set(TWINS)
    for twin in TWINS:
        build(twin).save_pretrained(tmp_path / twin)
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    run_ranks(script, str(tmp_path), str(seed), timeout=300)
    # one prompt (and its first frame) per rank vs two in one batch: float64 up to the float32 time embedding
    assert_ranks_equal_one_process(RUNS, lambda twin: module_for(twin, tmp_path / twin, seed, optimizer=sgd, **OPTIONS),
                                   lambda twin: PROMPTS, tmp_path)
