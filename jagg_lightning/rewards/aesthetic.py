"""LAION aesthetic predictor (improved-aesthetic-predictor): an MLP on normalised CLIP ViT-L/14 image
embeddings, predicting a 1-10 rating."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from jagg_lightning.rewards.base import Reward, require_path
from jagg_lightning.rewards.clip_models import clip_image_embeddings, load_clip


class AestheticMLP(nn.Module):
    """The released head: embed -> 1024 -> 128 -> 64 -> 16 -> 1 (dropout is inactive at eval)."""

    def __init__(self, embed_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )

    def forward(self, embeddings: Tensor) -> Tensor:
        return self.layers(embeddings)


def load_state(path: str) -> dict[str, Tensor]:
    if Path(path).suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


class AestheticReward(Reward):
    """head_path: the MLP weights (.pth / .safetensors, keys ``layers.N.*``); clip_path: a local CLIP
    ViT-L/14 directory (model and processor). Hub downloads only with ``allow_download``."""

    name = "aesthetic"

    def __init__(self, head_path: str, clip_path: str | None = None, allow_download: bool = False):
        super().__init__()
        require_path(self.name, "head_path", head_path, False)
        self.model, self.processor = load_clip(self.name, clip_path, None, allow_download,
                                               "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14")
        state = load_state(head_path)
        embed_dim = self.model.config.projection_dim
        self.head = AestheticMLP(embed_dim)
        try:
            self.head.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"reward {self.name}: head_path {head_path!r} does not fit an MLP on "
                             f"{embed_dim}-d CLIP embeddings: {err}") from err
        self.freeze()

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        emb = clip_image_embeddings(self.model, self.processor, images)
        return self.head(emb.to(next(self.head.parameters()).dtype)).squeeze(-1)
