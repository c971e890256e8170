"""Loading a transformers CLIP model and processor from local directories, frozen."""

from __future__ import annotations

from torch import Tensor, nn

from jagg_lightning.rewards.base import require_path, to_pil


def load_clip(reward: str, model_path: str | None, processor_path: str | None, allow_download: bool,
              hub_model: str, hub_processor: str):
    """(CLIPModel, processor) from local directories; from the hub only with ``allow_download``."""
    from transformers import AutoProcessor, CLIPModel

    model_path = require_path(reward, "model_path", model_path, allow_download, hub_model)
    processor_path = require_path(reward, "processor_path", processor_path or model_path, allow_download,
                                  hub_processor)
    local = not allow_download
    model = CLIPModel.from_pretrained(model_path, local_files_only=local).eval().requires_grad_(False)
    processor = AutoProcessor.from_pretrained(processor_path, local_files_only=local)
    return model, processor


def _features(output) -> Tensor:
    """transformers >= 5 may wrap projected features in a model output."""
    return output if isinstance(output, Tensor) else output.pooler_output


class TensorFeaturesCLIP(nn.Module):
    """A CLIPModel whose ``get_*_features`` return plain tensors, as torchmetrics' CLIPScore expects
    (transformers 5 returns a model output there, which torchmetrics 1.9 cannot normalise)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    def get_image_features(self, pixel_values: Tensor) -> Tensor:
        return _features(self.model.get_image_features(pixel_values=pixel_values))

    def get_text_features(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return _features(self.model.get_text_features(input_ids=input_ids, attention_mask=attention_mask))


def clip_image_embeddings(model, processor, images: Tensor) -> Tensor:
    """L2-normalised projected image embeddings of images in [0, 1]."""
    inputs = processor(images=to_pil(images), return_tensors="pt")
    pixels = inputs["pixel_values"].to(next(model.parameters()).device, next(model.parameters()).dtype)
    emb = _features(model.get_image_features(pixel_values=pixels))
    return emb / emb.norm(dim=-1, keepdim=True)


def clip_text_embeddings(model, processor, prompts: list[str]) -> Tensor:
    """L2-normalised projected text embeddings."""
    max_length = getattr(model.config.text_config, "max_position_embeddings", 77)
    inputs = processor(text=prompts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    device = next(model.parameters()).device
    emb = _features(model.get_text_features(input_ids=inputs["input_ids"].to(device),
                                            attention_mask=inputs["attention_mask"].to(device)))
    return emb / emb.norm(dim=-1, keepdim=True)

