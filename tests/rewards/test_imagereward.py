"""ImageRewardReward on a tiny random twin saved in the real format: ``ImageReward.pt`` a plain state dict with the
package's key names (BLIP's timm ViT ``blip.visual_encoder.*``, its med.py BERT ``blip.text_encoder.*`` with the
``position_ids`` buffer, the unused ``blip.{vision,text}_proj``, the head ``mlp.layers.{0,2,4,6,7}``), a tiny
``med_config.json`` and a tiny BERT tokenizer folder. The score is checked against a float64 reference written from
the package's source (ImageReward/models/BLIP/vit.py, med.py, ImageReward.py) in plain torch on the raw checkpoint
tensors, its pixels preprocessed with PIL directly. (The package's own BLIP code cannot be the reference: image-reward
1.5 imports timm 0.6 / fairscale and transformers 4.x names that transformers 5 removed.)"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from jagg_lightning.rewards import ImageRewardReward, build_reward, to_pil

from in_process import tiny_fit_with_reward

WORDS = ["a", "red", "cat", "two", "boats", "at", "night", "tree", "on", "hill", "the", "blue", "sky"]
VISION = dict(width=16, depth=2, heads=2, mlp=32, patch=16, side=224)  # ViT-L/16 at 224, shrunk in width and depth
TEXT = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=40, layer_norm_eps=1e-12, hidden_act="gelu")


def random_state(vocab: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Every tensor ImageReward.pt holds, under its own key names, random (LayerNorm scales around 1)."""
    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    def norm(prefix, width):
        return {f"{prefix}.weight": 1 + rand(width, scale=0.1), f"{prefix}.bias": rand(width, scale=0.1)}

    def linear(prefix, n_in, n_out):
        return {f"{prefix}.weight": rand(n_out, n_in, scale=n_in ** -0.5), f"{prefix}.bias": rand(n_out, scale=0.1)}

    w, d, p = VISION["width"], TEXT["hidden_size"], VISION["patch"]
    tokens = (VISION["side"] // p) ** 2 + 1
    vit = "blip.visual_encoder"
    state = {f"{vit}.cls_token": rand(1, 1, w), f"{vit}.pos_embed": rand(1, tokens, w),
             f"{vit}.patch_embed.proj.weight": rand(w, 3, p, p, scale=0.05), f"{vit}.patch_embed.proj.bias": rand(w)}
    for i in range(VISION["depth"]):
        block = f"{vit}.blocks.{i}"
        state |= norm(f"{block}.norm1", w) | norm(f"{block}.norm2", w) | linear(f"{block}.attn.qkv", w, 3 * w)
        state |= linear(f"{block}.attn.proj", w, w) | linear(f"{block}.mlp.fc1", w, VISION["mlp"])
        state |= linear(f"{block}.mlp.fc2", VISION["mlp"], w)
    state |= norm(f"{vit}.norm", w)
    bert = "blip.text_encoder"
    state |= {f"{bert}.embeddings.word_embeddings.weight": rand(vocab, d),
              f"{bert}.embeddings.position_embeddings.weight": rand(TEXT["max_position_embeddings"], d),
              f"{bert}.embeddings.position_ids": torch.arange(TEXT["max_position_embeddings"]).expand(1, -1)}
    state |= norm(f"{bert}.embeddings.LayerNorm", d)
    for i in range(TEXT["num_hidden_layers"]):
        layer = f"{bert}.encoder.layer.{i}"
        for attention, memory in (("attention", d), ("crossattention", w)):
            a = f"{layer}.{attention}"
            state |= linear(f"{a}.self.query", d, d) | linear(f"{a}.self.key", memory, d)
            state |= linear(f"{a}.self.value", memory, d) | linear(f"{a}.output.dense", d, d)
            state |= norm(f"{a}.output.LayerNorm", d)
        state |= linear(f"{layer}.intermediate.dense", d, TEXT["intermediate_size"])
        state |= linear(f"{layer}.output.dense", TEXT["intermediate_size"], d) | norm(f"{layer}.output.LayerNorm", d)
    state |= linear("blip.vision_proj", w, 8) | linear("blip.text_proj", d, 8)  # BLIP's contrastive heads: unused
    for index, (n_in, n_out) in zip((0, 2, 4, 6, 7), ((d, 1024), (1024, 128), (128, 64), (64, 16), (16, 1))):
        state |= linear(f"mlp.layers.{index}", n_in, n_out)
    return state


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """(folder, the raw state dict): ImageReward.pt, med_config.json and bert-tokenizer/ inside."""
    root = tmp_path_factory.mktemp("imagereward")
    tokenizer = root / "bert-tokenizer"  # what bert-base-uncased's folder holds: its vocabulary and config
    tokenizer.mkdir()
    (tokenizer / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "model_max_length": 512}))
    vocab = len(WORDS) + 5 + 2  # bert-base-uncased's 30522 + [DEC] + [ENC] = 30524 in the real med_config.json
    (root / "med_config.json").write_text(json.dumps(
        {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_dropout_prob": 0.1,
         "initializer_range": 0.02, "model_type": "bert", "pad_token_id": 0, "type_vocab_size": 2,
         "vocab_size": vocab, "encoder_width": 768, "add_cross_attention": True, **TEXT}))
    state = random_state(vocab, torch.Generator().manual_seed(20230328))
    torch.save(state, root / "ImageReward.pt")
    return root, state


def paths(root) -> dict:
    return {"checkpoint": str(root / "ImageReward.pt"), "med_config": str(root / "med_config.json"),
            "tokenizer": str(root / "bert-tokenizer"), "vision_heads": VISION["heads"]}


def layer_norm(x, s, prefix, eps):
    return F.layer_norm(x, x.shape[-1:], s[f"{prefix}.weight"], s[f"{prefix}.bias"], eps)


def linear(x, s, prefix):
    return F.linear(x, s[f"{prefix}.weight"], s[f"{prefix}.bias"])


def attention(q, k, v, heads, additive_mask=None):
    split = lambda t: t.unflatten(-1, (heads, -1)).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if additive_mask is not None:
        scores = scores + additive_mask
    return (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)


def reference(state, pixels, ids, mask) -> torch.Tensor:
    """float64 ImageReward.score from the raw checkpoint: vit.py's VisionTransformer, med.py's BertModel in
    'multimodal' mode (BERT's -10000 additive padding mask), ImageReward.py's MLP and standardisation."""
    s = {k: v.double() for k, v in state.items() if v.is_floating_point()}
    vit, heads = "blip.visual_encoder", VISION["heads"]
    x = F.conv2d(pixels.double(), s[f"{vit}.patch_embed.proj.weight"], s[f"{vit}.patch_embed.proj.bias"],
                 stride=VISION["patch"]).flatten(2).transpose(1, 2)
    x = torch.cat([s[f"{vit}.cls_token"].expand(x.shape[0], -1, -1), x], 1) + s[f"{vit}.pos_embed"]
    for i in range(VISION["depth"]):
        b = f"{vit}.blocks.{i}"
        q, k, v = linear(layer_norm(x, s, f"{b}.norm1", 1e-6), s, f"{b}.attn.qkv").chunk(3, -1)
        x = x + linear(attention(q, k, v, heads), s, f"{b}.attn.proj")
        x = x + linear(F.gelu(linear(layer_norm(x, s, f"{b}.norm2", 1e-6), s, f"{b}.mlp.fc1")), s, f"{b}.mlp.fc2")
    image = layer_norm(x, s, f"{vit}.norm", 1e-6)
    bert, heads, eps = "blip.text_encoder", TEXT["num_attention_heads"], TEXT["layer_norm_eps"]
    h = s[f"{bert}.embeddings.word_embeddings.weight"][ids] + s[f"{bert}.embeddings.position_embeddings.weight"][
        torch.arange(ids.shape[1])]
    h = layer_norm(h, s, f"{bert}.embeddings.LayerNorm", eps)
    padding = ((1.0 - mask.double()) * -10000.0)[:, None, None, :]
    for i in range(TEXT["num_hidden_layers"]):
        lay = f"{bert}.encoder.layer.{i}"
        for name, memory, additive in (("attention", h, padding), ("crossattention", image, None)):
            a = f"{lay}.{name}"
            context = attention(linear(h, s, f"{a}.self.query"), linear(memory, s, f"{a}.self.key"),
                                linear(memory, s, f"{a}.self.value"), heads, additive)
            h = layer_norm(linear(context, s, f"{a}.output.dense") + h, s, f"{a}.output.LayerNorm", eps)
        ffn = linear(F.gelu(linear(h, s, f"{lay}.intermediate.dense")), s, f"{lay}.output.dense")
        h = layer_norm(ffn + h, s, f"{lay}.output.LayerNorm", eps)
    r = h[:, 0]
    for index in (0, 2, 4, 6, 7):  # no activation: the authors commented the ReLUs out
        r = linear(r, s, f"mlp.layers.{index}")
    return ((r - 0.16717362830052426) / 1.0333394966054072).squeeze(-1)  # ImageReward.py: self.mean, self.std


def pil_pixels(images: torch.Tensor) -> torch.Tensor:
    """The package's transform for square images, with PIL and numpy: bicubic to 224 x 224, CLIP mean / std."""
    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
    arrays = [np.asarray(p.resize((224, 224), Image.BICUBIC), dtype=np.float64) / 255 for p in to_pil(images)]
    return torch.from_numpy((np.stack(arrays) - mean) / std).permute(0, 3, 1, 2)


def test_imagereward_matches_a_float64_reference_on_the_real_layout(twin, rng_seed):
    root, state = twin
    reward = ImageRewardReward(**paths(root), batch_size=2, dtype="float64")
    g = torch.Generator().manual_seed(rng_seed)
    images, prompts = torch.rand(3, 3, 48, 48, generator=g), ["a red cat", "Two Boats at night", "a tree on a hill"]
    pixels, ids, mask = reward.inputs(images, prompts)
    # the package's text input: 35 tokens, [CLS] first (no [ENC] swapped in), padded with [PAD] = 0
    assert ids.shape == (3, 35) and (ids[:, 0] == reward.tokenizer.cls_token_id).all()
    assert (ids[mask == 0] == 0).all() and mask.sum(1).tolist() == [5, 6, 7]  # lower-cased: no [UNK]
    assert not (ids == reward.tokenizer.unk_token_id).any()
    torch.testing.assert_close(pixels.double(), pil_pixels(images), rtol=0, atol=1e-5)
    expected = reference(state, pixels, ids, mask)  # the same float32 pixels (checked just above)
    scores = reward(images, prompts)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(reward.score(images, prompts), expected, rtol=1e-9, atol=1e-9)
    assert expected.std() > 1e-3  # the images and prompts are told apart
    # every weight comes from the checkpoint: all but the 5 unused tensors, none left at an initial value
    assert len(list(reward.parameters())) == len(state) - 5
    # the frozen-reward contract, and rebuilt from what the hyper-parameters record
    assert not any(p.requires_grad for p in reward.parameters()) and not reward.training
    assert build_reward(reward.describe()).batch_size == 2


def test_imagereward_in_float32_and_bfloat16(twin, rng_seed):
    root, state = twin
    g = torch.Generator().manual_seed(rng_seed)
    images, prompts = torch.rand(2, 3, 32, 32, generator=g), ["the blue sky", "a cat"]
    reward = ImageRewardReward(**paths(root))
    expected = reference(state, *reward.inputs(images, prompts)).float()
    torch.testing.assert_close(reward(images, prompts), expected, rtol=1e-4, atol=1e-4)
    half = ImageRewardReward(**paths(root), dtype="bfloat16")
    assert half.head[0].weight.dtype == torch.float32  # the MLP in float32, BLIP in bfloat16
    assert half.text.embeddings.word_embeddings.weight.dtype == torch.bfloat16
    assert half.vision.post_layernorm.weight.dtype == torch.bfloat16
    torch.testing.assert_close(half(images, prompts), expected, rtol=0.1, atol=0.1)


def test_imagereward_refuses_a_checkpoint_that_does_not_fit(twin, tmp_path):
    root, state = twin
    args = paths(root)
    dropped = "blip.text_encoder.encoder.layer.1.crossattention.self.key.bias"
    torch.save({k: v for k, v in state.items() if k != dropped}, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match=r"reward imagereward: checkpoint .*missing.pt.* does not fit .*missing .*"
                                         r"text\.encoder\.layer\.1\.crossattention\.self\.key\.bias"):
        ImageRewardReward(**(args | {"checkpoint": str(tmp_path / "missing.pt")}))
    torch.save(state | {"blip.itm_head.weight": torch.zeros(2, 16)}, tmp_path / "extra.pt")
    with pytest.raises(ValueError, match=r"unexpected \['blip\.itm_head\.weight'\]"):
        ImageRewardReward(**(args | {"checkpoint": str(tmp_path / "extra.pt")}))
    torch.save({"state_dict": state}, tmp_path / "wrapped.pt")
    with pytest.raises(ValueError, match="not an ImageReward checkpoint"):
        ImageRewardReward(**(args | {"checkpoint": str(tmp_path / "wrapped.pt")}))
    with pytest.raises(ValueError, match="reward imagereward: vision_heads must divide the ViT's width 16, got 3"):
        ImageRewardReward(**(args | {"vision_heads": 3}))
    with pytest.raises(FileNotFoundError, match="reward imagereward: med_config"):
        ImageRewardReward(**(args | {"med_config": str(tmp_path / "med_config.json")}))
    with pytest.raises(ValueError, match="reward imagereward: dtype must be one of"):
        ImageRewardReward(**args, dtype="float8")


@pytest.mark.slow
def test_jagg_fit_with_imagereward(twin, tmp_path, capfd, monkeypatch):
    proc, root = tiny_fit_with_reward({"class_path": "jagg_lightning.rewards.ImageRewardReward",
                                       "init_args": paths(twin[0])}, tmp_path, capfd, monkeypatch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train/reward/imagereward" in (root / "lightning_logs" / "version_0" / "metrics.csv").read_text()
