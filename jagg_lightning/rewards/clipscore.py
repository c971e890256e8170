"""CLIPScore through torchmetrics: max(100 * cos(E_image, E_text), 0).

torchmetrics >= 1.7 takes a local model as a callable returning (model, processor); we pass one
that returns the CLIP model and processor loaded from local directories, so nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagg_lightning.rewards.base import Reward
from jagg_lightning.rewards.clip_models import TensorFeaturesCLIP, load_clip


class CLIPScoreReward(Reward):
    """model_path / processor_path: local CLIPModel and processor directories (default hub id
    openai/clip-vit-large-patch14, only with ``allow_download``)."""

    name = "clipscore"

    def __init__(self, model_path: str | None = None, processor_path: str | None = None, allow_download: bool = False):
        super().__init__()
        from torchmetrics.multimodal.clip_score import CLIPScore

        model, processor = load_clip(self.name, model_path, processor_path, allow_download,
                                     "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14")
        wrapped = TensorFeaturesCLIP(model)
        self.metric = CLIPScore(model_name_or_path=lambda: (wrapped, processor))
        self.freeze()

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        pixels = (images.float().clamp(0, 1) * 255).round()  # the CLIP processor rescales 0..255 itself
        scores = []
        for image, prompt in zip(pixels, prompts):  # the metric averages: one image per update
            self.metric.reset()
            self.metric.update(image.unsqueeze(0), [prompt])
            scores.append(self.metric.compute())
        self.metric.reset()
        return torch.stack(scores)
