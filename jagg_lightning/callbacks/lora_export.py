"""Write the trained LoRA in the two formats users load: PEFT and diffusers.

(a) PEFT: ``peft/adapter_config.json`` + ``peft/adapter_model.safetensors`` (``PeftModel.from_pretrained``
    or ``transformer.load_lora_adapter``);
(b) diffusers: ``diffusers/pytorch_lora_weights.safetensors`` through the pipeline class's
    ``save_lora_weights`` WITH the adapter metadata (without it diffusers assumes alpha = rank and the
    LoRA scale comes out wrong); ``pipeline.load_lora_weights(dir)`` reads it back.

Each export is built in a temporary directory and renamed into place, so a crash mid-write never
leaves a half-written adapter.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from safetensors.torch import save_file

from jagg_lightning.io import atomic_directory


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    """The adapter's weights in PEFT naming (no adapter name), contiguous CPU copies."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(transformer).items()}


def export_lora(policy, target: str | Path) -> Path:
    """Write the policy's current adapter in both formats under ``target`` (``peft/``, ``diffusers/``)."""
    from diffusers import StableDiffusion3Pipeline

    transformer = policy.transformer
    config = transformer.peft_config["default"]
    weights = lora_state_dict(transformer)
    with atomic_directory(target) as tmp:
        peft_dir = tmp / "peft"
        config.save_pretrained(str(peft_dir))
        save_file(weights, str(peft_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        metadata = config.to_dict()
        metadata["target_modules"] = sorted(metadata["target_modules"])
        StableDiffusion3Pipeline.save_lora_weights(
            str(tmp / "diffusers"), transformer_lora_layers=weights, transformer_lora_adapter_metadata=metadata
        )
    return Path(target)


class LoRAExport(L.Callback):
    """Export the adapter at every checkpoint save and at the end of fit (EMA weights when enabled).

    dirpath: where to write; None = ``<trainer.default_root_dir>/lora``. Holds ``last/`` (updated at
    every checkpoint) and ``final/`` (end of fit).
    """

    def __init__(self, dirpath: str | None = None):
        super().__init__()
        self.dirpath = dirpath

    def _root(self, trainer: L.Trainer) -> Path:
        return Path(self.dirpath or Path(trainer.default_root_dir) / "lora")

    def _export(self, trainer, pl_module, name: str) -> Path | None:
        if not trainer.is_global_zero:
            return None
        with pl_module.inference_weights():
            return export_lora(pl_module.policy, self._root(trainer) / name)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._export(trainer, pl_module, "last")

    def on_fit_end(self, trainer, pl_module) -> None:
        path = self._export(trainer, pl_module, "final")
        if path is not None:
            print(f"LoRA adapter written to {path}")
