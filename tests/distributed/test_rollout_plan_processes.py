"""Two real processes (gloo) with different global RNG states plan the same rollouts: SDE window start
and trained JAGG windows come from (seed, global step) only, never from the rank."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jagg_lightning.config import JAGGConfig, SamplingConfig
from jagg_lightning.training.rollout import plan_rollout

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SAMPLING = dict(num_steps=10, step_kind="cps", sde_window_size=6, sde_window_range=[0, 9])
JAGG = dict(window_size=2, window_fraction=0.5)

PLAN = textwrap.dedent('''
    import json, os, random, sys
    import torch
    import torch.distributed as dist
    from jagg_lightning.config import JAGGConfig, SamplingConfig
    from jagg_lightning.training.rollout import plan_rollout
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(1000 + rank)  # the global streams differ per process: the plan must not read them
    random.seed(1000 + rank)
    sampling, jagg, seed = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    sampling, jagg = SamplingConfig(seed=seed, **sampling), JAGGConfig(**jagg)
    plans = [[list(w.steps) for w in plan_rollout(sampling, jagg, step).windows] for step in range(40)]
    gathered = [None, None]
    dist.all_gather_object(gathered, plans)
    if rank == 0:
        with open(sys.argv[4], "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_plan_the_same_windows(tmp_path, rng_seed):
    seed = rng_seed % 100_000
    script, out = tmp_path / "plan.py", tmp_path / "plans.json"
    script.write_text(PLAN)
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(script), json.dumps(SAMPLING), json.dumps(JAGG), str(seed), str(out)]
    procs = [subprocess.Popen(args, env=env | {"RANK": str(r)}, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    rank0, rank1 = json.loads(out.read_text())
    assert rank0 == rank1
    # and equal to this (third) process's plan
    sampling, jagg = SamplingConfig(seed=seed, **SAMPLING), JAGGConfig(**JAGG)
    assert rank0 == [[list(w.steps) for w in plan_rollout(sampling, jagg, step).windows] for step in range(40)]
    # half of the 3 windows of W = 2 in a 6-step SDE window (max(1, int(1.5)) = 1), at varying places
    assert all(len(p) == 1 and len(p[0]) == 2 for p in rank0)
    assert len({tuple(p[0]) for p in rank0}) > 3
