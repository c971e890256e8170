"""The scenes model's parts: its word-level tokenizer, the pipeline's components, the data and the VAE stage.

Used by the recipe (:mod:`jagg_lightning.testbed.scenes.train`); plain torch / diffusers / transformers.

* :func:`word_tokenizer`: a ``CLIPTokenizer`` (CLIP's own BPE class, so the saved pipeline loads as any SD3 one)
  whose merges are learnt, offline, from the caption words alone until every word is one token: each caption word
  is exactly one token ``word</w>``. A word outside the captions falls apart into the sub-word pieces the merges
  reach (as CLIP's tokenizer does with a rare word; those pieces are never trained), a character that occurs in
  no caption word into ``<|unk|>``. The recipe refuses a caption with a word outside the vocabulary
  (:func:`words_outside`).
* :func:`build_components`: the two CLIP text encoders, a small ``AutoencoderKL`` (64 px RGB <-> 8 x 16 x 16) and an
  ``SD3Transformer2DModel`` (patch 2 -> 64 image tokens).
* :func:`render_set`: a fixed set of scenes rendered from metadata rows with one seeded generator.
* :func:`train_vae`: MSE + a small KL term; ``shift_factor`` / ``scaling_factor`` from the train latents.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

IMAGE_SIZE = 64
LATENT_CHANNELS = 8
SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|unk|>")  # ids 0, 1 (also padding), 2
TOKENIZER_LENGTH = 16  # the longest caption (10 words) plus start and end, with room
MAX_SEQUENCE_LENGTH = 4  # zero "T5" tokens the SD3 pipeline appends when it has no T5 encoder


def caption_words(rows: list[dict]) -> list[str]:
    """The sorted words of the rows' prompts (whitespace-split, lower case)."""
    return sorted({w for row in rows for w in row["prompt"].lower().split()})


def words_outside(prompt: str, words) -> list[str]:
    """The words of ``prompt`` that are not in ``words``."""
    known = set(words)
    return [w for w in prompt.lower().split() if w not in known]


def _learn_merges(words: list[str]) -> list[tuple[str, str]]:
    """BPE merges learnt from the word list until every word is one symbol (most frequent pair first, ties by
    the pair's text): encoding a listed word replays them, so it becomes its single token."""
    segments = {w: list(w[:-1]) + [w[-1] + "</w>"] for w in words}
    merges = []
    while any(len(s) > 1 for s in segments.values()):
        pairs = Counter((a, b) for s in segments.values() for a, b in zip(s, s[1:]))
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append((a, b))
        for w, s in segments.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            segments[w] = out
    return merges


def word_tokenizer(words: list[str], max_length: int = TOKENIZER_LENGTH):
    """A CLIP BPE tokenizer, built offline, in which every word of ``words`` is one token (module docstring).

    Ids: the special tokens 0-2, then the words in order (``words[i]`` -> ``3 + i``), then the sub-word pieces."""
    from transformers import CLIPTokenizer

    if any(not w.isalpha() or not w.islower() for w in words):
        raise ValueError(f"word_tokenizer: words must be lower-case letters only, got {words!r}")
    merges = _learn_merges(list(words))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for w in words:
        vocab[w + "</w>"] = len(vocab)
    pieces = sorted({c for w in words for c in w[:-1]} | {w[-1] + "</w>" for w in words})
    for token in pieces + [a + b for a, b in merges]:
        vocab.setdefault(token, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length, unk_token=SPECIAL_TOKENS[2])


def build_components(seed: int, words: list[str], layers: int, heads: int, head_dim: int, text_width: int,
                     latent_channels: int = LATENT_CHANNELS):
    """(tokenizer, tokenizer_2, text_encoder, text_encoder_2, vae, transformer), initialised from ``seed``."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = word_tokenizer(words), word_tokenizer(words)
    clip_cfg = dict(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=TOKENIZER_LENGTH, projection_dim=text_width, bos_token_id=0,
        eos_token_id=1, pad_token_id=1, hidden_act="gelu",
    )
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 3,
        up_block_types=["UpDecoderBlock2D"] * 3, block_out_channels=(16, 32, 32), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=8, mid_block_add_attention=False, sample_size=IMAGE_SIZE,
        scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,
    )
    latent_side = IMAGE_SIZE // 4
    transformer = SD3Transformer2DModel(
        sample_size=latent_side, patch_size=2, in_channels=latent_channels, out_channels=latent_channels,
        num_layers=layers, attention_head_dim=head_dim, num_attention_heads=heads,
        joint_attention_dim=2 * text_width, caption_projection_dim=heads * head_dim,
        pooled_projection_dim=2 * text_width, pos_embed_max_size=latent_side,
    )
    return tokenizer, tokenizer_2, text_encoder, text_encoder_2, vae, transformer


def render_set(rows: list[dict], per_task: int, seed: int, object_size: tuple[float, float] | None = None,
               layout: str = "free") -> tuple[torch.Tensor, list[dict]]:
    """``per_task`` scenes of each task in ``rows`` (its rows in turn), rendered by ``scene_for`` (objects' sides
    drawn in ``object_size`` of the image; None: the test bed's ``render.OBJECT_SIZE``; placed by ``layout``) from
    one generator seeded with ``seed``: (images [N, 3, 64, 64] in [0, 1], the row of each), task-major."""
    from jagg_lightning.testbed.scenes.render import OBJECT_SIZE, render, scene_for

    object_size = object_size or OBJECT_SIZE

    rng = np.random.default_rng(seed)
    by_task: dict[str, list[dict]] = {}
    for row in rows:
        by_task.setdefault(row["tag"], []).append(row)
    images, which = [], []
    for task_rows in by_task.values():
        for i in range(per_task):
            row = task_rows[i % len(task_rows)]
            images.append(np.asarray(render(scene_for(row, rng, IMAGE_SIZE, object_size=object_size, layout=layout))))
            which.append(row)
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255
    return pixels, which


def train_vae(vae, images: torch.Tensor, steps: int, batch_size: int, lr: float, seed: int, log) -> dict:
    """MSE + 1e-4 x KL per latent element on ``images`` ([N, 3, H, W] in [0, 1]); sets shift / scaling factors."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    losses, kl_weight = [], 1e-4
    vae.train()
    for step in range(steps):
        x = images[torch.randint(0, len(images), (batch_size,), generator=gen)] * 2 - 1
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        rec = F.mse_loss(vae.decode(z).sample, x)
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        loss = rec + kl_weight * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(rec.detach()))
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step}: recon mse {rec:.5f} kl {kl:.3f}")
    vae.eval().requires_grad_(False)
    mean, _ = encode(vae, images)
    shift, scale = float(mean.mean()), float(1.0 / mean.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    tail = losses[-50:]
    return {"steps": steps, "batch_size": batch_size, "lr": lr, "kl_weight": kl_weight,
            "final_recon_mse": sum(tail) / len(tail), "shift_factor": shift, "scaling_factor": scale}


@torch.no_grad()
def encode(vae, images: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of each image ([0, 1]) in the VAE's raw latent space (before shift / scale)."""
    means, stds = [], []
    for i in range(0, len(images), chunk):
        dist = vae.encode(images[i:i + chunk] * 2 - 1).latent_dist
        means.append(dist.mean)
        stds.append(dist.std)
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def decode(vae, latents: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Raw latents -> images in [0, 1]."""
    return torch.cat([(vae.decode(latents[i:i + chunk]).sample / 2 + 0.5).clamp(0, 1)
                      for i in range(0, len(latents), chunk)])


def parameter_counts(**modules) -> dict[str, int]:
    return {name: sum(p.numel() for p in m.parameters()) for name, m in modules.items()}
