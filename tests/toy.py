"""A velocity model affine in (z, t) for every theta, with LoRA-style trainable factors."""

import torch
from torch import nn


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
