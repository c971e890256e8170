"""Two CPU processes under DDP, a NaN on rank 1 only: both ranks skip the same update (identical weights after
it, one all-reduce of the guard's rows decides), and the stop names rank 1's samples."""

import json
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess]

RANKS = textwrap.dedent('''
    import json, os, sys
    import lightning as L
    import torch
    from safetensors.torch import save_file
    from jagg_lightning.data import PromptDataModule
    from jagg_lightning.faults.nonfinite import NonFiniteError
    from faults import PoisonedReward, StepCounter, poison_gradient
    from test_nonfinite import PROMPTS, StateAfterEachStep, module_for
    out, seed, poisoned = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])

    def trainer(steps, callbacks):
        return L.Trainer(max_steps=steps, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[StepCounter(), *callbacks])

    data = lambda: PromptDataModule(prompts=PROMPTS, batch_size=1, shuffle=False)
    # 1. a NaN reward for rank 1's samples `poisoned` at step 1: skipped on both ranks, step 2 trains
    module = module_for(seed, max_nonfinite_in_a_row=3)
    if rank == 1:
        module.reward_fn = PoisonedReward(module, {1: poisoned}, float("nan"))
    states = StateAfterEachStep()
    trainer(3, [states]).fit(module, data())
    save_file({f"{step}.{i}": w.contiguous() for step, s in enumerate(states.states) for i, w in enumerate(s["weights"])},
              f"{out}/rank{rank}.safetensors")
    record = {"skipped": [s["skipped"] for s in states.states]}
    # 2. a NaN gradient on rank 1 only at step 0, max_nonfinite_in_a_row 1: both ranks stop, naming rank 1
    module = module_for(seed, max_nonfinite_in_a_row=1)
    if rank == 1:
        poison_gradient(module, {0}, float("nan"))
    try:
        trainer(2, []).fit(module, data())
    except NonFiniteError as err:
        record["stop"] = str(err)
    print(json.dumps(record))
    from jagg_lightning.distributed.collectives import end_process_group
    end_process_group()  # every rank finished: leave together (collectives.end_process_group)
''')


def test_a_fault_on_rank_1_is_skipped_alike_and_named(tmp_path, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    poisoned = sorted(torch.randperm(3, generator=gen)[: 1 + rng_seed % 2].tolist())
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    outputs = run_ranks(script, str(tmp_path), str(rng_seed % 10_000), json.dumps(poisoned), timeout=120)
    records = [json.loads(o.strip().splitlines()[-1]) for o in outputs]
    weights = [load_file(tmp_path / f"rank{r}.safetensors") for r in (0, 1)]

    assert [r["skipped"] for r in records] == [[0, 1, 1]] * 2  # both ranks counted the same skip
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name  # identical on both ranks, every step
    for i in range(sum(k.startswith("0.") for k in weights[0])):
        assert torch.equal(weights[0][f"0.{i}"], weights[0][f"1.{i}"])  # the skipped update moved nothing
    assert any(not torch.equal(weights[0][f"1.{i}"], weights[0][f"2.{i}"]) for i in range(len(weights[0]) // 3))

    # DistributedSampler without shuffle: rank 1's prompt at step 0 is prompt 1; only its gradient was non-finite
    stops = [r.get("stop") for r in records]
    assert stops[0] == stops[1] and stops[0] is not None  # both ranks stopped with the same line
    assert "at step 0: a non-finite gradient" in stops[0]
    assert "rank 1: prompt 1 sample 0, prompt 1 sample 1, prompt 1 sample 2 (3 samples)" in stops[0]
    assert "rank 0" not in stops[0]
