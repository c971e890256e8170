"""FSDP2 on the twins of the families added after the SD3 FSDP2 test (FLUX.2 [klein], Z-Image, FLUX.1 Kontext), and
DDP on the editing twin (Kontext: each prompt's source image travels with it to its rank): one update on 2 CPU
processes (gloo; FSDP2: fully_shard per block) equals one process's on the same prompts (float64, KL on, JAGG
routed)."""

import textwrap

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from jagg_lightning.data import PromptDataModule

from launch import run_ranks
from family_cases import CASES
from helpers import rel_error, sgd
from family_cases import module_for

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

NAMES = ["flux2", "z_image", "flux_kontext"]  # under FSDP2
RUNS = [(name, "fsdp2") for name in NAMES] + [("flux_kontext", "ddp")]
OPTIONS = dict(dtype="float64", jagg_frac=0.5, window_size=2, kl_beta=0.5, train_batch_size=2)

RANK_SCRIPT = textwrap.dedent('''
    import sys
    import lightning as L
    import torch
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from jagg_lightning.data import PromptDataModule
    from lightning.pytorch.strategies import DDPStrategy
    from jagg_lightning.strategies import FSDP2Strategy
    from family_cases import CASES
    from family_cases import module_for
    from test_fsdp2_families import OPTIONS, RUNS
    from helpers import sgd

    out, seed = sys.argv[1], int(sys.argv[2])
    for name, kind in RUNS:
        case = next(c for c in CASES if c.name == name)
        module = module_for(case, f"{out}/{case.name}", seed, optimizer=sgd, **OPTIONS)
        strategy = (FSDP2Strategy(process_group_backend="gloo") if kind == "fsdp2" else
                    DDPStrategy(process_group_backend="gloo"))
        trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy=strategy,
                            logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(module, PromptDataModule(prompts=case.prompts, batch_size=1, shuffle=False))
        lora = module.policy.lora_parameters()
        assert lora and all(isinstance(p, DTensor) == (kind == "fsdp2") for p in lora)  # really sharded, or not
        weights = {n: (p.full_tensor() if kind == "fsdp2" else p).detach().contiguous()
                   for n, p in module.named_parameters() if p.requires_grad}
        if trainer.global_rank == 0:
            save_file(weights, f"{out}/{case.name}_{kind}.safetensors")
    from jagg_lightning.distributed.collectives import end_process_group
    end_process_group()  # every rank finished: leave together (collectives.end_process_group)
''')


def test_fsdp2_update_equals_one_process_on_the_new_twins(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    cases = [c for c in CASES if c.name in NAMES]
    assert sorted(c.name for c in cases) == sorted(NAMES)
    for case in cases:
        case.build(0, torch.float32).save_pretrained(tmp_path / case.name)
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    run_ranks(script, str(tmp_path), str(seed), timeout=300)
    for case in cases:
        single = module_for(case, tmp_path / case.name, seed, optimizer=sgd, **OPTIONS)
        initial = {n: p.detach().clone() for n, p in single.named_parameters() if p.requires_grad}
        L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(single, PromptDataModule(prompts=case.prompts, batch_size=2,
                                                                            shuffle=False))
        names = sorted(initial)
        update = [single.get_parameter(n).detach() - initial[n] for n in names]
        assert sum(float(u.abs().sum()) for u in update) > 0, case.name
        for kind in [k for n, k in RUNS if n == case.name]:
            parallel = load_file(tmp_path / f"{case.name}_{kind}.safetensors")
            assert sorted(parallel) == names
            # different batch layouts (one prompt per rank): float64 up to the float32 timestep embedding
            error = rel_error([parallel[n] - initial[n] for n in names], update)
            assert error < 1e-6, (case.name, kind, error)

