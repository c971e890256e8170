"""DDPO's JPEG rewards: file size of the image saved as JPEG (quality 95), in kilobytes."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from jagg_lightning.rewards.base import Reward


def jpeg_size_kb(images: Tensor, quality: int = 95) -> Tensor:
    """Size in kB of each image [B, 3, H, W] in [0, 1] encoded as JPEG."""
    arrays = (images.detach().float().cpu().permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    sizes = []
    for array in arrays:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility(Reward):
    """Smaller files score higher: reward = -size_kb."""

    name = "jpeg_compressibility"

    def __init__(self, quality: int = 95):
        super().__init__()
        if not 1 <= quality <= 100:
            raise ValueError(f"{self.name}.quality must be in [1, 100], got {quality}")
        self.quality = quality
        self.freeze()

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return -jpeg_size_kb(images, self.quality)


class JpegIncompressibility(JpegCompressibility):
    """Larger files score higher: reward = size_kb."""

    name = "jpeg_incompressibility"

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return jpeg_size_kb(images, self.quality)
