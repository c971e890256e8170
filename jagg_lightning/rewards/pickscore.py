"""PickScore (Kirstain et al. 2023): a CLIP-H fine-tuned on Pick-a-Pic preferences.

score = logit_scale.exp() * cos(image embedding, text embedding), as the PickScore reference computes it.
"""

from __future__ import annotations

from torch import Tensor

from jagg_lightning.rewards.base import Reward
from jagg_lightning.rewards.clip_models import clip_image_embeddings, clip_text_embeddings, load_clip


class PickScoreReward(Reward):
    """model_path: a local CLIPModel directory (PickScore_v1); processor_path: its processor
    (default: the model directory). Hub ids are used only with ``allow_download``."""

    name = "pickscore"

    def __init__(self, model_path: str | None = None, processor_path: str | None = None, allow_download: bool = False):
        super().__init__()
        self.model, self.processor = load_clip(self.name, model_path, processor_path, allow_download,
                                               "yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
        self.freeze()

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        image = clip_image_embeddings(self.model, self.processor, images)
        text = clip_text_embeddings(self.model, self.processor, prompts)
        return self.model.logit_scale.exp() * (image * text).sum(-1)
