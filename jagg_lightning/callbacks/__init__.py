"""Lightning callbacks: they read what JAGGModule exposes and never reach into rollout internals."""

from jagg_lightning.callbacks.lora_export import LoRAExport, export_lora, lora_state_dict

__all__ = ["LoRAExport", "export_lora", "lora_state_dict"]
