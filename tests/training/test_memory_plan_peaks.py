"""``jagg plan``'s activation predictions against a real training step on the twins: the peak of the tensors autograd
holds for backward during the step (saved-tensor hooks from pack to release, storages once, weights excluded, as
``benchmarks/whole_step.py`` measures) is within 15 % of the plan's largest activation phase, for exact GRPO, JAGG
W = 4 and the fused mode."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.config import MemoryConfig
from jagg_lightning.data import PromptDataModule
from jagg_lightning.memory_plan import Setup, plan_memory
from jagg_lightning.memory_plan.trace import SavedTensorPeak, weight_keys
from jagg_lightning.policies import PolicyConfig
from jagg_lightning.rewards import FrameReward

from helpers import fresh_seed

MODES = {
    "exact": dict(jagg_frac=0.0),
    "W=4": dict(jagg_frac=1.0),
    "fused": dict(jagg_frac=1.0, fused_rollout=True),
}
TWINS = {
    "sd3": dict(lora_rank=8, lora_alpha=16, max_sequence_length=8),
    "wan": dict(family="wan", lora_rank=4, lora_alpha=8, max_sequence_length=8, guidance_scale=1.0),
}


class StepPeak(Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.peak = SavedTensorPeak(weight_keys(module.policy))
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.peak.pack, self.peak.unpack)
        self.hooks.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.hooks.__exit__(None, None, None)


@pytest.mark.parametrize("twin", sorted(TWINS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_plan_predicts_the_steps_activation_peak(twin, mode):
    seed = fresh_seed()
    policy = PolicyConfig(**TWINS[twin])
    sampling = SamplingConfig(num_steps=9, group_size=4, rollout_batch_size=8)
    grpo = GRPOConfig(train_batch_size=8, adv_std="group", skip_zero_advantage=False)
    jagg = JAGGConfig(window_size=4, **MODES[mode])
    memory = MemoryConfig()
    plan = plan_memory(policy, sampling, grpo, jagg, memory, 2, Setup())
    predicted = max(r.bytes for r in plan.rows if not r.resident)

    reward = FrameReward("jpeg_compressibility", frames=3) if twin == "wan" else "jpeg_compressibility"
    module = JAGGModule(policy, sampling, grpo, jagg, reward=reward, memory=memory, seed=seed % 10_000,
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    peak = StepPeak()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[peak])
    trainer.fit(module, PromptDataModule(prompts=["a red square", "a blue circle"], batch_size=2, shuffle=False))
    measured = peak.peak.peak
    error = predicted / measured - 1
    print(f"{twin} {mode}: predicted {predicted / 2**20:.3f} MiB, measured {measured / 2**20:.3f} MiB ({error:+.1%})")
    assert abs(error) < 0.15
