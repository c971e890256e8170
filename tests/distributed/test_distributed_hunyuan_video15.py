"""The HunyuanVideo 1.5 twins on 2 CPU processes (gloo), one launch: FSDP2 on text-to-video and image-to-video (the
SigLIP image encoder frozen, outside the shards) and DDP on image-to-video: each prompt (and its first frame) travels
to its rank, and one update equals one process's on the same prompts (float64, CFG and KL on, JAGG routed).
Context parallelism is refused for this family (no ``_cp_plan`` in diffusers' transformer)."""

import textwrap

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from jagg_lightning.data import PromptDataModule

from launch import run_ranks
from helpers import rel_error, sgd
from hunyuan_video15_twins import hunyuan_twin_dirs  # noqa: F401 (the shared fixture: both twins saved once)
from hunyuan_video15_twins import TWINS, module_for, prompts

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

RUNS = [("hunyuan_video15", "fsdp2"), ("hunyuan_video15_i2v", "fsdp2"), ("hunyuan_video15_i2v", "ddp")]
OPTIONS = dict(dtype="float64", jagg_frac=0.5, window_size=2, num_steps=4, kl_beta=0.5, train_batch_size=2)

RANK_SCRIPT = textwrap.dedent('''
    import sys
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from jagg_lightning.data import PromptDataModule
    from jagg_lightning.strategies import FSDP2Strategy
    from test_distributed_hunyuan_video15 import OPTIONS, RUNS
    from helpers import sgd
    from hunyuan_video15_twins import module_for, prompts

    out, seed, twins = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    for twin, kind in RUNS:
        module = module_for(twin, f"{twins}/{twin}", seed, optimizer=sgd, **OPTIONS)
        strategy = (FSDP2Strategy(process_group_backend="gloo") if kind == "fsdp2" else
                    DDPStrategy(process_group_backend="gloo"))
        trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(module, PromptDataModule(prompts=prompts(twin), batch_size=1, shuffle=False))
        lora = module.policy.lora_parameters()
        assert lora and all(isinstance(p, DTensor) == (kind == "fsdp2") for p in lora)  # really sharded, or not
        encoder = getattr(module.policy, "image_encoder", None)  # image-to-video's SigLIP
        assert (encoder is not None) == twin.endswith("i2v")
        assert encoder is None or not any(isinstance(p, DTensor) for p in encoder.parameters())
        weights = {n: (p.full_tensor() if kind == "fsdp2" else p).detach().contiguous()
                   for n, p in module.named_parameters() if p.requires_grad}
        save_file(weights, f"{out}/{twin}_{kind}_rank{trainer.global_rank}.safetensors")
    from jagg_lightning.distributed.collectives import end_process_group
    end_process_group()  # every rank finished: leave together (collectives.end_process_group)
''')


def test_ddp_and_fsdp2_equal_one_process_on_the_hunyuan_video15_twins(hunyuan_twin_dirs, tmp_path, rng_seed):
    seed = rng_seed % 10_000
    assert {twin for twin, _ in RUNS} == set(TWINS)
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    run_ranks(script, str(tmp_path), str(seed), str(hunyuan_twin_dirs[RUNS[0][0]].parent), timeout=300)
    for twin in TWINS:
        single = module_for(twin, hunyuan_twin_dirs[twin], seed, optimizer=sgd, **OPTIONS)
        initial = {n: p.detach().clone() for n, p in single.named_parameters() if p.requires_grad}
        L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(single, PromptDataModule(prompts=prompts(twin), batch_size=2,
                                                                            shuffle=False))
        assert any(r.routed for r in single.window_records)
        names = sorted(initial)
        update = [single.get_parameter(n).detach() - initial[n] for n in names]
        assert sum(float(u.abs().sum()) for u in update) > 0, twin
        for kind in [k for t, k in RUNS if t == twin]:
            ranks = [load_file(tmp_path / f"{twin}_{kind}_rank{r}.safetensors") for r in (0, 1)]
            assert all(sorted(r) == names for r in ranks)
            assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in names), (twin, kind)  # one update on both ranks
            # one prompt per rank vs two in one batch (another count of padding columns dropped): float64 rounding
            error = rel_error([ranks[0][n] - initial[n] for n in names], update)
            assert error < 1e-6, (twin, kind, error)
