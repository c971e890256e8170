"""The reward protocol: images [B, 3, H, W] in [0, 1] and their prompts -> scores [B]."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def check_images(images: Tensor, prompts: list[str], name: str) -> None:
    """Refuse what no reward should score: wrong shape, wrong count, values outside [0, 1]."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"reward {name}: images must be [B, 3, H, W], got shape {tuple(images.shape)}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"reward {name}: got {images.shape[0]} images but {len(prompts)} prompts")
    if not torch.isfinite(images).all() or images.min() < 0 or images.max() > 1:
        raise ValueError(f"reward {name}: image values must lie in [0, 1]")


class Reward(nn.Module):
    """A frozen scorer. Subclasses implement :meth:`score`; ``forward`` checks inputs and outputs.

    Higher is better. Scores are float32 on the images' device, one per image.
    """

    name: str = "reward"

    def __init__(self):
        super().__init__()
        self.requires_grad_(False)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, images: Tensor, prompts: list[str]) -> Tensor:
        check_images(images, prompts, self.name)
        scores = self.score(images, prompts).to(device=images.device, dtype=torch.float32).reshape(-1)
        if scores.shape[0] != images.shape[0]:
            raise RuntimeError(f"reward {self.name}: returned {scores.shape[0]} scores for {images.shape[0]} images")
        if not torch.isfinite(scores).all():
            raise FloatingPointError(f"reward {self.name}: non-finite score {scores.tolist()}; refusing to train on it")
        return scores
