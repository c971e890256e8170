"""Wan on 2 CPU processes (gloo), one launch for every case: DDP and FSDP2 on the Wan2.1 twin and the Wan2.2
two-expert twin give the one-process update on the same prompts (float64, CFG and KL on, JAGG routed on both
experts). Under FSDP2 both experts are sharded (every LoRA weight of ``transformer`` and ``transformer_2`` a
DTensor, gradient checkpointing on); the checkpoint it writes holds both experts' LoRA, resumes under FSDP2 into
a differently initialised module, and the LoRA export gathered from the shards writes both experts. Wan2.2 trained
in full (``trainable: full``) shards both experts and both frozen KL reference copies, and its update equals one
process's."""

import textwrap

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from jagg_lightning.data import PromptDataModule
from jagg_lightning.models.adapters import PEFT_KEY_PREFIX

from launch import run_ranks
from helpers import rel_error, sgd
from wan_twins import TWINS, build, full_module, module_for

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

OPTIONS = dict(dtype="float64", jagg_frac=0.5, window_size=2, num_steps=4, kl_beta=0.5, train_batch_size=2)
PROMPTS = ["a red cat", "a blue dog"]

RANK_SCRIPT = textwrap.dedent('''
    import sys
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from jagg_lightning.callbacks import LoRAExport
    from jagg_lightning.data import PromptDataModule
    from jagg_lightning.strategies import FSDP2Strategy
    from helpers import randomize_lora_b
    from test_distributed_wan import OPTIONS, PROMPTS
    from helpers import sgd
    from wan_twins import TWINS, module_for

    out, seed = sys.argv[1], int(sys.argv[2])

    def fit(module, strategy, callbacks=(), ckpt_path=None, root=None):
        trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(callbacks),
                            callbacks=list(callbacks), default_root_dir=root or out)
        trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=1, shuffle=False), ckpt_path=ckpt_path)
        return trainer

    def weights(module):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
                for n, p in module.named_parameters() if p.requires_grad}

    for twin in TWINS:
        module = module_for(twin, f"{out}/{twin}", seed, optimizer=sgd, **OPTIONS)
        trainer = fit(module, DDPStrategy(process_group_backend="gloo"))
        save_file(weights(module), f"{out}/{twin}_ddp_rank{trainer.global_rank}.safetensors")

        module = module_for(twin, f"{out}/{twin}", seed, optimizer=sgd, **OPTIONS)
        module.policy.enable_gradient_checkpointing()
        callbacks = [ModelCheckpoint(dirpath=f"{out}/{twin}_ckpt", filename="last"), LoRAExport(f"{out}/{twin}_lora")]
        trainer = fit(module, FSDP2Strategy(process_group_backend="gloo"), callbacks)
        experts = module.policy.experts
        assert len(experts) == 1 + TWINS[twin] and module.policy.sharded_networks() == experts
        for expert in experts:  # every expert really sharded: its LoRA and its frozen weights
            lora = [p for p in expert.parameters() if p.requires_grad]
            assert lora and all(isinstance(p, DTensor) for p in expert.parameters()), twin
        trained = weights(module)
        if trainer.global_rank == 0:
            save_file(trained, f"{out}/{twin}_fsdp.safetensors")

        # resume under FSDP2 into a module whose LoRA starts elsewhere: the checkpoint's weights, both experts
        fresh = module_for(twin, f"{out}/{twin}", seed, optimizer=sgd, **OPTIONS)
        for expert in fresh.policy.experts:
            randomize_lora_b(expert, torch.Generator().manual_seed(seed + 1))
        fit(fresh, FSDP2Strategy(process_group_backend="gloo"), ckpt_path=f"{out}/{twin}_ckpt/last.ckpt",
            root=f"{out}/{twin}_resumed")
        restored = weights(fresh)
        assert sorted(restored) == sorted(trained)
        assert all(torch.equal(restored[n], trained[n]) for n in trained), twin
        assert all(isinstance(p, DTensor) for p in fresh.policy.lora_parameters())

    # Wan2.2 trained in full: both experts' own weights and both frozen KL reference copies sharded
    from wan_twins import full_module
    module = full_module(seed)
    trainer = fit(module, FSDP2Strategy(process_group_backend="gloo"))
    assert all(isinstance(p, DTensor) for expert in module.policy.experts for p in expert.parameters())
    assert all(isinstance(p, DTensor) for p in module.policy.frozen_reference.parameters())
    full = weights(module)
    if trainer.global_rank == 0:
        save_file(full, f"{out}/wan22_full_fsdp.safetensors")
    from jagg_lightning.distributed.collectives import end_process_group
    end_process_group()  # every rank finished: leave together (collectives.end_process_group)
''')


def test_ddp_and_fsdp2_equal_one_process_on_both_wan_twins(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    for twin in TWINS:
        build(twin).save_pretrained(tmp_path / twin)
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    run_ranks(script, str(tmp_path), str(seed), timeout=300)
    for twin, two in TWINS.items():
        single = module_for(twin, tmp_path / twin, seed, optimizer=sgd, **OPTIONS)
        initial = {n: p.detach().clone() for n, p in single.named_parameters() if p.requires_grad}
        L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(single, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False))
        assert {r.segment for r in single.window_records} == ({0, 1} if two else {0})
        assert any(r.routed for r in single.window_records)
        names = sorted(initial)
        assert any(".transformer_2." in n for n in names) == two
        update = [single.get_parameter(n).detach() - initial[n] for n in names]
        for expert in ("transformer.", "transformer_2.") if two else ("transformer.",):
            assert sum(float(u.abs().sum()) for n, u in zip(names, update) if f".{expert}" in n) > 0, (twin, expert)

        ddp = [load_file(tmp_path / f"{twin}_ddp_rank{r}.safetensors") for r in (0, 1)]
        fsdp = load_file(tmp_path / f"{twin}_fsdp.safetensors")
        for other in ddp + [fsdp]:
            assert sorted(other) == names
        assert all(torch.equal(ddp[0][n], ddp[1][n]) for n in names), twin  # gradients synchronised
        # one prompt per rank vs two in one batch: float64 up to the float32 timestep embedding
        for kind, other in (("ddp", ddp[0]), ("fsdp2", fsdp)):
            error = rel_error([other[n] - initial[n] for n in names], update)
            assert error < 1e-6, (twin, kind, error)

        # the FSDP2 checkpoint (gathered on rank 0) and the export hold every expert's trained LoRA
        state = torch.load(tmp_path / f"{twin}_ckpt" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
        assert sorted(state) == names and all(torch.equal(state[n], fsdp[n]) for n in names)
        lora = tmp_path / f"{twin}_lora" / "final"
        for expert, suffix in (("transformer", ""), ("transformer_2", "_transformer_2"))[:1 + two]:
            exported = load_file(lora / f"peft{suffix}" / "adapter_model.safetensors")
            prefix = f"policy.{expert}."
            mine = {n[len(prefix):].replace(".default.", "."): fsdp[n] for n in names if n.startswith(prefix)}
            assert sorted(k[len(PEFT_KEY_PREFIX):] for k in exported) == sorted(mine), (twin, expert)
            assert all(torch.equal(exported[PEFT_KEY_PREFIX + k], v) for k, v in mine.items()), (twin, expert)
        assert (lora / "diffusers_transformer_2").is_dir() == two

    # the full fine-tune of both experts under FSDP2 equals one process's (float64, KL against both copies)
    single = full_module(seed)
    single.configure_model()
    initial = {n: p.detach().clone() for n, p in single.named_parameters() if p.requires_grad}
    L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(single, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False))
    names = sorted(initial)
    fsdp = load_file(tmp_path / "wan22_full_fsdp.safetensors")
    assert sorted(fsdp) == names and any(".transformer_2." in n for n in names)
    update = [single.get_parameter(n).detach() - initial[n] for n in names]
    for expert in ("transformer.", "transformer_2."):
        assert sum(float(u.abs().sum()) for n, u in zip(names, update) if f".{expert}" in n) > 0, expert
    error = rel_error([fsdp[n] - initial[n] for n in names], update)
    assert error < 1e-6, error
