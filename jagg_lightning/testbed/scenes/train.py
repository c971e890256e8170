"""The scenes test bed recipe: ``python -m jagg_lightning.testbed.scenes.train --out DIR`` (about one CPU hour).

Deterministic (fixed seeds, one thread, ``torch.use_deterministic_algorithms``). Stages:

1. data: ``--scenes-per-task`` scenes of each GenEval task, drawn by
   :func:`~jagg_lightning.testbed.scenes.render.scene_for` from the TRAIN metadata rows (each task's rows in turn,
   one generator seeded with ``--seed``) and captioned with the row's prompt. A fixed set rather than fresh scenes
   per batch: rendering is cheap (about 3 ms a scene) but encoding a batch through the VAE would cost about half a
   transformer step; the set is encoded once, and each step still draws its latents from the VAE posterior, its
   noise and its times afresh. A second set from the HELD-OUT rows (another seed) measures the VAE and the
   held-out flow loss; it is never trained on.
2. VAE: a small ``AutoencoderKL`` (64 px RGB <-> 8 x 16 x 16), MSE + 1e-4 KL; ``shift_factor`` / ``scaling_factor``
   from the train latents. Checked by reading decoded ground truth with the scenes reader (GenEval's rules): the
   share of held-out scenes still judged correct after encode -> decode.
3. transformer and text encoders, jointly: an ``SD3Transformer2DModel`` (patch 2 -> 64 image tokens) and the
   pipeline's two CLIP text encoders with a word-level tokenizer built offline
   (:func:`~jagg_lightning.testbed.scenes.model.word_tokenizer`); rectified flow
   ||v(z_t, t, c) - (eps - x)||^2, z_t = (1 - t) x + t eps, t ~ logit-normal(m, 1) (m = ``--timestep-mean``, 1 by
   default: the median t at 0.73, where the layout is decided; 0 is SD3's); AdamW with warm-up and then the
   constant rate (``--lr-schedule cosine``: cosine decay to 0); 10 % of captions dropped to "" (classifier-free
   guidance); an EMA of the weights is what is saved.
4. evaluation through ``StableDiffusion3Pipeline.__call__`` (Euler ODE) on every held-out row and on train rows:
   GenEval's per-image correctness by :class:`~jagg_lightning.rewards.GenEvalReward` (reader ``scenes``), per task
   and overall (the mean over tasks, as GenEval averages), with and without CFG.

``--eval-every N`` also scores the EMA weights on the held-out rows every N transformer steps (one sample a row,
no CFG): the learning curve. Everything (seeds, steps, losses, curves, scores, timings, CPU seconds) goes to
``training_info.json`` beside the weights; the folder is written crash-safely (``faults.io.atomic_directory``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from jagg_lightning.models.conditions import evenly_per_task, repeated_per_task
from jagg_lightning.testbed.scenes.captions import HELDOUT_METADATA, TRAIN_METADATA
from jagg_lightning.testbed.scenes.model import (IMAGE_SIZE, LATENT_CHANNELS, MAX_SEQUENCE_LENGTH, build_components,
                                                 caption_words, decode, encode, parameter_counts, render_set,
                                                 train_vae, words_outside)
from jagg_lightning.testbed.scenes.render import LAYOUT, LAYOUTS, OBJECT_SIZES
from jagg_lightning.testbed.scenes.sittings import (load_sitting, restore_sitting, restore_vae, save_sitting,
                                                    sitting_path)
from jagg_lightning.testbed.train import _EMA

SCHEDULER_SHIFT = 3.0
LR_SCHEDULES = ("cosine", "constant")  # after the warm-up: cosine decay to 0, or none


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def by_tag(row: dict) -> str:
    return row["tag"]


def as_prompts(rows: list[dict]) -> list:
    """Each row's prompt carrying its metadata (what GenEvalReward reads)."""
    from jagg_lightning.models.conditions import ConditionedPrompt

    return [ConditionedPrompt(row["prompt"], metadata=row) for row in rows]


def judge(reward, images: torch.Tensor, rows: list[dict], scene_judge=None) -> dict:
    """GenEval's per-task accuracy, each task's 95 % half-width and overall score of ``images`` against ``rows`` (one
    row per image), the mean of Flow-GRPO's dense score, the commonest failures and -- with ``scene_judge`` (a
    :class:`~jagg_lightning.testbed.scenes.judge.SceneJudgeReader`) -- the independent judge's per-task scores and
    its agreement with the reader (the share of images both call right or both wrong)."""
    from collections import Counter

    from jagg_lightning.rewards.geneval_rules import task_intervals, task_scores

    judged = reward.judge_images(images, as_prompts(rows))
    tags, correct = [j.tag for j in judged], [j.correct for j in judged]
    scores = {k: round(v, 4) for k, v in task_scores(tags, correct).items()}
    scores["ci95"] = {k: round(v, 4) for k, v in task_intervals(tags, correct).items()}
    scores["images_per_task"] = {tag: tags.count(tag) for tag in dict.fromkeys(tags)}
    scores["dense_reward"] = round(float(reward.scores_of(judged).mean()), 4)
    scores["images"] = len(judged)
    # why images fail: the rules' first reason, most common first
    reasons = Counter(str(j.reason).splitlines()[0] if j.reason else "?" for j in judged if not j.correct)
    scores["failures"] = dict(reasons.most_common(4))
    if scene_judge is not None:
        from jagg_lightning.testbed.scenes.judge import judge_geneval

        seen = judge_geneval(scene_judge, reward, images, as_prompts(rows))
        scores["judge"] = {k: round(v, 4) for k, v in task_scores(tags, [j.correct for j in seen]).items()}
        scores["judge_agreement"] = round(sum(a.correct == b.correct for a, b in zip(seen, judged)) / len(seen), 4)
    return scores


@torch.no_grad()
def sample(pipe, rows: list[dict], samples_per_row: int, guidance_scale: float, num_steps: int, seed: int):
    """ODE samples through the pipeline's ``__call__``, row-major ([len(rows) * samples, 3, 64, 64] in [0, 1]); the
    noise of sample i of row j depends only on (seed, j, i)."""
    prompts = [row["prompt"] for row in rows]
    out = []
    for i in range(samples_per_row):
        gens = [torch.Generator().manual_seed(seed * 100_003 + j * 101 + i) for j in range(len(rows))]
        out.append(pipe(prompt=prompts, num_inference_steps=num_steps, guidance_scale=guidance_scale,
                        height=IMAGE_SIZE, width=IMAGE_SIZE, generator=gens, output_type="pt",
                        max_sequence_length=MAX_SEQUENCE_LENGTH).images.clamp(0, 1))
    return torch.stack(out, 1).flatten(0, 1)


def evaluate(pipe, reward, rows, images_per_task, guidance_scale, num_steps, seed, scene_judge=None) -> dict:
    """GenEval on ``rows``, each task sampled to at least ``images_per_task`` images (a row of a task with few rows
    is drawn several times, each with its own noise): every task's score rests on enough images to be compared."""
    drawn = repeated_per_task(rows, images_per_task, by_tag)
    images = sample(pipe, drawn, 1, guidance_scale, num_steps, seed)
    result = judge(reward, images, drawn, scene_judge)
    result.update(guidance_scale=guidance_scale, num_steps=num_steps, rows=len(rows))
    return result


def encode_text(pipe, prompts: list[str]):
    pe, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device="cpu",
                                          do_classifier_free_guidance=False, max_sequence_length=MAX_SEQUENCE_LENGTH)
    return pe, pooled


def flow_loss(pipe, x, prompts, t, eps):
    pe, pooled = encode_text(pipe, prompts)
    zt = (1 - t)[:, None, None, None] * x + t[:, None, None, None] * eps
    v = pipe.transformer(hidden_states=zt, timestep=t * 1000, encoder_hidden_states=pe, pooled_projections=pooled,
                         return_dict=False)[0]
    return F.mse_loss(v, eps - x)


@torch.no_grad()
def fixed_flow_loss(pipe, latents, prompts, seed: int, chunk: int = 256) -> float:
    """Flow loss at fixed noise and uniform times (comparable across runs and steps)."""
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(latents.shape, generator=g)
    t = torch.rand(len(latents), generator=g)
    total = 0.0
    for i in range(0, len(latents), chunk):
        s = slice(i, i + chunk)
        total += float(flow_loss(pipe, latents[s], prompts[s], t[s], eps[s])) * len(latents[s])
    return total / len(latents)


def train_transformer(pipe, lat_mean, lat_std, prompts, args, log, on_eval=None, sitting=None, save=None) -> dict:
    """The transformer stage (module docstring). ``on_eval(step)`` returns the held-out scores of the EMA weights
    (the learning curve); ``sitting`` is a loaded checkpoint to continue from and ``save(step, parts, record)``
    writes one (``--checkpoint-every``; :mod:`~jagg_lightning.testbed.scenes.sittings`). Returns the stage's
    record, or None when ``--stop-at`` ended this sitting."""
    gen = torch.Generator().manual_seed(args.seed + 2)
    torch.manual_seed(args.seed + 2)
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    for m in modules:
        m.train().requires_grad_(True)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=args.dit_lr, weight_decay=1e-4)
    steps, warmup = args.dit_steps, min(200, max(1, args.dit_steps // 10))

    def decay(s):  # a constant lr learns shapes sooner: 4 of 16 one-prompt squares at 1,600 steps, cosine 0
        if args.lr_schedule == "constant":
            return 1.0
        return 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / steps)).item())

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * decay(s))
    ema = _EMA(modules, args.ema_decay)
    parts = dict(modules=modules, opt=opt, sched=sched, ema=ema, gen=gen)
    record = {"losses": [], "curve": [], "heldout_curve": []}
    first = 0
    if sitting is not None:
        first = restore_sitting(sitting, **parts)
        record = sitting["record"]
        log(f"transformer: continuing from step {first}")
    losses, curve = record["losses"], record["curve"]
    for step in range(first, steps):
        idx = torch.randint(0, len(prompts), (args.dit_batch,), generator=gen)
        drop = torch.rand(args.dit_batch, generator=gen) < 0.1
        batch_prompts = ["" if drop[i] else prompts[int(j)] for i, j in enumerate(idx)]
        x = lat_mean[idx] + lat_std[idx] * torch.randn(lat_mean[idx].shape, generator=gen)
        eps = torch.randn(x.shape, generator=gen)
        t = torch.sigmoid(torch.randn(args.dit_batch, generator=gen) + args.timestep_mean)
        loss = flow_loss(pipe, x, batch_prompts, t, eps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema.update(step)
        losses.append(float(loss.detach()))
        if (step + 1) % 100 == 0 or step + 1 == steps:
            tail = losses[-100:]
            curve.append({"step": step + 1, "flow_loss": round(sum(tail) / len(tail), 4)})
            log(f"transformer step {step + 1}: flow loss (last 100) {curve[-1]['flow_loss']:.4f}")
        if on_eval is not None and args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < steps:
            with ema_weights(ema, modules):
                record["heldout_curve"].append({"step": step + 1, **on_eval(step + 1)})
        if save is not None and step + 1 < steps and (
                (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0) or step + 1 == args.stop_at):
            save(step + 1, parts, record)
            if step + 1 == args.stop_at:
                log(f"transformer: stopped at step {step + 1} (--stop-at); continue with --resume")
                return None
    ema.copy_to_params()
    for m in modules:
        m.eval().requires_grad_(False)
    tail = losses[-100:]
    return {"steps": steps, "batch_size": args.dit_batch, "lr": args.dit_lr, "warmup": warmup,
            "lr_schedule": args.lr_schedule,
            "ema_decay": args.ema_decay, "prompt_dropout": 0.1,
            "timestep_density": f"logit-normal({args.timestep_mean:g}, 1)",
            "final_flow_loss": round(sum(tail) / len(tail), 4), "flow_loss_curve": curve,
            "heldout_curve_no_cfg": record["heldout_curve"], "sittings": record.get("sittings", [])}


@contextlib.contextmanager
def ema_weights(ema, modules):
    """The EMA weights in place, in eval mode, for the block; the live weights and train mode back after."""
    live = [p.detach().clone() for p in ema.params]
    ema.copy_to_params()
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, saved in zip(ema.params, live):
                p.copy_(saved)
        for m in modules:
            m.train()


def reader_check(vae, reward, images, rows) -> dict:
    """GenEval correctness of ground-truth renders as drawn and after encode -> decode through the VAE."""
    mean, _ = encode(vae, images)
    decoded = decode(vae, mean)
    return {"rendered": judge(reward, images, rows), "decoded": judge(reward, decoded, rows),
            "recon_mse": round(float(F.mse_loss(decoded * 2 - 1, images * 2 - 1)), 6)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="pipeline folder to write (refused if it exists)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scenes-per-task", type=int, default=2000)
    parser.add_argument("--heldout-scenes-per-task", type=int, default=100)
    parser.add_argument("--vae-steps", type=int, default=2400)
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--dit-steps", type=int, default=6000)
    parser.add_argument("--dit-batch", type=int, default=64)
    parser.add_argument("--dit-lr", type=float, default=1e-3)
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                        help="after the warm-up: cosine decay to 0, or the constant --dit-lr")
    parser.add_argument("--ema-decay", type=float, default=0.998)
    parser.add_argument("--timestep-mean", type=float, default=1.0,
                        help="mean of the logit-normal training times (0: SD3's; > 0 trains more at high noise)")
    parser.add_argument("--layout", choices=LAYOUTS, default=LAYOUT,
                        help="where objects go: anywhere (free) or one per cell of a 2 x 2 grid")
    parser.add_argument("--object-size", type=float, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="objects' sides, fractions of the image (default: the layout's, render.object_size)")
    parser.add_argument("--vae-from", default=None,
                        help="a scenes pipeline folder whose trained VAE is reused (the VAE stage is skipped)")
    parser.add_argument("--latent-channels", type=int, default=LATENT_CHANNELS)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=24)
    parser.add_argument("--text-width", type=int, default=64)
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument("--eval-guidance", type=float, default=2.0)
    parser.add_argument("--eval-images-per-task", type=int, default=64,
                        help="images per task in every evaluation (rows of a task with few rows drawn more often)")
    parser.add_argument("--eval-train-per-task", type=int, default=20, help="train rows evaluated per task")
    parser.add_argument("--eval-heldout-per-task", type=int, default=0, help="held-out rows per task (0 = all)")
    parser.add_argument("--eval-every", type=int, default=1000, help="held-out curve every N steps (0 = none)")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="write OUT.sitting.pt every N transformer steps (0 = never): a long run in sittings")
    parser.add_argument("--stop-at", type=int, default=0,
                        help="end this sitting after this many transformer steps, checkpoint written (0 = run on)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from OUT.sitting.pt (the same arguments; bit-identical to one sitting)")
    args = parser.parse_args(argv)
    for name in ("checkpoint_every", "stop_at"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.stop_at >= args.dit_steps:
        parser.error(f"--stop-at must be below --dit-steps ({args.dit_steps}), got {args.stop_at}")
    for name in ("scenes_per_task", "heldout_scenes_per_task", "vae_steps", "vae_batch", "dit_steps", "dit_batch",
                 "latent_channels", "layers", "heads", "head_dim", "text_width", "eval_steps", "eval_images_per_task",
                 "eval_train_per_task"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv=None) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from jagg_lightning.faults.io import atomic_directory, atomic_write
    from jagg_lightning.rewards.geneval import GenEvalReward

    args = parse_args(argv)
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"--out {out} exists: the recipe never overwrites a finished run; give a new folder")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    start, cpu_start = time.time(), time.process_time()
    timings = {}

    def log(msg):
        print(f"[{time.time() - start:7.1f}s cpu {time.process_time() - cpu_start:7.1f}s] {msg}", flush=True)

    def mark(stage):
        timings[stage] = {"wall_s": round(time.time() - start, 1), "cpu_s": round(time.process_time() - cpu_start, 1)}

    train_rows, heldout_rows = read_rows(TRAIN_METADATA), read_rows(HELDOUT_METADATA)
    heldout_eval_rows = evenly_per_task(heldout_rows, args.eval_heldout_per_task or None, by_tag)
    words = caption_words(train_rows)
    unknown = sorted({w for row in heldout_rows for w in words_outside(row["prompt"], words)})
    if unknown:
        raise ValueError(f"held-out prompts use words the train prompts never do: {unknown}")
    object_size = tuple(args.object_size or OBJECT_SIZES[args.layout])
    images, image_rows = render_set(train_rows, args.scenes_per_task, args.seed, object_size, args.layout)
    held_images, held_rows = render_set(heldout_rows, args.heldout_scenes_per_task, args.seed + 1, object_size,
                                        args.layout)
    log(f"rendered {len(images)} train / {len(held_images)} held-out scenes")
    tok, tok2, te1, te2, vae, transformer = build_components(args.seed, words, args.layers, args.heads,
                                                             args.head_dim, args.text_width, args.latent_channels)
    reward = GenEvalReward(reader="scenes", score="flow_grpo")
    checkpoint = sitting_path(out)
    sitting = load_sitting(checkpoint, args) if args.resume else None
    if sitting is not None:  # a later sitting: the VAE the first one trained
        restore_vae(vae, sitting)
        vae_info = sitting["record"]["vae_info"]
    elif args.vae_from:  # a probe's shortcut: the VAE of an earlier run, not trained again
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(Path(args.vae_from) / "vae")
        vae.eval().requires_grad_(False)
        vae_info = {"from": str(args.vae_from), "shift_factor": vae.config.shift_factor,
                    "scaling_factor": vae.config.scaling_factor}
    else:
        vae_info = train_vae(vae, images, args.vae_steps, args.vae_batch, 2e-3, args.seed + 3, log)
    if sitting is None:
        vae_info["reader_check_heldout"] = reader_check(vae, reward, held_images, held_rows)
    log(f"vae: held-out ground truth judged correct {vae_info['reader_check_heldout']['rendered']['overall']:.3f} "
        f"as rendered, {vae_info['reader_check_heldout']['decoded']['overall']:.3f} decoded")
    mark("vae")

    def scaled(latents):
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    mean, std = encode(vae, images)
    lat_mean, lat_std = scaled(mean), std * vae.config.scaling_factor
    held_mean, _ = encode(vae, held_images)
    held_lat = scaled(held_mean)
    prompts = [row["prompt"] for row in image_rows]
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT), vae=vae,
        text_encoder=te1, tokenizer=tok, text_encoder_2=te2, tokenizer_2=tok2, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    mark("encode")

    def on_eval(step):
        scores = evaluate(pipe, reward, heldout_eval_rows, args.eval_images_per_task, 1.0, args.eval_steps,
                          args.seed + 100)
        log(f"step {step}: held-out (no CFG) {scores}")
        return scores

    def save(step, parts, record):
        record["vae_info"] = vae_info
        record.setdefault("sittings", []).append(
            {"to_step": step, "wall_s": round(time.time() - start, 1),
             "cpu_s": round(time.process_time() - cpu_start, 1)})  # this sitting's, from its own start
        save_sitting(checkpoint, args=args, step=step, vae=vae, record=record, **parts)
        log(f"transformer: checkpoint at step {step} -> {checkpoint}")

    dit_info = train_transformer(pipe, lat_mean, lat_std, prompts, args, log, on_eval, sitting,
                                 save if args.checkpoint_every or args.stop_at else None)
    if dit_info is None:  # --stop-at ended this sitting
        return None
    dit_info["train_flow_loss_fixed"] = round(fixed_flow_loss(pipe, lat_mean[:600], prompts[:600], args.seed + 7), 4)
    dit_info["heldout_flow_loss_fixed"] = round(
        fixed_flow_loss(pipe, held_lat, [row["prompt"] for row in held_rows], args.seed + 7), 4)
    log(f"transformer: flow loss at fixed noise, train {dit_info['train_flow_loss_fixed']}, "
        f"held-out {dit_info['heldout_flow_loss_fixed']}")
    mark("transformer")

    from jagg_lightning.testbed.scenes.judge import SceneJudgeReader, load_scene_judge

    scene_judge = SceneJudgeReader(load_scene_judge())  # the shipped judge reads the final evaluation's images too
    evaluation = {}
    train_eval_rows = evenly_per_task(train_rows, args.eval_train_per_task, by_tag)
    for name, rows in (("heldout", heldout_eval_rows), ("train", train_eval_rows)):
        for cfg in (args.eval_guidance, 1.0):
            key = f"{name}_cfg{cfg:g}"
            evaluation[key] = evaluate(pipe, reward, rows, args.eval_images_per_task, cfg, args.eval_steps,
                                       args.seed + 200, scene_judge)
            log(f"{key}: {evaluation[key]}")
    mark("evaluation")

    info = {
        "recipe": "python -m jagg_lightning.testbed.scenes.train " + " ".join(sys.argv[1:] if argv is None else argv),
        "arguments": {k: v for k, v in vars(args).items() if k != "out"},
        "data": {"train_metadata": TRAIN_METADATA.name, "heldout_metadata": HELDOUT_METADATA.name,
                 "train_scenes": len(images), "heldout_scenes": len(held_images), "render_seed": args.seed,
                 "heldout_render_seed": args.seed + 1, "vocabulary": words, "layout": args.layout,
                 "object_size": list(object_size)},
        "image_size": IMAGE_SIZE, "max_sequence_length": MAX_SEQUENCE_LENGTH, "scheduler_shift": SCHEDULER_SHIFT,
        "parameters": parameter_counts(transformer=transformer, vae=vae, text_encoder=te1, text_encoder_2=te2),
        "vae": vae_info, "transformer": dit_info, "evaluation": evaluation, "timings": timings,
        "train_cpu_s": timings["transformer"]["cpu_s"], "total_cpu_s": round(time.process_time() - cpu_start, 1),
        "total_wall_s": round(time.time() - start, 1),  # this sitting's; dit_info["sittings"]: the earlier ones
        "versions": {"torch": torch.__version__, "diffusers": __import__("diffusers").__version__},
    }
    with atomic_directory(out) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        atomic_write(Path(tmp) / "training_info.json",
                     lambda path: Path(path).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8"))
    checkpoint.unlink(missing_ok=True)  # the run is whole: its sitting checkpoint is no longer needed
    log(f"wrote {out}")
    return info


if __name__ == "__main__":
    main()
