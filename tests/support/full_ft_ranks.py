"""Rank script of tests/distributed/test_full_finetune_fsdp2.py (launched by ``launch.run_ranks``, one process per rank):
``python full_ft_ranks.py OUT SEED MODE...``, the modes run one after another in the same processes (one launch pays
the imports once). Weights are written by rank 0 as safetensors (whole tensors)."""

import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.data import PromptDataModule
from jagg_lightning.distributed.collectives import end_process_group
from jagg_lightning.policies import PolicyConfig
from jagg_lightning.strategies import FSDP2Strategy

from helpers import float64_reward

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]


def build(seed, dtype="float64", kl_beta=0.2, ema_decay=None):
    return JAGGModule(
        PolicyConfig(trainable="full", dtype=dtype, guidance_scale=1.0, max_sequence_length=4),
        SamplingConfig(num_steps=5, group_size=2, rollout_batch_size=4),
        GRPOConfig(train_batch_size=2, kl_beta=kl_beta, max_grad_norm=0.05),
        JAGGConfig(window_size=2, jagg_frac=0.5),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=1e-2), ema_decay=ema_decay,
        reward=float64_reward(dtype),
        seed=seed,
    )


def whole(module):
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().contiguous()
            for n, p in module.named_parameters() if p.requires_grad}


class Snapshot(L.Callback):
    """Rank 0 writes the trainable weights at the start of fit and after the listed optimizer steps."""

    def __init__(self, path, steps=()):
        self.path, self.steps = path, set(steps)

    def _write(self, trainer, module, tag):
        weights = whole(module)  # every rank: gathers
        if trainer.is_global_zero:
            save_file(weights, f"{self.path}_{tag}.safetensors")

    def on_train_start(self, trainer, module):
        self._write(trainer, module, "start")

    def on_train_batch_end(self, trainer, module, *args):
        if trainer.global_step in self.steps:
            self._write(trainer, module, f"step{trainer.global_step}")


def fit(module, strategy, steps, devices=2, callbacks=(), ckpt_path=None, precision="32-true", batch_size=1, out="."):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=devices, strategy=strategy, precision=precision,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                        callbacks=list(callbacks), default_root_dir=out)
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=batch_size, shuffle=False), ckpt_path=ckpt_path)
    return trainer


def fsdp(**kw):
    return FSDP2Strategy(process_group_backend="gloo", **kw)


SINGLE_STEPS = 6  # the one-process reference: snapshots after 2 steps (DDP, bf16's test) and 6 (FSDP2's)


def main(mode, out, seed):
    if mode == "single":  # one process, 2 prompts a step (= 2 ranks x 1)
        fit(build(seed), "auto", SINGLE_STEPS, devices=1, batch_size=2,
            callbacks=[Snapshot(f"{out}/single", [2, SINGLE_STEPS])])
    elif mode == "ddp":
        trainer = fit(build(seed), "ddp", 2, callbacks=[Snapshot(f"{out}/ddp", [2])])
        assert float(trainer.callback_metrics["train/passes/grad_all_reduce"]) == 1.0  # one per update
        print("ddp ok")
    elif mode == "fsdp":  # 6 steps straight with a distributed checkpoint after step 3 (and 6), then 3 + 3
        checkpoint = ModelCheckpoint(dirpath=f"{out}/ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
        module = build(seed, ema_decay=0.5)
        fit(module, fsdp(save_distributed_checkpoint=True), 6, callbacks=[checkpoint, Snapshot(f"{out}/fsdp", [2, 3, 6])])
        assert isinstance(module.policy.lora_parameters()[0], DTensor)
        assert isinstance(next(module.policy.frozen_reference.parameters()), DTensor)  # the reference is sharded
        fit(build(seed, ema_decay=0.5), fsdp(save_distributed_checkpoint=True), 6, ckpt_path=f"{out}/ckpt/step=3.ckpt",
            callbacks=[Snapshot(f"{out}/resumed", [6])])
        print("fsdp ok")
    elif mode == "reshard":  # the 2-rank checkpoint on this launch's world size
        world = int(os.environ["WORLD_SIZE"])
        fit(build(seed, ema_decay=0.5), fsdp(save_distributed_checkpoint=True), 6, devices=world,
            batch_size=2 // world, ckpt_path=f"{out}/ckpt/step=3.ckpt", callbacks=[Snapshot(f"{out}/reshard", [6])])
        print("reshard ok")
    elif mode == "bf16":
        mixed_precision(seed, out)
    else:
        raise ValueError(f"unknown mode {mode!r}")


def mixed_precision(seed, out):
    """fp32 master shards, bf16 compute (FSDP2 MixedPrecisionPolicy), fp32 AdamW state; the reference bf16; with
    FSDP2's CPU offload of the policy and of the reference (on CPU ranks it only checks that they compose)."""
    module = build(seed, dtype="bfloat16", kl_beta=0.1)
    module.policy_config.reference_offload = True
    module.configure_model()
    seen = []
    linear = module.policy.transformer.transformer_blocks[0].attn.to_q
    linear.register_forward_hook(lambda m, args, output: seen.append((m.weight.dtype, args[0].dtype, output.dtype)))
    trainer = fit(module, fsdp(cpu_offload=True), 1, callbacks=[Snapshot(f"{out}/bf16")])
    params = module.policy.lora_parameters()
    assert params and all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
    assert seen and set(seen) == {(torch.bfloat16,) * 3}, set(seen)  # every forward (rollout, grad, reference)
    state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if t.ndim]
    assert state and all(t.dtype == torch.float32 for t in state)
    assert {p.dtype for p in module.policy.frozen_reference.parameters()} == {torch.bfloat16}
    assert float(trainer.callback_metrics["train/passes/reference_forward"]) > 0
    after = whole(module)
    if trainer.is_global_zero:
        save_file(after, f"{out}/bf16_end.safetensors")
    print("bf16 ok")


if __name__ == "__main__":
    for name in sys.argv[3:]:
        main(name, sys.argv[1], int(sys.argv[2]))
    end_process_group()  # every rank finished: leave together (collectives.end_process_group)
