"""Where a scenes model fails: at which noise level its samples stop reading right (docs/testbed.md, issue 42).

Two tables on fresh held-out scenes (``--per-task`` a GenEval task, rendered from the held-out metadata), read by
GenEval's rules with the exact scenes reader:

1. the VAE alone: ground-truth latents plus Gaussian noise of std sigma (scaled latent units), decoded;
2. the denoiser from a given layout: ground truth noised to t0 (z = (1 - t0) x + t0 eps) and integrated back to 0
   with ``--steps`` Euler steps of the pipeline's own velocity (no CFG), decoded. t0 = 1 is sampling from pure
   noise; a model that reads right from low t0 but not from high t0 draws edges and corners when the layout is
   given and fails where it must decide the layout itself;
3. sampling from pure noise through the pipeline (``--shift`` values of its Euler scheduler, ``--steps`` x 2 steps,
   8 held-out rows a task x 2 samples, no CFG): whether the sampler's time grid is the cause.

    OMP_NUM_THREADS=1 python benchmarks/scenes_noise_levels.py PIPELINE_FOLDER
"""

from __future__ import annotations

import argparse

import torch


@torch.no_grad()
def integrate(transformer, z, t0: float, steps: int, prompt_embeds, pooled, chunk: int = 120):
    """Euler from t0 to 0 on a uniform grid: z <- z + (t_next - t) v(z, t)."""
    ts = torch.linspace(t0, 0.0, steps + 1)
    for t, t_next in zip(ts[:-1], ts[1:]):
        v = []
        for i in range(0, len(z), chunk):
            part = slice(i, i + chunk)
            v.append(transformer(hidden_states=z[part], timestep=torch.full((len(z[part]),), float(t) * 1000),
                                 encoder_hidden_states=prompt_embeds[part], pooled_projections=pooled[part],
                                 return_dict=False)[0])
        v = torch.cat(v)
        z = z + (t_next - t) * v
    return z


def main(argv=None) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from jagg_lightning.rewards.geneval import GenEvalReward
    from jagg_lightning.testbed.scenes.captions import HELDOUT_METADATA
    from jagg_lightning.testbed.scenes.model import decode, encode, render_set
    from jagg_lightning.models.conditions import evenly_per_task
    from jagg_lightning.testbed.scenes.train import by_tag, encode_text, evaluate, judge, read_rows

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pipeline", help="a scenes pipeline folder (the recipe's --out)")
    p.add_argument("--per-task", type=int, default=20, help="held-out scenes per GenEval task")
    p.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.1, 0.3, 0.5])
    p.add_argument("--t0", type=float, nargs="+", default=[0.2, 0.4, 0.6, 0.8, 1.0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--shift", type=float, nargs="+", default=[1.0, 3.0, 8.0, 20.0])
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pipe = StableDiffusion3Pipeline.from_pretrained(args.pipeline, text_encoder_3=None, tokenizer_3=None)
    vae, reward = pipe.vae, GenEvalReward(reader="scenes")
    images, rows = render_set(read_rows(HELDOUT_METADATA), args.per_task, args.seed)
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    x = (encode(vae, images)[0] - shift) * scale
    gen = torch.Generator().manual_seed(args.seed)

    def overall(latents):
        return judge(reward, decode(vae, latents / scale + shift), rows)["overall"]

    result = {"vae_noise": {}, "from_t0": {}, "sampler_shift": {}}
    for sigma in args.sigmas:
        result["vae_noise"][sigma] = overall(x + sigma * torch.randn(x.shape, generator=gen))
        print(f"ground truth + noise std {sigma:g}: GenEval overall {result['vae_noise'][sigma]:.3f}", flush=True)
    prompt_embeds, pooled = encode_text(pipe, [row["prompt"] for row in rows])
    for t0 in args.t0:
        z = (1 - t0) * x + t0 * torch.randn(x.shape, generator=gen)
        result["from_t0"][t0] = overall(integrate(pipe.transformer, z, t0, args.steps, prompt_embeds, pooled))
        print(f"from ground truth noised to t0 = {t0:g}: GenEval overall {result['from_t0'][t0]:.3f}", flush=True)
    pipe.set_progress_bar_config(disable=True)
    sample_rows = evenly_per_task(read_rows(HELDOUT_METADATA), 8, by_tag)
    for shift_value in args.shift:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift_value)
        scores = evaluate(pipe, reward, sample_rows, 2, 1.0, 2 * args.steps, args.seed)
        result["sampler_shift"][shift_value] = scores["overall"]
        print(f"sampled from noise, scheduler shift {shift_value:g}: GenEval {scores['overall']:.3f}", flush=True)
    return result


if __name__ == "__main__":
    main()
