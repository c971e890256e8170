"""ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image
Generation"): BLIP (a ViT-L/16 image encoder and a BERT text encoder cross-attending to its patch embeddings) with
an MLP on the text encoder's [CLS] feature, trained on 137k expert comparisons; higher = preferred.

Built from transformers' own ``BlipVisionModel`` and ``BlipTextModel``, not the ``image-reward`` package: 1.5
imports timm 0.6 / fairscale, transformers 4.x names that 5.x removed (``apply_chunking_to_forward`` from
``modeling_utils``, ``transformers.file_utils``) and downloads its tokenizer and config at load. What the package
does is reproduced (ImageReward/ImageReward.py ``ImageReward.score``, models/BLIP/blip_pretrain.py, blip.py,
vit.py, med.py):

- the checkpoint ``ImageReward.pt`` (THUDM/ImageReward) is a plain state dict: ``blip.visual_encoder.*`` (a timm
  ViT: ``cls_token``, ``pos_embed``, ``patch_embed.proj``, ``blocks.{i}.{norm1, attn.qkv, attn.proj, norm2,
  mlp.fc1, mlp.fc2}``, ``norm``; LayerNorm eps 1e-6, exact GELU), ``blip.text_encoder.*`` (BLIP's ``med.py`` BERT,
  the layout transformers' ``BlipTextModel`` kept, cross-attention in every layer, no pooler), ``mlp.layers.{0, 2,
  4, 6, 7}`` and, unused by the score, BLIP's contrastive projections ``blip.{vision,text}_proj`` and the
  ``position_ids`` buffer; each key mapped (:func:`to_transformers`), every module weight required;
- ``med_config.json`` (the checkpoint's BERT config) with the cross-attention width set to the ViT's, as the
  package does (``encoder_config.encoder_width = vision_width``); the ViT's sizes read from the checkpoint's shapes,
  its heads given (16 for ViT-L);
- the tokenizer ``bert-base-uncased`` with ``[DEC]`` (bos) and ``[ENC]`` added; the prompt padded to 35 tokens,
  truncated there; the input ids as they come (with [CLS] first: the score does not swap in [ENC]);
- each image resized (bicubic, shorter side) to 224, centre-cropped, CLIP's mean and std;
- the text encoder over the prompt with every patch embedding as cross-attention memory, its last hidden state at
  [CLS] (position 0) through the MLP in float32: five linear layers, no activation (the authors commented the ReLUs
  out), dropout between the first four;
- the score ``(mlp(cls) - 0.16717362830052426) / 1.0333394966054072``, the paper's convention (the standardisation
  over the training set the package applies: 0 is an average image, ~1 one standard deviation better).
"""

from __future__ import annotations

import json
import re

import torch
from torch import Tensor, nn

from jagg_lightning.rewards.base import Reward, require_path, to_pil

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward/ImageReward.py: self.mean, self.std
MAX_LENGTH = 35
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
UNUSED = re.compile(r"blip\.(vision_proj|text_proj)\.(weight|bias)|blip\.text_encoder\.embeddings\.position_ids")
_VISION = [  # (ImageReward's timm ViT key, transformers' BlipVisionModel key), matched at the key's end
    (r"cls_token", "embeddings.class_embedding"), (r"pos_embed", "embeddings.position_embedding"),
    (r"patch_embed\.proj\.", "embeddings.patch_embedding."), (r"norm\.", "post_layernorm."),
    (r"blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"blocks\.(\d+)\.mlp\.(fc1|fc2)\.", r"encoder.layers.\1.mlp.\2."),
]


def to_transformers(key: str) -> str | None:
    """An ``ImageReward.pt`` key -> this module's (``vision.*``, ``text.*``, ``head.*``); None for the keys the
    score does not use; the key itself when it is none of ImageReward's (the strict load then names it)."""
    if UNUSED.fullmatch(key):
        return None
    if key.startswith("blip.text_encoder."):
        return "text." + key[len("blip.text_encoder."):]
    if key.startswith("mlp.layers."):
        return "head." + key[len("mlp.layers."):]
    if key.startswith("blip.visual_encoder."):
        rest = key[len("blip.visual_encoder."):]
        for pattern, replacement in _VISION:
            mapped, found = re.subn("^" + pattern, replacement, rest)
            if found:
                return "vision." + mapped
    return key


def reward_head(width: int) -> nn.Sequential:
    """ImageReward's ``MLP``: indices 0, 2, 4, 6, 7 hold the weights; no activation between the linear layers."""
    return nn.Sequential(nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))


def configs(state: dict[str, Tensor], med_config: dict, vision_heads: int):
    """(BlipVisionConfig, BlipTextConfig) for this checkpoint: the ViT's sizes from its tensors, BERT's from
    ``med_config.json``, the cross-attention as wide as the ViT."""
    from transformers import BlipTextConfig, BlipVisionConfig

    patch = state["vision.embeddings.patch_embedding.weight"]
    width, patch_size = patch.shape[0], patch.shape[-1]
    grid = round((state["vision.embeddings.position_embedding"].shape[1] - 1) ** 0.5)
    depth = len({k.split(".")[3] for k in state if k.startswith("vision.encoder.layers.")})
    hidden = state["vision.encoder.layers.0.mlp.fc1.weight"].shape[0]
    vision = BlipVisionConfig(hidden_size=width, intermediate_size=hidden, num_hidden_layers=depth,
                              num_attention_heads=vision_heads, image_size=grid * patch_size, patch_size=patch_size,
                              hidden_act="gelu", layer_norm_eps=1e-6, attention_dropout=0.0)
    text = BlipTextConfig(
        vocab_size=med_config["vocab_size"], hidden_size=med_config["hidden_size"], encoder_hidden_size=width,
        intermediate_size=med_config["intermediate_size"], num_hidden_layers=med_config["num_hidden_layers"],
        num_attention_heads=med_config["num_attention_heads"],
        max_position_embeddings=med_config["max_position_embeddings"], hidden_act=med_config["hidden_act"],
        layer_norm_eps=med_config["layer_norm_eps"], pad_token_id=med_config.get("pad_token_id", 0),
        bos_token_id=None, eos_token_id=None, sep_token_id=None,  # BLIP's captioning ids: unread by the encoder
        is_decoder=True)  # is_decoder builds the cross-attention; the forward runs as an encoder (is_decoder=False)
    return vision, text


class ImageRewardReward(Reward):
    """score = (mlp(text encoder's [CLS] over the prompt, cross-attending to the image) - mean) / std, ImageReward's
    (module docstring; the paper's convention: around 0 for an average image, higher is better).

    checkpoint: the local ``ImageReward.pt`` (THUDM/ImageReward); med_config: its ``med_config.json``; tokenizer: a
    local ``bert-base-uncased`` directory (vocab and tokenizer config); vision_heads: the ViT's attention heads (16
    for the released ViT-L); batch_size: images per forward; dtype: BLIP's (the MLP runs in float32)."""

    name = "imagereward"

    def __init__(self, checkpoint: str, med_config: str, tokenizer: str, vision_heads: int = 16,
                 batch_size: int = 16, dtype: str = "float32"):
        super().__init__()
        from torchvision import transforms
        from transformers import BertTokenizer, BlipTextModel, BlipVisionModel
        from transformers.initialization import no_init_weights

        if batch_size < 1 or vision_heads < 1:
            raise ValueError(f"reward {self.name}: batch_size and vision_heads must be >= 1, got {batch_size}, "
                             f"{vision_heads}")
        if dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ValueError(f"reward {self.name}: dtype must be one of float32, float16, bfloat16, float64, "
                             f"got {dtype!r}")
        checkpoint = require_path(self.name, "checkpoint", checkpoint, False)
        med_config = require_path(self.name, "med_config", med_config, False)
        tokenizer = require_path(self.name, "tokenizer", tokenizer, False)
        raw = torch.load(checkpoint, map_location="cpu", weights_only=True)
        state = {mapped: v for k, v in (raw.items() if isinstance(raw, dict) else ())
                 if (mapped := to_transformers(k)) is not None}
        if "vision.embeddings.patch_embedding.weight" not in state or "head.7.weight" not in state:
            raise ValueError(f"reward {self.name}: checkpoint {checkpoint!r} holds no blip.visual_encoder.patch_embed "
                             f"or mlp.layers.7: not an ImageReward checkpoint")
        width = state["vision.embeddings.patch_embedding.weight"].shape[0]
        if width % vision_heads:
            raise ValueError(f"reward {self.name}: vision_heads must divide the ViT's width {width}, "
                             f"got {vision_heads}")
        with open(med_config) as f:
            vision_config, text_config = configs(state, json.load(f), vision_heads)
        with no_init_weights():  # every weight is the checkpoint's: skip the random init
            self.vision = BlipVisionModel(vision_config)
            self.text = BlipTextModel(text_config, add_pooling_layer=False)
        self.head = reward_head(text_config.hidden_size)
        try:
            missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as err:  # a tensor of the wrong shape
            raise ValueError(f"reward {self.name}: checkpoint {checkpoint!r} does not fit {med_config!r}: "
                             f"{' '.join(str(err).split())[:500]}") from err
        if missing or unexpected:
            raise ValueError(f"reward {self.name}: checkpoint {checkpoint!r} does not fit {med_config!r}: missing "
                             f"{sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
        self.vision.to(getattr(torch, dtype))
        self.text.to(getattr(torch, dtype))
        self.head.to(torch.float64 if dtype == "float64" else torch.float32)  # the package: mlp(features.float())
        self.tokenizer = BertTokenizer.from_pretrained(tokenizer)  # blip.py init_tokenizer
        self.tokenizer.add_special_tokens({"bos_token": "[DEC]"})
        self.tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
        if len(self.tokenizer) > text_config.vocab_size:
            raise ValueError(f"reward {self.name}: tokenizer {tokenizer!r} has {len(self.tokenizer)} tokens with "
                             f"[DEC] and [ENC], the checkpoint's embeddings {text_config.vocab_size}")
        side = vision_config.image_size
        self.preprocess = transforms.Compose([
            transforms.Resize(side, interpolation=transforms.InterpolationMode.BICUBIC), transforms.CenterCrop(side),
            transforms.ToTensor(), transforms.Normalize(CLIP_MEAN, CLIP_STD)])
        self.batch_size = int(batch_size)
        self.freeze()

    def inputs(self, images: Tensor, prompts: list[str]) -> tuple[Tensor, Tensor, Tensor]:
        """(pixel values [B, 3, 224, 224], input ids [B, 35], attention mask [B, 35]) as the package builds them."""
        pixels = torch.stack([self.preprocess(picture) for picture in to_pil(images)])
        text = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=MAX_LENGTH,
                              return_tensors="pt")
        return pixels, text["input_ids"], text["attention_mask"]

    def features(self, pixels: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
        """The text encoder's last hidden state at [CLS], shape [B, D], cross-attending to every ViT output token."""
        weight = self.vision.embeddings.patch_embedding.weight
        image_embeds = self.vision(pixel_values=pixels.to(weight.device, weight.dtype)).last_hidden_state
        image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=weight.device)
        hidden = self.text(input_ids=ids.to(weight.device), attention_mask=mask.to(weight.device),
                           encoder_hidden_states=image_embeds, encoder_attention_mask=image_mask,
                           is_decoder=False).last_hidden_state
        return hidden[:, 0]

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        scores = []
        for start in range(0, len(prompts), self.batch_size):
            batch = self.inputs(images[start:start + self.batch_size], prompts[start:start + self.batch_size])
            cls = self.features(*batch)
            head = self.head[0].weight
            scores.append((self.head(cls.to(head.device, head.dtype)).squeeze(-1) - MEAN) / STD)
        return torch.cat(scores)
