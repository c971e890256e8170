"""Toy velocity models (affine in (z, t) for every theta, or not) with LoRA-style trainable factors, and the float64
trajectories, step losses and exact / JAGG gradients the engine tests build on them."""

import torch
from torch import nn

from jagg_lightning.method.grpo import StepRecord, step_loss
from jagg_lightning.method.jagg import accumulate_gradients, alphas, plan_windows
from jagg_lightning.method.routing import route_windows
from jagg_lightning.method.sde import flow_match_sigmas, sample_step, step_distribution


class AffineLoRAVelocity(nn.Module):
    """v(z, t) = (W0 + B A) z + t (c0 + B a) + d: affine in (z, t), bilinear in the trainable (A, B, a, d)."""

    def __init__(self, shape=(2, 2, 2), rank=2, generator=None):
        super().__init__()
        dim = int(torch.tensor(shape).prod())
        self.shape = shape
        kw = dict(generator=generator, dtype=torch.float64)
        self.register_buffer("w0", torch.randn(dim, dim, **kw) / dim**0.5)
        self.register_buffer("c0", torch.randn(dim, **kw))
        self.lora_a = nn.Parameter(torch.randn(rank, dim, **kw) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(dim, rank, **kw) * 0.3)
        self.time_a = nn.Parameter(torch.randn(rank, **kw) * 0.3)
        self.bias = nn.Parameter(torch.randn(dim, **kw) * 0.1)

    def forward(self, z, t, cond=None):
        flat = z.flatten(1)
        weight = self.w0 + self.lora_b @ self.lora_a
        v = flat @ weight.T + t[:, None] * (self.c0 + self.lora_b @ self.time_a) + self.bias
        if cond is not None:
            v = v + cond
        return v.view_as(z)


class SineTimeVelocity(AffineLoRAVelocity):
    """Affine in z, but the time enters through a sinusoidal embedding: not affine in t."""

    def forward(self, z, t, cond=None):
        emb = torch.sin(3.0 * t)[:, None]
        return super().forward(z, torch.zeros_like(t), cond) + (emb * (self.lora_b @ self.time_a)).view_as(z)


NUM_STEPS = 17  # trained steps 0..15


def chord_trajectory(model, windows, gen, batch=3, off_chord=0.0):
    """Latents whose interior window points lie on the t-chord between the anchors (plus an offset)."""
    times = flow_match_sigmas(NUM_STEPS).double()
    shape = (batch, *model.shape)
    latents = torch.randn(NUM_STEPS + 1, *shape, generator=gen, dtype=torch.float64)
    for w in windows:
        a, b = w.anchors
        for k, al in zip(w.steps, alphas(times, w.steps)):
            if k not in (a, b):
                latents[k] = (1 - al) * latents[a] + al * latents[b]
                latents[k] += off_chord * torch.randn(shape, generator=gen, dtype=torch.float64)
    return latents, times


def records_for(model, latents, times, gen, steps):
    """Step records (old log-probs under the current theta) for ``steps``."""
    batch = latents.shape[1]
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    recs, cache = {}, torch.zeros_like(latents[:-1])
    with torch.no_grad():
        for k in steps:
            v = model(latents[k], times[k].expand(batch))
            cache[k] = v
            dist = step_distribution(latents[k], v, times[k], times[k + 1])
            # z_{k+1} here is an SDE sample from z_k (the loss's target), not the chord point
            z_next = sample_step(dist, torch.randn(latents[k].shape, generator=gen, dtype=torch.float64))
            recs[k] = StepRecord(latents[k], z_next, float(times[k]), float(times[k + 1]), dist.log_prob(z_next), adv)
    return recs, cache


def exact_gradient(model, latents, times, loss_fn, steps):
    model.zero_grad()
    for k in steps:
        v = model(latents[k], times[k].expand(latents.shape[1]))
        loss_fn(k, v).backward()
    return [p.grad.clone() for p in model.parameters()]


def jagg_gradient(model, latents, times, loss_fn, windows, cache=None, low_memory=False, interior_terms=None):
    """The engine's gradient (``interior_terms``: an estimator's; default the paper's) and its window records."""
    model.zero_grad()
    recs = accumulate_gradients(model, latents, times, None, loss_fn, windows, cache, low_memory,
                                interior_terms=interior_terms)
    return [p.grad.clone() for p in model.parameters()], recs


def setup(window_size, chained, gen, model_cls=AffineLoRAVelocity, off_chord=0.0, perturb=0.0, clip=1e-4):
    model = model_cls(generator=gen)
    steps = list(range(NUM_STEPS - 1))
    windows = plan_windows(steps, window_size, chained)
    route_windows(windows, [0.0] * len(windows), 1.0, window_size)
    latents, times = chord_trajectory(model, windows, gen, off_chord=off_chord)
    recs, cache = records_for(model, latents, times, gen, steps)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(perturb * torch.randn(p.shape, generator=gen, dtype=p.dtype))

    def loss_fn(k, v):
        loss, _ = step_loss(v, recs[k], clip_range=clip)
        return loss.mean() / len(steps)

    return model, windows, latents, times, loss_fn, steps, cache, recs
