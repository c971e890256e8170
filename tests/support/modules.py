"""The tiny SD3 JAGGModule most training tests run, and a short fit of it."""

import lightning as L
import torch

from jagg_lightning.data import PromptDataModule
from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig

from helpers import float64_reward, randomize_lora_b, tiny_policy_config

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]


def make_module(seed, dtype="float32", jagg_frac=0.5, lr=1e-3, optimizer=None, rollout_batch_size=4, jagg=None,
                ema_decay=None, resolution=None, reward=None, **grpo):
    """``reward`` default: the tests' reward at the run's precision (``helpers.float64_reward``)."""
    policy = tiny_policy_config(dtype=dtype, resolution=resolution)
    module = JAGGModule(
        policy,
        SamplingConfig(num_steps=8, group_size=3, rollout_batch_size=rollout_batch_size),
        GRPOConfig(**({"train_batch_size": 6} | grpo)),
        JAGGConfig(**({"window_size": 3, "jagg_frac": jagg_frac} | (jagg or {}))),
        optimizer=optimizer or (lambda p: torch.optim.AdamW(p, lr=lr)),
        ema_decay=ema_decay,
        reward=float64_reward(dtype) if reward is None else reward,
        seed=seed,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def fit(module, steps=1, prompts=PROMPTS[:2], callbacks=()):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module, PromptDataModule(prompts=prompts, batch_size=2, shuffle=False))
    return trainer
