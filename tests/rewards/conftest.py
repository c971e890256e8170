"""The reward tests' shared tiny checkpoints, saved locally once per session like downloaded ones."""

import pytest
import torch
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

from jagg_lightning.policies.tiny import tiny_clip_tokenizer


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory):
    """A tiny CLIPModel + processor (character-level tokenizer), saved like a downloaded checkpoint.

    Init seed 1240 gives positive image-text cosines for these prompts (CLIPScore clamps negatives to 0,
    which would hide any prompt dependence)."""
    root = tmp_path_factory.mktemp("clip")
    torch.manual_seed(1240)
    tokenizer = tiny_clip_tokenizer()
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=8,
    )
    CLIPModel(config).save_pretrained(root)
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=tokenizer)
    processor.save_pretrained(root)
    return root
