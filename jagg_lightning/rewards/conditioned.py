"""Rewards that see the condition: how much of the source an edit keeps, and how well a clip continues its first frame.

Both read each prompt's condition image (:func:`jagg_lightning.models.conditions.condition_images`: a conditioned prompt
carries it; a plain string has none and is refused with the prompt named) and compare CLIP image features -- the
consistency term of Flow-GRPO's FLUX.1 Kontext recipe, which scores the edit with GenEval and keeps the rest of the
picture with CLIP feature similarity between the source and the result:

* :class:`EditFidelity`: cos(E(result), E(source)) of L2-normalised projected CLIP image embeddings, in [-1, 1];
  1 = the result is, to CLIP, the source. Whole-image features: an edit that changes one object moves them a
  little, one that repaints the scene a lot (mix it with a reward for the edit itself in a ``WeightedReward``).
* :class:`FirstFrameConsistency` (image-to-video): the same between the clip's first frame and the source image
  (``accepts_video``: [B, F, 3, H, W]; an image is its own first frame).

The CLIP model and processor load from local directories (``model_path``, ``processor_path``; the hub id
``openai/clip-vit-large-patch14`` only with ``allow_download``), frozen.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagg_lightning.models.conditions import condition_images, fit_to, where
from jagg_lightning.rewards.base import Reward
from jagg_lightning.rewards.clip_models import clip_image_embeddings, load_clip


def sources_like(prompts, images: Tensor) -> Tensor:
    """The first condition image of each prompt, fitted to the images' size: [B, 3, H, W] in [0, 1]."""
    height, width = images.shape[-2:]
    out = []
    for prompt in prompts:
        found = condition_images(prompt)
        if not found:
            raise ValueError(f"prompt {where(prompt)} carries no condition image (this reward compares the result "
                             "with its source: conditioned prompts, e.g. a JSONL data file with an 'image' per row)")
        out.append(fit_to(found[0], height, width))
    return torch.stack(out).to(images.device)


class EditFidelity(Reward):
    """cos(E(result), E(source)) of CLIP image embeddings (see the module docstring)."""

    name = "edit_fidelity"

    def __init__(self, model_path: str | None = None, processor_path: str | None = None, allow_download: bool = False):
        super().__init__()
        self.model, self.processor = load_clip(self.name, model_path, processor_path, allow_download,
                                               "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14")
        self.freeze()

    def similarity(self, images: Tensor, prompts) -> Tensor:
        sources = sources_like(prompts, images)
        pair = clip_image_embeddings(self.model, self.processor, torch.cat([images.float(), sources.float()]))
        result, source = pair[: len(images)], pair[len(images):]
        return (result * source).sum(-1)

    def score(self, images: Tensor, prompts) -> Tensor:
        return self.similarity(images, prompts)


class FirstFrameConsistency(EditFidelity):
    """cos(E(first frame), E(source image)) of an image-to-video clip (see the module docstring)."""

    name = "first_frame_consistency"
    accepts_video = True

    def score(self, images: Tensor, prompts) -> Tensor:
        first = images[:, 0] if images.ndim == 5 else images
        return self.similarity(first, prompts)
