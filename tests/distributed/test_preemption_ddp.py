"""Two processes under DDP, the stop signal reaching only rank 1 during its rollout: both ranks stop at the same
safe point (one all-reduce of the signal number decides), one checkpoint, exit status 143 on both; resuming on two
processes ends with the weights of an uninterrupted two-process run, bit for bit, on both ranks. The three runs
(uninterrupted, stopped, resumed) share one launch, one after the other, as tests/training/test_preemption.py runs
them in one process; a resume in new processes: test_dead_rank.py (torchrun's restart) and test_preemption_cli.py."""

import json
import random
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from helpers import fresh_seed
from launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

RANK = textwrap.dedent('''
    import json, sys
    import torch
    from safetensors.torch import save_file
    from test_preemption import run
    from preempt_faults import SignalAt
    root, seed, modes, step, forward = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    rank = int(__import__("os").environ["RANK"])
    for mode in modes.split(","):
        faults = [SignalAt(step, "rollout", forward)] if mode == "stop" and rank == 1 else []
        ckpt = f"{root}/stop/checkpoints/preempted.ckpt" if mode == "resume" else None
        folder = "stop" if mode == "resume" else mode
        rows, weights, stopped = run(seed, f"{root}/{folder}", faults=faults, ckpt_path=ckpt, devices=2, strategy="ddp")
        save_file({str(i): w.contiguous() for i, w in enumerate(weights)}, f"{root}/{mode}_rank{rank}.safetensors")
        print(json.dumps({"mode": mode, "rows": rows,
                          "stopped": None if stopped is None else [stopped.code, stopped.step, stopped.where]}))
    from jagg_lightning.distributed.collectives import end_process_group
    end_process_group()  # every rank finished: leave together (collectives.end_process_group)
''')


def test_a_signal_on_one_rank_stops_both_at_the_same_point(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    seed, step, forward = fresh_seed() % 10_000, random.randrange(1, 4), random.randrange(8)
    printed = [[json.loads(line) for line in out.splitlines() if line.startswith('{"mode"')]
               for out in run_ranks(script, str(tmp_path), str(seed), "full,stop,resume", str(step), str(forward),
                                    timeout=600)]
    results = {mode: [next(r for r in lines if r["mode"] == mode) for lines in printed]
               for mode in ("full", "stop", "resume")}
    stops = [r["stopped"] for r in results["stop"]]
    assert stops[0] == stops[1] and stops[0][0] == 143 and stops[0][1] == step and "rollout" in stops[0][2], stops
    for rank in (0, 1):
        assert results["stop"][rank]["rows"] + results["resume"][rank]["rows"] == results["full"][rank]["rows"]
        a = load_file(tmp_path / f"resume_rank{rank}.safetensors")
        b = load_file(tmp_path / f"full_rank{rank}.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in b)
