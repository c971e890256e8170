"""The one-prompt test of a scenes transformer (docs/testbed.md, issue 42): can it learn to draw ONE prompt?

A fresh transformer and text encoders (``build_components``: the recipe's, at ``--layers`` x ``--heads`` x
``--head-dim``) are trained by the recipe's own transformer stage (``train_transformer``: AdamW, warm-up, then the
recipe's ``--lr-schedule``, 10 % prompt dropout, EMA) on ``--scenes`` renders of one train prompt only, encoded by the VAE of an existing
scenes pipeline folder (the recipe's ``--out``). Every ``--eval-every`` steps the EMA weights draw 16 samples (ODE,
10 steps, no CFG), read by GenEval's rules with the exact scenes reader; ``--grid`` saves them as a PNG per check.
A model that cannot draw one prompt will not draw 332; each knob of the recipe is cheapest to try here first.

    OMP_NUM_THREADS=1 python benchmarks/scenes_one_prompt.py PIPELINE_FOLDER --steps 1600   # about 15 CPU min
    # the first full run's settings (docs/testbed.md: 0 of 16 squares at 1,600 steps; the defaults drew 8 of 16)
    ... --timestep-mean 0 --lr-schedule cosine --object-size 0.18 0.3
"""

from __future__ import annotations

import argparse
import time
import numpy as np
import torch


def main(argv=None) -> list[dict]:
    from diffusers import StableDiffusion3Pipeline

    from jagg_lightning.rewards.geneval import GenEvalReward
    from jagg_lightning.testbed.scenes.captions import TRAIN_METADATA
    from jagg_lightning.testbed.scenes.model import build_components, caption_words, encode, render_set
    from jagg_lightning.testbed.scenes.render import OBJECT_SIZE
    from jagg_lightning.testbed.scenes.train import LR_SCHEDULES, judge, read_rows, sample, train_transformer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pipeline", help="a scenes pipeline folder: its VAE encodes the renders, its scheduler samples")
    p.add_argument("--prompt", default="a photo of a square", help="a prompt of the train metadata")
    p.add_argument("--scenes", type=int, default=2000)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--eval-every", type=int, default=800)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ema-decay", type=float, default=0.998)
    p.add_argument("--timestep-mean", type=float, default=1.0, help="as the recipe's")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant", help="as the recipe's")
    p.add_argument("--object-size", type=float, nargs=2, default=OBJECT_SIZE, metavar=("MIN", "MAX"),
                   help=f"the objects' sides, fractions of the image (the test bed's: {OBJECT_SIZE})")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--grid", default=None, help="PNG path prefix for the samples of each check")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    train_rows = read_rows(TRAIN_METADATA)
    rows = [row for row in train_rows if row["prompt"] == args.prompt]
    if not rows:
        raise SystemExit(f"--prompt {args.prompt!r} is not a prompt of {TRAIN_METADATA.name}")
    pipe = StableDiffusion3Pipeline.from_pretrained(args.pipeline, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    fresh = build_components(args.seed, caption_words(train_rows), args.layers, args.heads, args.head_dim,
                             pipe.text_encoder.config.hidden_size, pipe.vae.config.latent_channels)
    pipe.tokenizer, pipe.tokenizer_2, pipe.text_encoder, pipe.text_encoder_2, _, pipe.transformer = fresh
    if not 0 < args.object_size[0] <= args.object_size[1] <= 0.9:
        raise SystemExit(f"--object-size must satisfy 0 < MIN <= MAX <= 0.9, got {args.object_size}")
    images, _ = render_set(rows, args.scenes, args.seed, tuple(args.object_size))
    mean, std = encode(pipe.vae, images)
    shift, scale = pipe.vae.config.shift_factor, pipe.vae.config.scaling_factor
    reward = GenEvalReward(reader="scenes")  # built once, read at every check
    start, checks = time.process_time(), []

    def on_eval(step):
        drawn = sample(pipe, rows, 16, 1.0, 10, args.seed + 3)
        scores = judge(reward, drawn, rows * 16)
        checks.append({"step": step, "right": scores["overall"], "cpu_s": round(time.process_time() - start)})
        print(checks[-1], flush=True)
        if args.grid:
            a = (drawn.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
            from PIL import Image

            Image.fromarray(np.concatenate([np.concatenate(list(a[:8]), 1), np.concatenate(list(a[8:]), 1)], 0)) \
                .save(f"{args.grid}_{step}.png")
        return checks[-1]

    recipe_args = argparse.Namespace(seed=args.seed, dit_lr=args.lr, dit_steps=args.steps, dit_batch=args.batch,
                                     ema_decay=args.ema_decay, eval_every=args.eval_every,
                                     timestep_mean=args.timestep_mean, lr_schedule=args.lr_schedule)
    train_transformer(pipe, (mean - shift) * scale, std * scale, [args.prompt] * len(images), recipe_args, print,
                      on_eval)
    on_eval(args.steps)  # the stage ends with the EMA weights in place, in eval mode
    return checks


if __name__ == "__main__":
    main()
