"""Lightning callbacks: they read what JAGGModule exposes and never reach into rollout internals. A new callback goes
here (exported below, documented in docs/callbacks.md). They may import anything but ``cli/``; nothing in the core
imports them."""

from jagg_lightning.callbacks.checkpoint import AtomicCheckpointIO
from jagg_lightning.callbacks.digit_accuracy import DigitAccuracy
from jagg_lightning.callbacks.exactness import ExactnessDiagnostics
from jagg_lightning.callbacks.geneval_accuracy import GenEvalAccuracy
from jagg_lightning.callbacks.lora_export import LoRAExport, export_lora, lora_state_dict
from jagg_lightning.callbacks.model_summary import ParameterSummary
from jagg_lightning.callbacks.peak_memory import PeakMemory
from jagg_lightning.callbacks.predictions import PredictionImages
from jagg_lightning.callbacks.preemption import Preemption
from jagg_lightning.callbacks.reward_watch import RewardHackingWatch
from jagg_lightning.callbacks.routing import RoutingStats
from jagg_lightning.callbacks.samples import SampleImages
from jagg_lightning.callbacks.step_times import StepTimes
from jagg_lightning.callbacks.summary import RunSummary
from jagg_lightning.training.images import log_image

__all__ = ["AtomicCheckpointIO", "DigitAccuracy", "ExactnessDiagnostics", "GenEvalAccuracy", "LoRAExport",
           "ParameterSummary", "PeakMemory", "Preemption", "PredictionImages", "RewardHackingWatch", "RoutingStats", "RunSummary",
           "SampleImages", "StepTimes", "export_lora", "log_image", "lora_state_dict"]
