"""FSDP2 (FSDP2Strategy = Lightning's ModelParallelStrategy, fully_shard per block) on 2 CPU processes (gloo):
the update equals one process's on the same prompts, and a LoRA-only checkpoint written under FSDP2 resumes,
under FSDP2 and on one process, to the weights of an uninterrupted run. float64, KL on, gradient clipping
active, SGD with momentum (scale-sensitive, with optimizer state), gradient checkpointing on under FSDP2,
EMA on: the exported (EMA) adapter, gathered from the shards, equals one process's, and survives resume."""

import textwrap

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from jagg_lightning.callbacks import LoRAExport
from jagg_lightning.callbacks.checkpoint import AtomicCheckpointIO
from jagg_lightning.data import PromptDataModule
from jagg_lightning.models.adapters import PEFT_KEY_PREFIX

from launch import run_ranks
from helpers import rel_error, sgd
from modules import make_module

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]
OPTIONS = dict(dtype="float64", jagg_frac=0.5, kl_beta=0.5, max_grad_norm=1e-3, train_batch_size=2, ema_decay=0.5)



RANK_SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from jagg_lightning.callbacks import LoRAExport
    from jagg_lightning.callbacks.checkpoint import AtomicCheckpointIO
    from jagg_lightning.data import PromptDataModule
    from jagg_lightning.strategies import FSDP2Strategy
    from test_fsdp2 import OPTIONS, PROMPTS
    from helpers import sgd
    from modules import make_module

    out, seed = sys.argv[1], int(sys.argv[2])

    def build():
        module = make_module(seed, optimizer=sgd, **OPTIONS)
        module.policy.enable_gradient_checkpointing()
        return module

    def fit(module, callbacks=(), ckpt_path=None):
        trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy=FSDP2Strategy(process_group_backend="gloo"),
                            plugins=[AtomicCheckpointIO()], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=isinstance(callbacks[0], ModelCheckpoint),
                            callbacks=list(callbacks), default_root_dir=out)
        trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=1, shuffle=False), ckpt_path=ckpt_path)
        assert isinstance(module.policy.lora_parameters()[0], DTensor)  # really sharded
        weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
                   for n, p in module.named_parameters() if p.requires_grad}
        return trainer, weights

    # the LoRA export (EMA weights) gathers the shards at every checkpoint and at the end of fit
    trainer, weights = fit(build(), [ModelCheckpoint(dirpath=f"{out}/ckpt", filename="{step}", every_n_train_steps=1,
                                                     save_top_k=-1), LoRAExport(f"{out}/lora")])
    if trainer.global_rank == 0:
        save_file(weights, f"{out}/fsdp_final.safetensors")
    trainer, weights = fit(build(), [LoRAExport(f"{out}/lora_resumed")], ckpt_path=f"{out}/ckpt/step=1.ckpt")
    if trainer.global_rank == 0:
        save_file(weights, f"{out}/fsdp_resumed.safetensors")
    # bf16 frozen weights stay bf16 shards, the LoRA shards and their optimizer state float32 (bf16-true)
    low = make_module(seed, optimizer=sgd, **(OPTIONS | {"dtype": "bfloat16", "kl_beta": 0.0}))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy=FSDP2Strategy(process_group_backend="gloo"),
                        precision="bf16-true", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(low, PromptDataModule(prompts=PROMPTS, batch_size=1, shuffle=False))
    lora = low.policy.lora_parameters()
    frozen = [p for p in low.policy.transformer.parameters() if not p.requires_grad]
    assert lora and all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in lora)
    assert frozen and all(isinstance(p, DTensor) and p.dtype == torch.bfloat16 for p in frozen)
    state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if t.is_floating_point() and t.ndim]
    assert state and all(t.dtype == torch.float32 for t in state)
    assert all(torch.isfinite(p.full_tensor()).all() for p in lora)
    print("bf16 ok")
    # the fused mode is refused under sharding, before anything trains
    fused = make_module(seed, optimizer=sgd, rollout_batch_size=3, jagg={"fused_rollout": True},
                        **(OPTIONS | {"adv_std": "group"}))
    try:
        fit(fused, [LoRAExport(f"{out}/unused")])
    except ValueError as error:
        assert "jagg.fused_rollout must be false under a sharded strategy" in str(error), error
        print("fused refused")
    else:
        raise AssertionError("fused_rollout trained under FSDP2")
    # the process group is destroyed at exit while the interpreter is alive (else gloo may abort at shutdown)
    from jagg_lightning.distributed import collectives
    assert collectives._CLEANUP_REGISTERED
    from jagg_lightning.distributed.collectives import end_process_group
    end_process_group()  # every rank finished: leave together (collectives.end_process_group)
''')


def single_fit(seed, lora_dir, ckpt_path=None):
    module = make_module(seed, optimizer=sgd, **OPTIONS)
    initial = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, plugins=[AtomicCheckpointIO()], callbacks=[LoRAExport(str(lora_dir))]).fit(
        module, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False), ckpt_path=ckpt_path)
    return initial, {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def exported_update(lora_dir, initial, names):
    """The final export's (EMA) weights minus the initial weights, in the order of ``names``."""
    exported = load_file(lora_dir / "final" / "peft" / "adapter_model.safetensors")
    keys = [PEFT_KEY_PREFIX + n.removeprefix("policy.transformer.").replace(".default.", ".") for n in names]
    assert sorted(keys) == sorted(exported)
    return [exported[k] - initial[n] for k, n in zip(keys, names)]


def test_fsdp2_update_and_sharded_checkpoint_resume(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    outputs = run_ranks(script, str(tmp_path), str(seed), timeout=300)
    assert all("fused refused" in out and "bf16 ok" in out for out in outputs)
    fsdp_final = load_file(tmp_path / "fsdp_final.safetensors")
    fsdp_resumed = load_file(tmp_path / "fsdp_resumed.safetensors")

    # the checkpoint is LoRA-only and loads with weights_only=True
    checkpoint = torch.load(tmp_path / "ckpt" / "step=1.ckpt", weights_only=True)
    assert sorted(checkpoint["state_dict"]) == sorted(fsdp_final)
    assert checkpoint["optimizer_states"][0]["state"]  # the momentum buffers travel too

    initial, single = single_fit(seed, tmp_path / "single_lora")
    names = sorted(single)
    update = [single[n] - initial[n] for n in names]
    assert sum(float(u.abs().sum()) for u in update) > 0
    errors = {
        "fsdp2 vs one process": rel_error([fsdp_final[n] - initial[n] for n in names], update),
        "fsdp2 resumed under fsdp2 vs uninterrupted": rel_error([fsdp_resumed[n] - initial[n] for n in names],
                                                                [fsdp_final[n] - initial[n] for n in names]),
    }
    _, resumed_single = single_fit(seed, tmp_path / "single_resumed_lora", ckpt_path=tmp_path / "ckpt" / "step=1.ckpt")
    errors["fsdp2 checkpoint resumed on one process vs uninterrupted"] = rel_error(
        [resumed_single[n] - initial[n] for n in names], update)
    # the exported EMA adapter: whole weights gathered from the shards, and the EMA state through the checkpoint
    single_ema = exported_update(tmp_path / "single_lora", initial, names)
    fsdp_ema = exported_update(tmp_path / "lora", initial, names)
    assert sum(float(u.abs().sum()) for u in single_ema) > 0 and rel_error(single_ema, update) > 1e-3  # EMA != theta
    errors["fsdp2 EMA export vs one process"] = rel_error(fsdp_ema, single_ema)
    errors["fsdp2 EMA export resumed under fsdp2 vs uninterrupted"] = rel_error(
        exported_update(tmp_path / "lora_resumed", initial, names), fsdp_ema)
    errors["fsdp2 checkpoint's EMA resumed on one process vs uninterrupted"] = rel_error(
        exported_update(tmp_path / "single_resumed_lora", initial, names), single_ema)
    print("relative update differences:", errors)
    assert errors["fsdp2 resumed under fsdp2 vs uninterrupted"] < 1e-12, errors  # same layout: identical so far
    assert errors["fsdp2 EMA export resumed under fsdp2 vs uninterrupted"] < 1e-12, errors
    # different batch layouts: float64 up to the float32 timestep embedding (see test_distributed.py)
    assert max(errors.values()) < 1e-6, errors
