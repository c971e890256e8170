"""The sampling side of a training step: schedule, prompt encoding, the training guidance, the rollout's
micro-batches and their scoring, the KL reference velocities, ODE samples for evaluation, and the activation size a
memory budget is measured in.

A :class:`Sampler` is handed the policy, the ``sampling`` settings and the KL weight (a reference is taken only
when it is > 0); the reward is handed in with each call that scores (the module's ``reward_fn``, which a user
may replace at any time). It never calls back into the module. Plain torch, no Lightning.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from jagg_lightning.method.ode_solvers import ode_tail
from jagg_lightning.models.conditions import ConditionedPrompt, check_condition_counts
from jagg_lightning.rewards import Reward
from jagg_lightning.rewards.base import RewardError, scored_components
from jagg_lightning.training.rollout import (
    SampledMicroBatch, Trajectory, rollout_micro_batches, sample_generators, sample_trajectories, step_kinds_at,
)
from jagg_lightning.utils.batching import batch_slice
from jagg_lightning.utils.dtypes import compute_dtype
from jagg_lightning.utils.timing import CLOCK

if TYPE_CHECKING:
    from jagg_lightning.policies.base import Guidance

EVAL_STEP = -1  # the "global step" that seeds evaluation noise: the same at every evaluation


@dataclass
class ScoredMicroBatch:
    """A rollout micro-batch (:class:`~jagg_lightning.training.rollout.SampledMicroBatch`) with its rewards."""

    sampled: SampledMicroBatch
    rewards: Tensor  # [n]
    components: dict[str, Tensor]  # reward component -> [n]

    @property
    def rows(self) -> slice:
        return self.sampled.rows

    @property
    def trajectory(self) -> Trajectory:
        return self.sampled.trajectory


class Sampler:
    def __init__(self, policy, sampling, kl_beta: float, reward_workers: int = 0):
        self.policy, self.sampling, self.kl_beta, self.reward_workers = policy, sampling, kl_beta, reward_workers
        self.sde_dtype = compute_dtype(policy.config.dtype)  # the SDE math's: float32 (float64 with float64)
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: list[Future] = []  # unfinished reward-pool jobs (bounded: score_later)
        self._schedules: dict[tuple, Tensor] = {}
        self._activation_bytes: dict[Guidance, int] = {}  # per guidance: see activation_bytes()

    @property
    def device(self) -> torch.device:
        return self.policy.device

    def schedule(self, num_steps: int | None = None) -> Tensor:
        """The sampling times t_0 = 1 > ... > t_S = 0 (default: the rollout's ``num_steps``): the family
        pipeline's own scheduler sigmas at the policy's resolution, or a static ``sampling.shift``."""
        num_steps = num_steps or self.sampling.num_steps
        key = (num_steps, self.sampling.shift)
        if key not in self._schedules:
            self._schedules[key] = self.policy.schedule(num_steps, self.sampling.shift)
        return self._schedules[key]

    @property
    def times(self) -> Tensor:
        return self.schedule()

    @property
    def guidance(self) -> Guidance:
        """The guidance of rollouts and training: ``sampling.train_guidance_scale`` (null: ``policy.guidance_scale``)."""
        return self.policy.guidance(self.sampling.train_guidance_scale)

    def velocity(self, z: Tensor, t: Tensor, cond) -> Tensor:
        """The policy's velocity under :attr:`guidance`: what the rollout samples with and the update differentiates."""
        return self.policy.velocity(z, t, cond, self.guidance)

    # ------------------------------------------------------------------ rollout
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple:
        """The per-sample condition of a rollout: each prompt's embeddings repeated K times (prompt-major)."""
        K = self.sampling.group_size
        return tuple(c.repeat_interleave(K, dim=0) for c in self.encode_prompts(prompts, self.guidance))

    def encode_prompts(self, prompts: list[str], guidance: Guidance) -> tuple:
        """The policy's condition of ``prompts``, after checking each carries the condition images its family takes
        (none for text-to-image; an editing family's source: :mod:`jagg_lightning.models.conditions`)."""
        policy = self.policy
        check_condition_counts(prompts, policy.condition_images, policy.family, "prompts")
        return policy.encode_prompts(list(prompts), guidance)

    def rollout(self, cond: tuple, prompt_indices: list[int], step: int, step_kinds: list[str] | None = None,
                reference_steps: Collection[int] = (), graph_steps: Collection[int] = (),
                graph_samples: int | None = None, row_steps: list[int] | None = None) -> Iterator[SampledMicroBatch]:
        """K samples per prompt (prompt-major, ``cond`` = :meth:`encode` of the prompts), yielded micro-batch by
        micro-batch as each ends (:func:`~jagg_lightning.training.rollout.rollout_micro_batches`).

        ``step_kinds`` default: those of the rollout at ``step`` (:func:`~jagg_lightning.training.rollout.step_kinds_at`).
        With kl_beta > 0 the reference velocity (adapter off) of every ``reference_steps`` step is taken
        inside the rollout, on the same z and t (``trajectory.ref_velocities``). The fused mode's ``graph_steps``
        keep their graphs for the first ``graph_samples`` samples of each micro-batch (None: all). With
        ``sampling.ode_steps`` the ODE tail after the trained steps runs on its own grid (:meth:`rollout_grid`).
        ``row_steps``: each sample's own stochastic step (``sampling.sde_window_draw: group``)."""
        times, kinds = self.rollout_grid(step_kinds or step_kinds_at(self.sampling, step)[0])
        return rollout_micro_batches(
            self.velocity, cond, sample_generators(self.sampling.seed, step, prompt_indices, self.sampling.group_size),
            self.policy.latent_shape, times, kinds, self.sampling.noise_level, self.sampling.rollout_batch_size,
            self.device, self.sde_dtype, self.sampling.cps_log_prob,
            reference_fn=self.reference_velocity if self.kl_beta > 0 and reference_steps else None,
            reference_steps=set(reference_steps), grad_steps=set(graph_steps), grad_samples=graph_samples,
            ode_solver=self.sampling.ode_solver, row_steps=row_steps, row_kind=self.sampling.step_kind,
        )

    def rollout_grid(self, step_kinds: list[str]) -> tuple[Tensor, list[str]]:
        """The rollout's times and step kinds: the schedule and ``step_kinds`` (length ``num_steps``), or with
        ``sampling.ode_steps`` the trained steps' times and kinds, then the ODE tail's ``ode_steps`` steps to 0
        (:func:`~jagg_lightning.method.ode_solvers.ode_tail`; the trained steps' indices and times are unchanged)."""
        return ode_tail(self.times, step_kinds, self.sampling.num_trained, self.sampling.ode_steps)

    def trajectories(self, prompts: list[str], prompt_indices: list[int], step: int,
                     step_kinds: list[str] | None = None, reference_steps: Collection[int] = ()) -> tuple[Trajectory, tuple]:
        """The whole rollout of ``prompts``, unscored: (trajectory, per-sample condition)."""
        cond = self.encode(prompts)
        traj = None
        for mb in self.rollout(cond, prompt_indices, step, step_kinds, reference_steps):
            traj = mb.trajectory
        return traj, cond

    def scored(self, micro_batches: Iterable[SampledMicroBatch], reward: Reward, sample_prompts: list[str],
               ahead: int | None = None) -> Iterator[ScoredMicroBatch]:
        """Each micro-batch with its rewards, in order. A micro-batch is decoded and scored as soon as it is sampled
        (in the reward pool when ``reward_workers`` > 0, :meth:`score_later`, so scoring overlaps the next one's
        sampling) and yielded once ``ahead`` more have been sampled (None: after the last one).

        The rewards come in the GRPO math's dtype (``sde_dtype``: float64 with a float64 policy; a reward scores in
        float32): a float32 group mean rounds by the shape of the reward tensor (a group alone or beside another:
        1 group in 10^3 to 10^4 differs by an ulp, by CPU), and a float64 run's advantages must not depend on how
        its micro-batches are cut."""
        waiting: deque[tuple[SampledMicroBatch, Future]] = deque()

        def oldest() -> ScoredMicroBatch:
            mb, job = waiting.popleft()
            total, components = job.result()
            components = {name: scores.to(self.sde_dtype) for name, scores in components.items()}
            return ScoredMicroBatch(mb, total.to(self.sde_dtype), components)

        for mb in micro_batches:
            waiting.append((mb, self.score_later(reward, mb.final, sample_prompts[mb.rows])))
            while ahead is not None and len(waiting) > ahead:
                yield oldest()
        while waiting:
            yield oldest()

    def rollout_and_score(self, prompts: list[str], prompt_indices: list[int], step: int,
                          step_kinds: list[str] | None = None, reference_steps: Collection[int] = (), *,
                          reward: Reward):
        """The whole rollout, every micro-batch decoded and scored as soon as it is sampled (:meth:`scored`).

        Returns (trajectory, condition, per-sample prompts, rewards [N], {component: scores [N]}).
        """
        sample_prompts = [p for p in prompts for _ in range(self.sampling.group_size)]
        cond = self.encode(prompts)
        parts = list(self.scored(self.rollout(cond, prompt_indices, step, step_kinds, reference_steps), reward,
                                 sample_prompts))
        rewards = torch.cat([p.rewards for p in parts])
        components = {name: torch.cat([p.components[name] for p in parts]) for name in parts[0].components}
        return parts[0].trajectory, cond, sample_prompts, rewards, components

    def score_later(self, reward: Reward, final: Tensor, prompts: list[str]) -> Future:
        """Decode final latents and score them: a job of the reward pool when ``reward_workers`` > 0 (the
        caller keeps sampling), else at once; the future's result is :meth:`score`'s (total, components).

        The pool is bounded: with 2 x ``reward_workers`` jobs unfinished, this waits for one to finish
        before queueing another, so decoded images never pile up behind a slow (or remote) reward."""
        if not self.reward_workers:
            done: Future = Future()
            done.set_result(self.decode_and_score(reward, final, prompts))
            return done
        self._in_flight = [f for f in self._in_flight if not f.done()]
        if len(self._in_flight) >= 2 * self.reward_workers:
            wait(self._in_flight, return_when=FIRST_COMPLETED)
        job = self._reward_pool().submit(self.decode_and_score, reward, final, prompts)
        self._in_flight.append(job)
        return job

    decoded_samples: int = 0  # samples the rollouts decoded to images, a running count (``train/decodes``)
    _decode_count_lock = threading.Lock()  # reward-pool threads decode concurrently

    def decode_and_score(self, reward: Reward, final: Tensor, prompts: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
        """Images from the final latents, then :meth:`score`; no grad (grad mode is per thread). Samples whose latents
        are not finite are scored on finite stand-ins (NaN: 0.5 grey; latents: 0): the update checks the latents
        themselves and skips the update they would enter (:mod:`jagg_lightning.faults.nonfinite`). A reward that scores
        latents alone (``scores_latents``, every component of it) is handed the final latents and nothing is
        decoded; with another reward needing images, both are handed in."""
        with torch.no_grad():
            images = latents = None
            if reward.needs_images():
                with CLOCK.phase("decode"):
                    images = self.policy.decode_samples(final, prompts)
                with self._decode_count_lock:
                    self.decoded_samples += len(prompts)
                if not bool(torch.isfinite(images).all()):
                    images = torch.nan_to_num(images, nan=0.5, posinf=1.0, neginf=0.0).clamp(0, 1)
            if reward.needs_latents():
                latents = final if bool(torch.isfinite(final).all()) else torch.nan_to_num(final, 0.0, 0.0, 0.0)
            with CLOCK.phase("reward"):
                return self.score(reward, images, prompts, latents)

    def score(self, reward: Reward, images: Tensor | None, prompts: list[str],
              latents: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The reward's total and components; a failure is re-raised naming the reward. ``latents`` reach the
        reward only when it scores latents (:func:`~jagg_lightning.rewards.base.scored_components`)."""
        try:
            return scored_components(reward, images, prompts, latents)
        except Exception as err:
            if isinstance(err, RewardError) or str(err).startswith("reward "):  # already names the reward
                raise
            raise RewardError(f"reward {reward.name} ({type(reward).__name__}) failed while scoring "
                              f"{len(prompts)} images: {type(err).__name__}: {err}") from err

    def _reward_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.reward_workers, thread_name_prefix="jagg-reward")
        return self._pool

    def close(self) -> None:
        """Shut the reward workers down (a later rollout starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._in_flight = None, []

    # ------------------------------------------------------------------ KL reference
    @torch.no_grad()
    def reference_velocity(self, z: Tensor, t: Tensor, cond) -> Tensor:
        """The reference policy's velocity: the policy with its adapter off."""
        with self.policy.adapter_disabled():
            return self.velocity(z, t, cond)

    @torch.no_grad()
    def reference_velocities(self, traj: Trajectory, cond: tuple, steps: list[int]) -> Tensor | None:
        """v with the adapter off at every step of ``steps``, zeros elsewhere, as a separate pass over a finished
        trajectory (training takes them inside the rollout instead; this is the independent check);
        theta-independent, so once per rollout."""
        if self.kl_beta == 0:
            return None
        out = torch.zeros_like(traj.velocities)
        for k in steps:
            self.reference_at_step(traj, cond, k, out)
        return out

    @torch.no_grad()
    def reference_at_step(self, traj: Trajectory, cond: tuple, k: int, out: Tensor) -> int:
        """out[k] = the reference velocity at step k of the finished ``traj``, in rollout-sized passes; returns the
        forwards made (``train/passes/reference_forward`` counts them)."""
        size = self.sampling.rollout_batch_size
        for i in range(0, out.shape[1], size):
            z = traj.latents[k, i : i + size]
            out[k, i : i + size] = self.reference_velocity(z, traj.times[k].expand(z.shape[0]),
                                                           batch_slice(cond, slice(i, i + size)))
        return -(-out.shape[1] // size)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def ode_images(self, prompts: list[str], prompt_indices, samples_per_prompt: int, seed: int, step: int,
                   num_steps: int, guidance: Guidance | None = None, with_latents: bool = False):
        """``samples_per_prompt`` images per prompt (prompt-major) [N, 3, H, W] in [0, 1] by ODE (Euler)
        sampling with ``num_steps`` steps, ``guidance`` (None: ``policy.guidance_scale``) and the policy's current
        weights; the noise of sample i of prompt index j depends on (seed, step, j, i) only. ``with_latents``:
        (images, the final latents they were decoded from), for a reward that scores latents."""
        guidance = guidance or self.policy.guidance()
        encoded = self.encode_prompts(prompts, guidance)
        cond = tuple(c.repeat_interleave(samples_per_prompt, dim=0) for c in encoded)
        traj = sample_trajectories(
            functools.partial(self.policy.velocity, guidance=guidance), cond,
            sample_generators(seed, step, prompt_indices, samples_per_prompt),
            self.policy.latent_shape, self.schedule(num_steps), ["ode"] * num_steps, 0.0,
            self.sampling.rollout_batch_size, self.device, self.sde_dtype,
        )
        images = self.policy.decode_samples(traj.latents[-1], [p for p in prompts for _ in range(samples_per_prompt)])
        return (images, traj.latents[-1]) if with_latents else images

    # ------------------------------------------------------------------ memory budget
    def activation_bytes(self, samples: int = 1) -> int:
        """Bytes autograd keeps for the backward of ONE sample's forward with grad (the velocity at the
        current guidance: with CFG both branches), measured once by counting the tensors saved for
        backward (frozen weights excluded, shared storage counted once): the unit of
        ``jagg.memory_budget_mb``. Activations grow linearly with the samples in a pass (``samples`` > 1
        measures a pass of that many, uncached)."""
        if samples > 1:
            return self._measure_activation_bytes(samples)
        key = self.guidance
        if key not in self._activation_bytes:
            self._activation_bytes[key] = self._measure_activation_bytes(1)
        return self._activation_bytes[key]

    def _measure_activation_bytes(self, samples: int) -> int:
        weights = {p.untyped_storage().data_ptr() for p in self.policy.parameters()}
        seen: dict[int, int] = {}
        held: list[Tensor] = []  # every saved storage stays alive until the count is done: no address is reused

        def pack(t: Tensor) -> None:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
            held.append(t.detach())
            # the graph keeps nothing (it gets no backward): a saved output handed back as itself would close the
            # cycle output -> grad_fn -> saved output that keeps the whole forward alive for the life of the process

        def unpack(_) -> Tensor:
            raise RuntimeError("the activation-measuring forward is not for backward")

        # the probe prompt carries as many (grey) condition images as the family takes: none for text-to-image
        probe = ConditionedPrompt("a", [torch.full((3, 8, 8), 0.5)] * self.policy.condition_images[0])
        cond = tuple(c[:1].repeat_interleave(samples, dim=0) for c in self.encode([probe]))
        z = torch.randn(samples, *self.policy.latent_shape, generator=torch.Generator().manual_seed(0))
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            self.velocity(z.to(self.device), torch.full((samples,), 0.5, device=self.device), cond)
        return sum(seen.values())
