"""The digits test bed recipe: ``python -m jagg_lightning.testbed.train`` (about 10 minutes of one CPU core).

Deterministic (fixed seeds, fixed thread count, deterministic algorithms), from data that ships with
scikit-learn (``load_digits``: 1,797 8x8 greyscale digits, no download). Four stages:

1. split: stratified 80 / 20 train / test split of the images (seed ``--seed``);
2. classifier: :class:`~jagg_lightning.rewards.digits.DigitClassifier` on the train split (shifted,
   noised, contrast-jittered copies, so that it reads generated digits too) -> ``digits_classifier.safetensors``;
3. VAE: a small ``AutoencoderKL`` (32 px RGB, latent 4 x 8 x 8) on the train split, MSE plus a small KL
   term; its ``shift_factor`` / ``scaling_factor`` are set from the train latents' mean and std;
4. transformer: a small ``SD3Transformer2DModel`` (patch 2 -> 16 image tokens) and the pipeline's two
   CLIP text encoders (character-level tokenizer built offline), trained jointly with the
   rectified-flow objective ||v(z_t, t, c) - (eps - x)||^2, z_t = (1 - t) x + t eps, t ~ logit-normal,
   on prompts from every template (train and held-out); 10 % of prompts are dropped to "" so
   classifier-free guidance works; an auxiliary linear probe on the pooled text embedding
   (cross-entropy on the named digit, weight ``--aux-weight``) speeds up learning the character-level
   prompt -> digit map. An EMA of the weights is what is saved.

Then the pipeline is saved with ``save_pretrained`` (safetensors) and evaluated through
``StableDiffusion3Pipeline.__call__`` (ODE / Euler, the configured CFG and step count) on the
held-out prompts: the share of samples the classifier reads as the named digit, per digit. Everything
(split, seeds, steps, losses reached, accuracies, timings) goes to ``training_info.json``.

scikit-learn is needed here only (it is in the ``test`` extra); the shipped weights load without it.
The independent judge (:mod:`jagg_lightning.testbed.judge`) is fitted on the same split by its own module.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from jagg_lightning.rewards.digits import CLASSIFIER_PATH, DIGIT_WORDS, DigitClassifier, prompt_digit, to_digit_grid
from jagg_lightning.testbed import HELDOUT_TEMPLATES, PIPELINE_DIR, TRAIN_TEMPLATES, digit_prompts

IMAGE_SIZE = 32
TOKENIZER_LENGTH = 24  # character-level tokens: the longest template plus start and end
MAX_SEQUENCE_LENGTH = 4  # zero "T5" tokens the SD3 pipeline appends when it has no T5 encoder


def load_split(seed: int):
    """(train images [N, 8, 8] in [0, 1], train labels, test images, test labels, test indices)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    index = np.arange(len(data.target))
    train_idx, test_idx = train_test_split(index, test_size=0.2, stratify=data.target, random_state=seed)
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
    images = torch.tensor(data.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    return images[train_idx], labels[train_idx], images[test_idx], labels[test_idx], test_idx.tolist()


def to_rgb(images8: torch.Tensor, size: int = IMAGE_SIZE) -> torch.Tensor:
    """[N, 8, 8] in [0, 1] -> [N, 3, size, size] in [0, 1] (bilinear upsampling, grey in all channels)."""
    up = F.interpolate(images8[:, None], size=size, mode="bilinear", align_corners=False).clamp(0, 1)
    return up.repeat(1, 3, 1, 1)


def augment(images: torch.Tensor, generator: torch.Generator, max_shift: int = 3) -> torch.Tensor:
    """Random translation (zero fill), contrast and additive noise, for the classifier."""
    n, _, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4)
    dx = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator)
    dy = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator)
    out = torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(n)])
    contrast = 0.6 + 0.4 * torch.rand(n, 1, 1, 1, generator=generator)
    noise = 0.08 * torch.rand(n, 1, 1, 1, generator=generator) * torch.randn(out.shape, generator=generator)
    return (out * contrast + noise).clamp(0, 1)


def train_classifier(x_train, y_train, x_test, y_test, steps: int, seed: int, log):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DigitClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    rgb_train = to_rgb(x_train)
    losses = []
    for step in range(steps):
        idx = torch.randint(0, len(y_train), (128,), generator=gen)
        logits = model(to_digit_grid(augment(rgb_train[idx], gen)))
        loss = F.cross_entropy(logits, y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss))
        if step % 200 == 0:
            log(f"classifier step {step}: loss {loss:.4f}")
    model.eval()
    with torch.no_grad():
        acc = float((model(to_digit_grid(to_rgb(x_test))).argmax(-1) == y_test).float().mean())
        shifted = augment(to_rgb(x_test), torch.Generator().manual_seed(seed + 1))
        acc_aug = float((model(to_digit_grid(shifted)).argmax(-1) == y_test).float().mean())
    return model, {"steps": steps, "batch_size": 128, "lr": 2e-3, "final_loss": _tail(losses),
                   "test_accuracy": acc, "test_accuracy_augmented": acc_aug}


def build_components(seed: int, layers: int):
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from jagg_lightning.policies.tiny import tiny_clip_tokenizer

    torch.manual_seed(seed)
    tokenizer = tiny_clip_tokenizer(TOKENIZER_LENGTH)
    clip_cfg = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length, projection_dim=32, bos_token_id=0, eos_token_id=1,
        pad_token_id=1, hidden_act="gelu",
    )
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 3,
        up_block_types=["UpDecoderBlock2D"] * 3, block_out_channels=(8, 16, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, mid_block_add_attention=False, sample_size=IMAGE_SIZE, scaling_factor=1.0, shift_factor=0.0,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    transformer = SD3Transformer2DModel(
        sample_size=IMAGE_SIZE // 4, patch_size=2, in_channels=4, out_channels=4, num_layers=layers,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=64,
        pooled_projection_dim=64, pos_embed_max_size=IMAGE_SIZE // 4,
    )
    return tokenizer, text_encoder, text_encoder_2, vae, transformer


def train_vae(vae, x_train, x_test, steps: int, seed: int, log):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    rgb = to_rgb(x_train) * 2 - 1
    losses, kl_weight = [], 1e-4
    vae.train()
    for step in range(steps):
        idx = torch.randint(0, len(rgb), (32,), generator=gen)
        x = rgb[idx]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        recon = vae.decode(z).sample
        rec = F.mse_loss(recon, x)
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        loss = rec + kl_weight * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(rec))
        if step % 200 == 0:
            log(f"vae step {step}: recon mse {rec:.5f} kl {kl:.3f}")
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        mean = vae.encode(rgb).latent_dist.mean
        test = to_rgb(x_test) * 2 - 1
        test_mse = float(F.mse_loss(vae.decode(vae.encode(test).latent_dist.mean).sample, test))
    shift, scale = float(mean.mean()), float(1.0 / mean.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return {"steps": steps, "batch_size": 32, "lr": 2e-3, "kl_weight": kl_weight, "final_recon_mse": _tail(losses),
            "test_recon_mse": test_mse, "shift_factor": shift, "scaling_factor": scale}


def encode_latents(vae, images8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of each image, in the transformer's (shifted, scaled) latent space."""
    cfg = vae.config
    with torch.no_grad():
        dist = vae.encode(to_rgb(images8) * 2 - 1).latent_dist
    return (dist.mean - cfg.shift_factor) * cfg.scaling_factor, dist.std * cfg.scaling_factor


class _EMA:
    def __init__(self, modules, decay: float):
        self.params = [p for m in modules for p in m.parameters()]
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay = decay

    @torch.no_grad()
    def update(self, step: int):
        d = min(self.decay, (1 + step) / (10 + step))
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1 - d)

    @torch.no_grad()
    def copy_to_params(self):
        for s, p in zip(self.shadow, self.params):
            p.copy_(s)


def train_transformer(pipe, lat_mean, lat_std, labels, lat_test, labels_test, steps: int, batch_size: int, lr: float,
                      aux_weight: float, seed: int, log):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    for m in modules:
        m.train().requires_grad_(True)
    probe = torch.nn.Linear(64, 10)
    params = [p for m in modules for p in m.parameters()] + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / steps)).item()))
    ema = _EMA(modules, 0.995)
    templates = TRAIN_TEMPLATES + HELDOUT_TEMPLATES
    words = [[t.format(d=d, w=DIGIT_WORDS[d]) for t in templates] for d in range(10)]
    flow_losses, aux_losses = [], []
    for step in range(steps):
        idx = torch.randint(0, len(labels), (batch_size,), generator=gen)
        y = labels[idx]
        choice = torch.randint(0, len(templates), (batch_size,), generator=gen)
        drop = torch.rand(batch_size, generator=gen) < 0.1
        prompts = ["" if drop[i] else words[int(y[i])][int(choice[i])] for i in range(batch_size)]
        x = lat_mean[idx] + lat_std[idx] * torch.randn(lat_mean[idx].shape, generator=gen)
        eps = torch.randn(x.shape, generator=gen)
        t = torch.sigmoid(torch.randn(batch_size, generator=gen))
        zt = (1 - t)[:, None, None, None] * x + t[:, None, None, None] * eps
        pe, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device="cpu",
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=MAX_SEQUENCE_LENGTH)
        v = pipe.transformer(hidden_states=zt, timestep=t * 1000, encoder_hidden_states=pe, pooled_projections=pooled,
                             return_dict=False)[0]
        flow = F.mse_loss(v, eps - x)
        keep = ~drop
        aux = F.cross_entropy(probe(pooled[keep]), y[keep]) if keep.any() else pooled.sum() * 0
        loss = flow + aux_weight * aux
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema.update(step)
        flow_losses.append(float(flow))
        aux_losses.append(float(aux))
        if step % 200 == 0:
            log(f"transformer step {step}: flow {flow:.4f} aux {aux:.4f}")
    ema.copy_to_params()
    for m in modules:
        m.eval().requires_grad_(False)
    # held-out flow loss at fixed noise and times: the test split, prompts of the first train template
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        eps = torch.randn(lat_test.shape, generator=g)
        t = torch.rand(len(lat_test), generator=g)
        zt = (1 - t)[:, None, None, None] * lat_test + t[:, None, None, None] * eps
        prompts = [TRAIN_TEMPLATES[0].format(d=int(d), w=DIGIT_WORDS[int(d)]) for d in labels_test]
        pe, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device="cpu",
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=MAX_SEQUENCE_LENGTH)
        v = pipe.transformer(hidden_states=zt, timestep=t * 1000, encoder_hidden_states=pe, pooled_projections=pooled,
                             return_dict=False)[0]
        test_flow = float(F.mse_loss(v, eps - lat_test))
    return {"steps": steps, "batch_size": batch_size, "lr": lr, "warmup": warmup, "ema_decay": 0.995,
            "prompt_dropout": 0.1, "aux_weight": aux_weight, "timestep_density": "logit-normal(0, 1)",
            "final_flow_loss": _tail(flow_losses), "final_aux_loss": _tail(aux_losses), "test_flow_loss": test_flow}


@torch.no_grad()
def evaluate(pipe, classifier, prompts: list[str], samples_per_prompt: int, guidance_scale: float, num_steps: int,
             seed: int) -> dict:
    """Share of samples (pipeline ODE sampling) that the classifier reads as the prompted digit, per digit."""
    correct = torch.zeros(10)
    total = torch.zeros(10)
    for i in range(samples_per_prompt):
        gens = [torch.Generator().manual_seed(seed * 1000 + i * 100 + j) for j in range(len(prompts))]
        images = pipe(prompt=prompts, num_inference_steps=num_steps, guidance_scale=guidance_scale,
                      height=IMAGE_SIZE, width=IMAGE_SIZE, generator=gens, output_type="pt",
                      max_sequence_length=MAX_SEQUENCE_LENGTH).images
        target = torch.tensor([prompt_digit(p) for p in prompts])
        hit = classifier(to_digit_grid(images.clamp(0, 1))).argmax(-1) == target
        correct.index_add_(0, target, hit.float())
        total.index_add_(0, target, torch.ones(len(prompts)))
    per_digit = (correct / total).tolist()
    return {"accuracy": float(correct.sum() / total.sum()), "per_digit": [round(a, 4) for a in per_digit],
            "samples": int(total.sum()), "guidance_scale": guidance_scale, "num_steps": num_steps}


def _tail(values: list[float], n: int = 100) -> float:
    tail = values[-n:]
    return float(sum(tail) / len(tail))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(PIPELINE_DIR), help="pipeline directory (overwritten)")
    parser.add_argument("--classifier-out", default=str(CLASSIFIER_PATH))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--classifier-steps", type=int, default=1500)
    parser.add_argument("--vae-steps", type=int, default=800)
    parser.add_argument("--dit-steps", type=int, default=700)
    parser.add_argument("--dit-batch", type=int, default=64)
    parser.add_argument("--dit-lr", type=float, default=1e-3)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--aux-weight", type=float, default=0.1)
    parser.add_argument("--eval-guidance", type=float, default=2.0)
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument("--eval-samples", type=int, default=4, help="samples per held-out prompt")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    start = time.time()
    cpu_start = time.process_time()

    def log(msg):
        print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)

    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from jagg_lightning.policies.tiny import tiny_clip_tokenizer

    x_train, y_train, x_test, y_test, test_idx = load_split(args.seed)
    log(f"split: {len(y_train)} train / {len(y_test)} test images")
    classifier, classifier_info = train_classifier(x_train, y_train, x_test, y_test, args.classifier_steps,
                                                   args.seed, log)
    log(f"classifier test accuracy {classifier_info['test_accuracy']:.4f}")

    tokenizer, te1, te2, vae, transformer = build_components(args.seed, args.layers)
    vae_info = train_vae(vae, x_train, x_test, args.vae_steps, args.seed, log)
    log(f"vae test recon mse {vae_info['test_recon_mse']:.5f}")
    lat_mean, lat_std = encode_latents(vae, x_train)
    lat_test, _ = encode_latents(vae, x_test)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=te1,
        tokenizer=tokenizer, text_encoder_2=te2, tokenizer_2=tiny_clip_tokenizer(TOKENIZER_LENGTH), text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    dit_info = train_transformer(pipe, lat_mean, lat_std, y_train, lat_test, y_test, args.dit_steps, args.dit_batch,
                                 args.dit_lr, args.aux_weight, args.seed, log)
    log(f"transformer test flow loss {dit_info['test_flow_loss']:.4f}")
    train_seconds, train_cpu = time.time() - start, time.process_time() - cpu_start

    base = evaluate(pipe, classifier, digit_prompts(HELDOUT_TEMPLATES), args.eval_samples, args.eval_guidance,
                    args.eval_steps, args.seed + 100)
    log(f"base held-out accuracy {base['accuracy']:.3f} per digit {base['per_digit']}")
    no_cfg = evaluate(pipe, classifier, digit_prompts(HELDOUT_TEMPLATES), args.eval_samples, 1.0, args.eval_steps,
                      args.seed + 100)
    log(f"base held-out accuracy without CFG {no_cfg['accuracy']:.3f}")

    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    info = {
        "recipe": "python -m jagg_lightning.testbed.train " + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed, "threads": args.threads,
        "data": {"source": "sklearn.datasets.load_digits", "split": "stratified train_test_split test_size=0.2",
                 "random_state": args.seed, "train_images": len(y_train), "test_images": len(y_test),
                 "test_indices": test_idx},
        "image_size": IMAGE_SIZE, "max_sequence_length": MAX_SEQUENCE_LENGTH, "scheduler_shift": 3.0,
        "prompt_templates": {"train": list(TRAIN_TEMPLATES), "heldout": list(HELDOUT_TEMPLATES)},
        "classifier": classifier_info, "vae": vae_info, "transformer": dit_info,
        "parameters": {name: sum(p.numel() for p in m.parameters())
                       for name, m in (("transformer", transformer), ("vae", vae), ("text_encoder", te1),
                                       ("text_encoder_2", te2), ("classifier", classifier))},
        "base_heldout_ode": base, "base_heldout_ode_no_cfg": no_cfg,
        "train_wall_s": round(train_seconds, 1), "train_cpu_s": round(train_cpu, 1),
        "versions": {"torch": torch.__version__, "diffusers": __import__("diffusers").__version__},
    }
    (tmp / "training_info.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    from safetensors.torch import save_file

    Path(args.classifier_out).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in classifier.state_dict().items()}, args.classifier_out)
    log(f"wrote {out} and {args.classifier_out}")
    return info


if __name__ == "__main__":
    main()
