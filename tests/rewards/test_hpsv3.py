"""HPSv3Reward on a tiny random twin saved in the real format: a Qwen2-VL base directory (config, processor,
weights) and an ``HPSv3.safetensors`` in transformers 4.45's key layout with the ``rm_head``. The score is checked
against a float64 reference computed another way: the twin's own model object (not the reloaded one), its full
forward (its own image-feature scatter), the head applied by hand from the checkpoint's raw ``rm_head.{0,3,5}``
tensors at the ``<|Reward|>`` token, output 0 (mu)."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from jagg_lightning.policies.tiny import QWEN_VISION_TOKENS, tiny_qwen_vl_processor
from jagg_lightning.rewards import HPSv3Reward, build_reward
from jagg_lightning.rewards.hpsv3 import INSTRUCTION, REWARD_TOKEN

from in_process import tiny_fit_with_reward
from tiny_vlm import CHAT_TEMPLATE

SMALL = 56 * 56  # pixels per image in the quick tests (the checkpoint's 256 * 28 * 28 in the first)


def to_transformers445(key: str) -> str:
    if key.startswith("model.visual."):
        return key[len("model."):]
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """(base_dir, checkpoint, the twin model with <|Reward|> in float64, the raw checkpoint state)."""
    from transformers import (
        Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor,
    )

    root = tmp_path_factory.mktemp("hpsv3")
    # Qwen2-VL-7B-Instruct's processor, in pixel limits too (the tiny twins' shrink images to 112 x 112)
    patching = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16384, patch_size=14, temporal_patch_size=2, merge_size=2)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**patching),
                                 video_processor=Qwen2VLVideoProcessor(**patching),
                                 tokenizer=tiny_qwen_vl_processor(INSTRUCTION).tokenizer, chat_template=CHAT_TEMPLATE)
    tokenizer = processor.tokenizer
    ids = [tokenizer.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS]
    torch.manual_seed(20250808)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
                         bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3])
    base = Qwen2VLForConditionalGeneration(config).eval()
    base.save_pretrained(root / "Qwen2-VL-base")
    processor.save_pretrained(root / "Qwen2-VL-base")
    # HPSv3's training: <|Reward|> added, the embeddings resized to the tokenizer, a fresh head; all saved
    tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    base.resize_token_embeddings(len(tokenizer))
    head = torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    state = {to_transformers445(k): v.contiguous() for k, v in base.state_dict().items()}
    state |= {f"rm_head.{k}": v for k, v in head.state_dict().items()}
    save_file(state, root / "HPSv3.safetensors")
    return root / "Qwen2-VL-base", root / "HPSv3.safetensors", base.double(), state


def reference(twin, reward, images, prompts) -> torch.Tensor:
    """float64: the twin's own forward (image features scattered by it, positions 0..L-1), the head by hand."""
    _, _, model, state = twin
    batch = reward.inputs(images, prompts)
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, ids.shape[0], -1)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=positions,
                             pixel_values=batch["pixel_values"].double(),
                             image_grid_thw=batch["image_grid_thw"]).last_hidden_state
    h = hidden[ids == reward.reward_id]
    w = {k: state[f"rm_head.{k}"].double() for k in ("0.weight", "0.bias", "3.weight", "3.bias", "5.weight", "5.bias")}
    h = F.relu(F.linear(h, w["0.weight"], w["0.bias"]))
    h = F.relu(F.linear(h, w["3.weight"], w["3.bias"]))
    return F.linear(h, w["5.weight"], w["5.bias"])


def test_hpsv3_scores_mu_at_the_reward_token(twin, rng_seed):
    base, checkpoint = twin[0], twin[1]
    reward = HPSv3Reward(str(checkpoint), str(base), batch_size=2)
    g = torch.Generator().manual_seed(rng_seed)
    images, prompts = torch.rand(3, 3, 48, 48, generator=g), ["a red cat", "two boats at night", "a tree"]
    scores = reward(images, prompts)
    expected = reference(twin, reward, images, prompts)
    torch.testing.assert_close(scores.double(), expected[:, 0], rtol=1e-4, atol=1e-5)  # mu, not sigma
    assert not torch.allclose(expected[:, 0], expected[:, 1])
    # a square image is resized to exactly the checkpoint's 256 x 28 x 28 pixels (448 x 448: 32 x 32 patches of 14)
    assert reward.inputs(images[:1], prompts[:1])["image_grid_thw"].tolist() == [[1, 32, 32]]
    # the frozen-reward contract, and rebuilt from what the hyper-parameters record
    assert not any(p.requires_grad for p in reward.parameters()) and not reward.training
    assert build_reward(reward.describe()).pixels == reward.pixels


def test_hpsv3_refuses_a_checkpoint_that_does_not_fit(twin, tmp_path):
    base, _, _, state = twin
    broken = {k: v for k, v in state.items() if k != "rm_head.3.weight"}
    save_file(broken, tmp_path / "broken.safetensors")
    with pytest.raises(ValueError, match=r"reward hpsv3: checkpoint .*broken.safetensors.* does not fit .*3\.weight"):
        HPSv3Reward(str(tmp_path / "broken.safetensors"), str(base))
    with pytest.raises(FileNotFoundError, match="reward hpsv3: checkpoint"):
        HPSv3Reward(str(tmp_path / "missing.safetensors"), str(base))


@pytest.mark.slow
def test_jagg_fit_with_hpsv3(twin, tmp_path, capfd, monkeypatch):
    proc, root = tiny_fit_with_reward({"class_path": "jagg_lightning.rewards.HPSv3Reward",
                                       "init_args": {"checkpoint": str(twin[1]), "base_model": str(twin[0]),
                                                     "pixels": SMALL}}, tmp_path, capfd, monkeypatch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train/reward/hpsv3" in (root / "lightning_logs" / "version_0" / "metrics.csv").read_text()
