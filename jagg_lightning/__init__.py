"""jagg_lightning: GRPO fine-tuning of flow-matching DiTs where JAGG replaces most per-step backward passes."""

__version__ = "0.1.0"

from jagg_lightning.config import EvalConfig, GRPOConfig, JAGGConfig, MemoryConfig, PolicyConfig, SamplingConfig
from jagg_lightning.data import PromptDataModule
from jagg_lightning.module import JAGGModule
from jagg_lightning.policies.sd3 import SD3Policy

__all__ = ["EvalConfig", "GRPOConfig", "JAGGConfig", "JAGGModule", "MemoryConfig", "PolicyConfig", "PromptDataModule", "SD3Policy",
           "SamplingConfig"]
