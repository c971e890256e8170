"""Flow-matching schedules and the stochastic sampling steps GRPO trains on.

Rectified flow: z_t = (1 - t) x + t eps, the model predicts the velocity v = dz/dt ~ eps - x.
Time runs 1 -> 0; one step goes from t_k to t_{k+1} with dt = t_{k+1} - t_k < 0.

The step kinds share one signature:

* ``"sde"``  -- the Flow-GRPO SDE (Liu et al. 2025). With sigma_k = a sqrt(t_k / (1 - t_k))
  (at t_k = 1 the denominator uses t_{k+1}, as Flow-GRPO does),

      mu_k  = z_k + [v_k + sigma_k^2 / (2 t_k) (z_k + (1 - t_k) v_k)] dt
      s_k   = sigma_k sqrt(-dt)

* ``"cps"``  -- the coefficient-preserving step (Flow-CPS): with s = t_{k+1} sin(a pi / 2),
  x_hat = z - t v, eps_hat = z + (1 - t) v,

      mu_k = (1 - t_{k+1}) x_hat + sqrt(t_{k+1}^2 - s^2) eps_hat

* ``"sde_constant"`` -- the same SDE with a constant coefficient sigma_k = a (DanceGRPO's ``eta``):
  mu_k = z_k + [v_k + a^2 / (2 t_k) (z_k + (1 - t_k) v_k)] dt, s_k = a sqrt(-dt).

* ``"sde_linear"`` -- the same SDE with sigma_k = a t_k, linear in t: Flash-GRPO's noise (its authors'
  ``sde_step_with_logprob`` takes std_dev_t = sigmas[1] t, so a = the grid's second time sigmas[1]).

* ``"ode"``  -- the deterministic Euler step mu_k = z_k + v_k dt, s_k = 0 (no log-prob).

Log-probabilities, MEAN over latent elements (``log_prob`` conventions, see docs/parity.md):

* SDE steps: the Gaussian log-density log N(z_{k+1}; mu_k, s_k^2), as Flow-GRPO computes it.
* CPS steps: ``"squared_error"`` (default, Flow-GRPO's CPS branch) -mean((z_{k+1} - mu_k)^2), no
  1 / (2 s^2) and no normaliser; ``"gaussian"`` the true density. The ratio under "squared_error" is
  the Gaussian ratio raised to the power 2 s_k^2.
* A deterministic step (ODE, or CPS at t_{k+1} = 0 where s = 0) has log-prob 0 under every
  convention, never NaN: Flow-GRPO's CPS formula gives exactly 0 there (z_{k+1} = mu_k).

``StepDistribution.sigma`` is what Flow-GRPO calls ``std_dev_t`` and divides its KL by: sigma_k for
the SDE (without the sqrt(-dt)), s for CPS, 0 for ODE.

In every kind mu is affine in v, so a per-step loss is a cheap function of the velocity alone.
The arithmetic runs in float32 (float64 when the inputs are float64) whatever the model dtype.
Plain torch: no Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from jagg_lightning.utils.dtypes import compute_dtype

StepKind = str
"""A name in :data:`STEP_KINDS`."""
LogProbConvention = Literal["squared_error", "gaussian"]
CPS_LOG_PROBS = ("squared_error", "gaussian")


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """The flow-matching time shift s -> shift s / (1 + (shift - 1) s) (SD3 uses shift 3)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_match_sigmas(num_steps: int, shift: float = 3.0, num_train_timesteps: int = 1000) -> Tensor:
    """The times t_0 = 1 > ... > t_{T-1} > t_T = 0 of ``num_steps`` sampling steps, float32, length T + 1.

    Equal to diffusers' ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps).sigmas``:
    the scheduler spaces the *unshifted* training range [1, shift(1 / N_train)] linearly, shifts it once
    more, and appends 0. Multiply by ``num_train_timesteps`` for the transformer's ``timestep`` input.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    sigma_min = shift_sigmas(torch.tensor(1.0 / num_train_timesteps, dtype=torch.float64), shift)
    base = torch.linspace(1.0, float(sigma_min), num_steps, dtype=torch.float64)
    sigmas = shift_sigmas(base, shift).to(torch.float32)
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def _per_sample(t: Tensor | float, like: Tensor) -> Tensor:
    """A scalar or per-sample [B] time, shaped to broadcast against a [B, ...] latent."""
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    if t.ndim == 0:
        return t
    return t.reshape(-1, *([1] * (like.ndim - 1)))


@dataclass
class StepDistribution:
    """The Gaussian N(mean, std^2) of z_{k+1} given z_k; ``std`` and ``sigma`` broadcast against ``mean``.

    ``sigma`` is Flow-GRPO's ``std_dev_t`` (sigma_k for the SDE, s for CPS, 0 for ODE); ``kind`` the
    step kind that made it.
    """

    mean: Tensor
    std: Tensor
    sigma: Tensor | None = None
    kind: StepKind = "sde"

    def log_prob(self, sample: Tensor, cps_log_prob: LogProbConvention = "squared_error") -> Tensor:
        """log pi(sample | z_k), MEAN over latent elements: shape [B]; 0 where the step is deterministic.

        SDE (and ODE) steps use the Gaussian density; CPS steps ``cps_log_prob`` (module docstring).
        """
        if cps_log_prob not in CPS_LOG_PROBS:
            raise ValueError(f"cps_log_prob must be one of {CPS_LOG_PROBS}, got {cps_log_prob!r}")
        if STEP_KINDS[self.kind].squared_error_log_prob and cps_log_prob == "squared_error":
            return squared_error_log_prob(sample, self.mean)
        return gaussian_log_prob(sample, self.mean, self.std)


def squared_error_log_prob(sample: Tensor, mean: Tensor) -> Tensor:
    """Flow-GRPO's CPS log-prob: -(sample - mean)^2 averaged over all but the batch dimension."""
    lp = -((sample.to(mean.dtype) - mean) ** 2)
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log N(sample; mean, std^2) averaged over all but the batch dimension; 0 for a sample whose std is 0.

    The std is replaced by 1 where it is 0 before the density is formed, so neither the value nor its
    gradient is ever NaN there.
    """
    sample = sample.to(mean.dtype)
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    stochastic = std > 0
    safe_std = torch.where(stochastic, std, torch.ones_like(std))
    lp = -((sample - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - 0.5 * math.log(2 * math.pi)
    lp = torch.where(stochastic, lp, torch.zeros_like(lp))
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def _flow_grpo_sde(z: Tensor, v: Tensor, t: Tensor, t_next: Tensor, a: float) -> tuple[Tensor, Tensor, Tensor]:
    dt = t_next - t
    # Flow-GRPO: at t = 1 the (1 - t) denominator takes the next time instead.
    sigma = a * torch.sqrt(t / (1 - torch.where(t >= 1, t_next, t)))
    return z + (v + sigma**2 / (2 * t) * (z + (1 - t) * v)) * dt, sigma * torch.sqrt(-dt), sigma


def _constant_sde(z: Tensor, v: Tensor, t: Tensor, t_next: Tensor, a: float) -> tuple[Tensor, Tensor, Tensor]:
    dt = t_next - t
    sigma = torch.full_like(t, a)
    return z + (v + sigma**2 / (2 * t) * (z + (1 - t) * v)) * dt, sigma * torch.sqrt(-dt), sigma


def _linear_sde(z: Tensor, v: Tensor, t: Tensor, t_next: Tensor, a: float) -> tuple[Tensor, Tensor, Tensor]:
    dt = t_next - t
    sigma = a * t
    return z + (v + sigma**2 / (2 * t) * (z + (1 - t) * v)) * dt, sigma * torch.sqrt(-dt), sigma


def _cps(z: Tensor, v: Tensor, t: Tensor, t_next: Tensor, a: float) -> tuple[Tensor, Tensor, Tensor]:
    std = t_next * math.sin(a * math.pi / 2)
    x_hat, eps_hat = z - t * v, z + (1 - t) * v
    # clamp: t_next^2 - std^2 >= 0 mathematically (sin <= 1), rounding must not make it NaN
    return (1 - t_next) * x_hat + torch.sqrt((t_next**2 - std**2).clamp_min(0)) * eps_hat, std, std


def _ode(z: Tensor, v: Tensor, t: Tensor, t_next: Tensor, a: float) -> tuple[Tensor, Tensor, Tensor]:
    dt = t_next - t
    std = torch.zeros_like(dt)
    return z + v * dt, std, std


@dataclass(frozen=True)
class StepKindSpec:
    """One kind of sampling step: how it moves z -- ``moments(z, v, t, t_next, noise_level)`` -> (mean, std, sigma),
    sigma being Flow-GRPO's ``std_dev_t`` -- and the facts the config checks read."""

    moments: Callable[[Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor, Tensor]]
    stochastic: bool  # it has a density: a rollout may train it (sampling.step_kind)
    deterministic_into_zero: bool = False  # its step into t = 0 has no noise, so no density (CPS's last step)
    squared_error_log_prob: bool = False  # sampling.cps_log_prob "squared_error" is its log-prob (Flow-GRPO's CPS)


# The one table of step kinds: step_distribution, the rollout and the config checks read it. A new kind is an
# entry here (and a line in the module docstring); docs/architecture.md "How to add a step kind".
STEP_KINDS: dict[str, StepKindSpec] = {
    "sde": StepKindSpec(_flow_grpo_sde, stochastic=True),
    "sde_constant": StepKindSpec(_constant_sde, stochastic=True),
    "sde_linear": StepKindSpec(_linear_sde, stochastic=True),
    "cps": StepKindSpec(_cps, stochastic=True, deterministic_into_zero=True, squared_error_log_prob=True),
    "ode": StepKindSpec(_ode, stochastic=False),
}
TRAINABLE_STEP_KINDS = tuple(name for name, kind in STEP_KINDS.items() if kind.stochastic)


def step_distribution(
    z: Tensor,
    v: Tensor,
    t: Tensor | float,
    t_next: Tensor | float,
    kind: StepKind = "sde",
    noise_level: float = 0.7,
) -> StepDistribution:
    """Mean and std of one sampling step from t to t_next (see the module docstring and :data:`STEP_KINDS`)."""
    if kind not in STEP_KINDS:
        raise ValueError(f"step kind must be one of {tuple(STEP_KINDS)}, got {kind!r}")
    dtype = compute_dtype(z, v)
    z, v = z.to(dtype), v.to(dtype)
    t, t_next = _per_sample(t, z), _per_sample(t_next, z)
    mean, std, sigma = STEP_KINDS[kind].moments(z, v, t, t_next, noise_level)
    as_tensor = lambda x: torch.as_tensor(x, dtype=dtype, device=z.device)  # noqa: E731
    return StepDistribution(mean, as_tensor(std), as_tensor(sigma), kind)


def sample_step(dist: StepDistribution, noise: Tensor) -> Tensor:
    """z_{k+1} = mean + std * noise."""
    return dist.mean + dist.std * noise.to(dist.mean.dtype)
