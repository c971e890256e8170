"""HPSv2 / HPSv2.1 (Wu et al. 2023): an OpenCLIP ViT-H-14 fine-tuned on human preferences.

Built once through the hpsv2 package's own model definition with ``pretrained=None`` (nothing is
downloaded), then the HPS state dict is loaded from a local checkpoint with ``weights_only=True``.
We do not call ``hpsv2.score()``: it re-reads the checkpoint on every call, hard-codes CUDA autocast
and downloads the ViT-H-14 base weights even when a checkpoint is given.

Install: ``pip install --no-deps hpsv2x==1.2.0`` (the hpsv2 1.2.0 wheel lacks its BPE vocabulary;
hpsv2x ships it but pins pytest 7.2.0 and protobuf<4) plus the ``rewards`` extra for its real imports.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagg_lightning.rewards.base import Reward, require_path, to_pil

HPS_CHECKPOINTS = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


class HPSv2Reward(Reward):
    """score = <image embedding, text embedding> of the normalised HPS features (as hpsv2 computes it).

    checkpoint: local HPS .pt file ({"state_dict": ...}); with ``allow_download`` and no path, fetched
    from the hub (xswu/HPSv2). model_name: the OpenCLIP architecture (ViT-H-14 for the released
    checkpoints); model_config: optional JSON architecture file registered under its file stem.
    """

    name = "hpsv2"

    def __init__(self, checkpoint: str | None = None, version: str = "v2.1", model_name: str = "ViT-H-14",
                 model_config: str | None = None, batch_size: int = 16, allow_download: bool = False):
        super().__init__()
        if version not in HPS_CHECKPOINTS:
            raise ValueError(f"reward {self.name}: version must be one of {sorted(HPS_CHECKPOINTS)}, got {version!r}")
        if batch_size < 1:
            raise ValueError(f"reward {self.name}: batch_size must be >= 1, got {batch_size}")
        try:
            from hpsv2.src.open_clip import create_model_and_transforms, get_tokenizer
            from hpsv2.src.open_clip.factory import add_model_config
        except ImportError as err:
            raise ImportError(f"reward {self.name} needs `pip install --no-deps hpsv2x==1.2.0` and the rewards "
                              f"extra: {err}") from err
        if checkpoint is None and allow_download:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download("xswu/HPSv2", HPS_CHECKPOINTS[version])
        else:
            path = require_path(self.name, "checkpoint", checkpoint, allow_download)
        if model_config is not None:
            require_path(self.name, "model_config", model_config, False)
            add_model_config(model_config)
        model, _, self.preprocess = create_model_and_transforms(
            model_name, pretrained=None, precision="fp32", device="cpu", jit=False, output_dict=True,
        )
        state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            model.load_state_dict(state.get("state_dict", state))
        except RuntimeError as err:
            raise ValueError(f"reward {self.name}: checkpoint {path!r} does not fit {model_name}: {err}") from err
        self.model = model
        self.tokenizer = get_tokenizer(model_name)
        self.batch_size = batch_size
        self.freeze()

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        param = next(self.model.parameters())
        scores = []
        for start in range(0, len(prompts), self.batch_size):
            pil = to_pil(images[start : start + self.batch_size])
            pixels = torch.stack([self.preprocess(img) for img in pil]).to(param.device, param.dtype)
            text = self.tokenizer(prompts[start : start + self.batch_size]).to(param.device)
            out = self.model(pixels, text)
            image_features, text_features = out["image_features"], out["text_features"]
            scores.append((image_features * text_features).sum(-1))
        return torch.cat(scores)
