"""The routed update: from a scored rollout to LoRA gradients and optimizer steps.

Unfused (:meth:`Updater.unfused`): route the windows on the recorded velocities, complete the KL reference,
then for every update (``inner_epochs`` x micro-batches per update) run the JAGG engine
(:func:`jagg_lightning.jagg.accumulate_gradients`) over shuffled micro-batches and step the optimizer.
Fused (:meth:`Updater.fused`): the rollout itself keeps the graphs of the steps that get a backward and each
rollout micro-batch is scored, given its advantages, routed and back-propagated as soon as it is sampled.

The :class:`Updater` is handed the policy, the config sections and the :class:`~jagg_lightning.sampler.Sampler`;
what belongs to the Lightning side (the backward call, the optimizer step, the collectives) comes in per
training step as :class:`UpdateHooks`. Plain torch, no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from jagg_lightning.batching import batch_slice
from jagg_lightning.collectives import Collectives
from jagg_lightning.grpo import StepRecord, combined_advantages, group_advantages, step_loss
from jagg_lightning.jagg import (
    Window, WindowGradientCheck, WindowRecord, accumulate_gradients, alphas, check_window_gradients, draw_corrections,
    route_windows, routing_score,
)
from jagg_lightning.passes import fused_graph_steps, fused_samples, pass_plan, reference_steps
from jagg_lightning.rewards import Reward, component_weights
from jagg_lightning.rollout import RolloutBatch, RolloutPlan, Trajectory, sample_seed
from jagg_lightning.sampler import Sampler

_ROUTING_STREAM, _CONTROL_STREAM = -4, -5  # sample_seed streams of the random routing scores and the control draws


@dataclass
class UpdateHooks:
    """What the update needs from the training loop: the backward call (Lightning's ``manual_backward``), the
    optimizer step that follows an update's backward passes, and the collectives of the processes."""

    backward: Callable[[Tensor], None] = Tensor.backward
    optimizer_step: Callable[[], None] = lambda: None
    collectives: Collectives = field(default_factory=Collectives)


@dataclass
class StepReport:
    """What one training step's rollout and update produced: the module logs it and keeps it for callbacks."""

    trajectory: Trajectory
    cond: tuple
    rewards: Tensor  # [N]
    components: dict[str, Tensor]  # reward component -> [N]
    advantages: Tensor  # [N]
    records: list[WindowRecord]  # per window and engine pass
    stats: list  # (k, StepLossStats) of the updates after the first
    first_update_stats: list  # (k, StepLossStats) of the first update after the rollout (theta = theta_old)
    micro_batches: int  # training micro-batches over all updates (exact GRPO's backward count per step)
    skipped_samples: int = 0  # zero-advantage samples given no pass
    advantage_parts: dict[str, Tensor] = field(default_factory=dict)  # each weighted reward's part [N] of the advantages


class Updater:
    def __init__(self, policy, sampling, grpo, jagg, sampler: Sampler):
        self.policy, self.sampling, self.grpo, self.jagg, self.sampler = policy, sampling, grpo, jagg, sampler

    def advantages(self, rewards: Tensor, collectives: Collectives | None = None) -> Tensor:
        """Group advantages of rewards [N] laid out prompt-major (``grpo`` settings; global std over all processes)."""
        all_reduce = (collectives or Collectives()).sum
        return group_advantages(rewards.view(-1, self.sampling.group_size), self.grpo.adv_std, self.grpo.adv_eps,
                                self.grpo.adv_clip, self.grpo.std_ddof, all_reduce=all_reduce).flatten()

    def reward_advantages(self, rewards: Tensor, components: dict[str, Tensor], reward: Reward,
                          collectives: Collectives | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Advantages [N] of a scored rollout and each weighted reward's part of them (``grpo.multi_reward``;
        :func:`~jagg_lightning.grpo.combined_advantages`); monitors (``MonitoredReward``) have no weight, so
        never enter. "weighted_sum" gives exactly :meth:`advantages` of the total."""
        weights = component_weights(reward)
        if weights is None and len(components) == 1:
            weights = dict.fromkeys(components, 1.0)
        if self.grpo.multi_reward == "per_reward" and (weights is None or not set(weights) <= set(components)):
            raise ValueError(f"grpo.multi_reward 'per_reward' needs the weight of every reward, but reward "
                             f"{reward.name} ({type(reward).__name__}) reports components {sorted(components)} "
                             "without them (a served WeightedReward): put one RemoteReward per served reward in a "
                             "local WeightedReward, or use 'weighted_sum'")
        if weights is not None and not set(weights) <= set(components):
            weights = None  # the reward reports other components than it weights: no parts to show
        g = self.grpo
        all_reduce = (collectives or Collectives()).sum
        return combined_advantages(rewards, components, weights, self.sampling.group_size, g.multi_reward, g.adv_std,
                                   g.adv_eps, g.adv_clip, g.std_ddof, all_reduce)

    def route(self, traj: Trajectory, windows: list[Window], collectives: Collectives | None = None, step: int = 0,
              draw: int = 0) -> list[Window]:
        """Score every window from the recorded velocities (``jagg.routing``; mean over all samples of all
        processes), route and, with ``jagg.estimator: control_variate``, draw each routed window's B (in place;
        the windows are returned). ``random`` scores and the draws come from generators seeded by (sampling.seed,
        ``step``, ``draw``: the fused mode's micro-batch), alike on every process; the global RNG is untouched."""
        gen = torch.Generator().manual_seed(sample_seed(self.sampling.seed, step, _ROUTING_STREAM, draw))
        scores = torch.stack([routing_score(self.jagg.routing, traj.velocities, traj.times, w.steps, gen)
                              for w in windows]).to(self.sampler.device)
        if self.jagg.routing != "random":  # drawn alike everywhere; measured scores differ per process
            # every process must route alike: under DDP the backward calls (and their all-reduces) must match
            scores = (collectives or Collectives()).mean(scores)
        route_windows(windows, scores.tolist(), self.jagg.jagg_frac, self.jagg.window_size, self.jagg.score_limit)
        control = self.jagg.estimator == "control_variate"
        gen = torch.Generator().manual_seed(sample_seed(self.sampling.seed, step, _CONTROL_STREAM, draw))
        draw_corrections(windows, self.jagg.control_p if control else None, gen)
        return windows

    @torch.no_grad()
    def complete_reference(self, traj: Trajectory, cond: tuple, windows: list[Window], taken: set[int]) -> None:
        """Fill in, once the windows are routed, the reference velocities the rollout did not take
        (``interpolate_reference``): a routed window's interior steps are interpolated from its anchors'
        (alpha_k of the window), an exact window's are taken with the adapter off. In place."""
        ref = traj.ref_velocities
        if ref is None:
            return
        for w in windows:
            missing = [k for k in w.interior if k not in taken]
            if missing and w.routed:
                alpha = alphas(traj.times, w.steps)
                a, b = w.anchors
                for i, k in enumerate(w.steps):
                    if k in missing:
                        ref[k] = (1 - alpha[i]).to(ref.dtype) * ref[a] + alpha[i].to(ref.dtype) * ref[b]
            else:
                for k in missing:
                    self.sampler.reference_at_step(traj, cond, k, ref)

    # ------------------------------------------------------------------ the engine
    def step_loss_fn(self, mb: Trajectory, advantages: Tensor, ref_v: Tensor | None, scale: float, stats: list):
        """(k, v) -> this micro-batch's step-k share of the objective; appends (k, stats) to ``stats``."""
        kind, g = self.sampling.step_kind, self.grpo
        times = mb.times.tolist()  # one host read per micro-batch, not two per step

        def loss_of_step(k: int, v: Tensor) -> Tensor:
            record = StepRecord(
                mb.latents[k], mb.latents[k + 1], times[k], times[k + 1], mb.log_probs[k],
                advantages, None if ref_v is None else ref_v[k],
            )
            loss, st = step_loss(v, record, kind, self.sampling.noise_level, g.clip_range, g.kl_beta,
                                 self.sampling.cps_log_prob, g.kl_convention)
            stats.append((k, st))
            return loss.mean() * scale

        return loss_of_step

    def backward_samples(self, mb: Trajectory, advantages: Tensor, cond: tuple, update_size: int, plan: RolloutPlan,
                         windows: list[Window], use_cache: bool, stats: list, backward) -> list[WindowRecord]:
        """The engine over ``mb``'s samples, in passes of as many samples as ``jagg.memory_budget_mb`` allows
        (:func:`~jagg_lightning.passes.pass_plan`); each sample's loss is scaled by 1 / (update_size * trained steps)."""
        size, split_anchors = pass_plan(advantages.shape[0], windows, self.jagg, self.sampler.activation_bytes)
        records = []
        for start in range(0, advantages.shape[0], size):
            rows = slice(start, start + size)
            records += self.engine_pass(mb.select(rows), advantages[rows], batch_slice(cond, rows), update_size, plan,
                                        windows, use_cache, stats, split_anchors, backward)
        return records

    def engine_pass(self, mb: Trajectory, advantages: Tensor, cond: tuple, update_size: int, plan: RolloutPlan,
                    windows: list[Window], use_cache: bool, stats: list, low_memory: bool, backward,
                    graphs: dict[int, Tensor] | None = None):
        """One :func:`accumulate_gradients` call over all of ``mb``'s samples. ``use_cache``: theta is still the
        rollout's theta_old; the anchors then take one forward each, of the rollout's batch shape (with one
        backward), so the recomputed log-probs are the rollout's bit for bit (ratio exactly 1)."""
        scale = advantages.shape[0] / (update_size * len(plan.trained_steps))
        loss_of_step = self.step_loss_fn(mb, advantages, mb.ref_velocities, scale, stats)
        return accumulate_gradients(
            self.policy.velocity, mb.latents, mb.times, cond, loss_of_step, windows,
            cached_velocities=mb.velocities if (use_cache and self.jagg.cache_interior) else None,
            low_memory=low_memory, backward=backward, graphs=graphs, batch_anchors=not use_cache,
        )

    def drop_zero_advantage(self, group: list[Tensor], advantages: Tensor,
                            collectives: Collectives) -> tuple[list[Tensor], int]:
        """The micro-batches of one update without the samples whose advantage is exactly 0, repacked into
        micro-batches of ``train_batch_size`` (when kl_beta = 0 they contribute nothing, so the update,
        which keeps its full-size normalisation, is the same), and how many samples were skipped. Every process
        makes as many micro-batches as the process with the most under a sharded strategy -- a short one pads
        with single zero-advantage samples (zero gradient) -- so the collectives inside the passes (FSDP's
        all-gathers) stay matched."""
        if not self.grpo.skip_zero_advantage or self.grpo.kl_beta > 0:
            return group, 0
        index = torch.cat(group)
        nonzero = advantages[index] != 0
        keep, zero = index[nonzero], index[~nonzero]
        kept = list(keep.split(self.grpo.train_batch_size)) if len(keep) else []
        count = collectives.max_count_if_sharded(torch.tensor(len(kept), device=self.sampler.device))
        padding = int(count) - len(kept)
        kept += [zero[i : i + 1] for i in range(padding)]
        return kept, len(zero) - padding

    def check_windows(self, batch: RolloutBatch, plan: RolloutPlan, params: list[torch.nn.Parameter],
                      max_samples: int | None = None) -> list[WindowGradientCheck]:
        """Exact vs JAGG gradient of every window of ``plan`` on the first ``max_samples`` samples of ``batch``,
        at the current theta (:func:`~jagg_lightning.jagg.check_window_gradients`; ``.grad`` untouched)."""
        index = torch.arange(batch.advantages.shape[0], device=batch.advantages.device)[:max_samples]
        mb = batch.trajectory.select(index)
        ref = None if batch.ref_velocities is None else batch.ref_velocities[:, index]
        loss_of_step = self.step_loss_fn(mb, batch.advantages[index], ref, 1.0 / len(plan.trained_steps), [])
        return check_window_gradients(self.policy.velocity, params, mb.latents, mb.times,
                                      batch_slice(batch.cond, index), loss_of_step, plan.windows)

    # ------------------------------------------------------------------ the two update modes
    def unfused(self, traj: Trajectory, cond: tuple, rewards: Tensor, components: dict[str, Tensor],
                advantages: Tensor, step: int, plan: RolloutPlan, taken: set[int], hooks: UpdateHooks) -> StepReport:
        """Route, complete the reference, then ``inner_epochs`` passes over shuffled micro-batches of the finished
        rollout, one optimizer step per update."""
        self.route(traj, plan.windows, hooks.collectives, step)
        self.complete_reference(traj, cond, plan.windows, taken)
        num = advantages.shape[0]
        shuffle = torch.Generator().manual_seed(sample_seed(self.sampling.seed, step, -1))
        report = StepReport(traj, cond, rewards, components, advantages, [], [], [], 0)
        theta_is_old = True
        for _ in range(self.grpo.inner_epochs):
            # shuffled into micro-batches, each in the rollout's row order: a matmul kernel may round a row
            # differently by its position in the batch (AVX-512 blocks rows), so on the first update the forwards
            # see the rollout's rows where they were and the ratio is 1 bit for bit
            perm = torch.randperm(num, generator=shuffle).to(self.sampler.device)
            micro = [m.sort().values for m in perm.split(self.grpo.train_batch_size)]
            per_update = self.grpo.micro_batches_per_update or len(micro)
            for start in range(0, len(micro), per_update):
                group = micro[start : start + per_update]
                update_size = sum(len(m) for m in group)
                group, skipped = self.drop_zero_advantage(group, advantages, hooks.collectives)
                report.skipped_samples += skipped
                with hooks.collectives.local_backward():
                    for index in group:
                        # this micro-batch's share of d(mean loss over the update)/dtheta
                        report.records += self.backward_samples(
                            traj.select(index), advantages[index], batch_slice(cond, index), update_size, plan,
                            plan.windows, theta_is_old, report.first_update_stats if theta_is_old else report.stats,
                            hooks.backward)
                hooks.optimizer_step()
                theta_is_old = False
        report.micro_batches = self.grpo.inner_epochs * len(micro)
        return report

    def fused(self, prompts: list[str], indices: list[int], step: int, plan: RolloutPlan, reward: Reward,
              hooks: UpdateHooks) -> StepReport:
        """Rollout and update in one pass (``jagg.fused_rollout``; see :func:`~jagg_lightning.passes.fused_graph_steps`).

        As each rollout micro-batch of n samples (whole groups) ends: decode, score, advantages, route its
        windows on its own recorded velocities (mean over the processes), fold the interior g_k from
        those velocities into the anchors and run ONE backward over the kept graphs (scaled by
        n / (N * trained steps), as the unfused update); samples beyond ``fused_samples`` go through the
        unfused engine (interiors from the cache), then the graphs are freed. With ``reward_workers`` > 0 a
        micro-batch is decoded and scored in the reward pool while the next one samples and its update runs
        once that one is sampled (the same backward calls in the same order; the graphs of two micro-batches
        are held meanwhile).
        """
        K = self.sampling.group_size
        sample_prompts = [p for p in prompts for _ in range(K)]
        num = len(sample_prompts)
        graphs: dict[int, Tensor] = {}
        rewards, components, advantages, parts = [], [], [], []
        records: list[WindowRecord] = []
        stats: list = []
        skipped = 0
        cond = self.sampler.encode(prompts)
        graph_steps = fused_graph_steps(plan.windows, self.jagg)
        graph_samples = fused_samples(len(graph_steps), self.jagg, self.sampler.activation_bytes)
        waiting: list[tuple] = []  # (samples, trajectory, scoring job, kept graphs) not updated yet

        def update_micro_batch(part: slice, traj: Trajectory, scored, kept_graphs: dict[int, Tensor]) -> None:
            nonlocal skipped
            total, comps = scored.result()
            # group std (check_fused): this micro-batch's groups alone
            adv, adv_parts = self.reward_advantages(total, comps, reward, hooks.collectives)
            rewards.append(total), components.append(comps), advantages.append(adv), parts.append(adv_parts)
            mb, mb_cond = traj.select(part), batch_slice(cond, part)  # views: a completed reference is the trajectory's
            windows = self.route(mb, plan.windows, hooks.collectives, step, part.start)
            self.complete_reference(mb, mb_cond, windows, taken)
            n = adv.shape[0]
            kept = n if graph_samples is None else min(graph_samples, n)
            if self.grpo.skip_zero_advantage and self.grpo.kl_beta == 0 and not bool(adv.any()):
                skipped += n  # all groups tied: a zero gradient, no backward (its forwards were the rollout's)
                return
            with hooks.collectives.local_backward():
                rows = slice(0, kept)
                records.extend(self.engine_pass(mb.select(rows), adv[rows], batch_slice(mb_cond, rows), num, plan,
                                                windows, True, stats, self.jagg.low_memory, hooks.backward,
                                                kept_graphs))
                if kept < n:  # the samples without kept graphs: the unfused engine, interiors from the cache
                    rows = slice(kept, n)
                    records.extend(self.backward_samples(mb.select(rows), adv[rows], batch_slice(mb_cond, rows), num,
                                                         plan, windows, True, stats, hooks.backward))

        def micro_batch_sampled(part: slice, final: Tensor, traj: Trajectory) -> None:
            waiting.append((part, traj, self.sampler.score_later(reward, final, sample_prompts[part]), dict(graphs)))
            graphs.clear()
            while len(waiting) > (1 if self.sampler.reward_workers else 0):
                update_micro_batch(*waiting.pop(0))

        taken = reference_steps(plan.windows, self.jagg)
        traj, cond = self.sampler.rollout(prompts, indices, step, micro_batch_sampled, plan.step_kinds, sorted(taken),
                                          cond=cond, grad_steps=graph_steps, grad_samples=graph_samples,
                                          on_graph=graphs.__setitem__)
        while waiting:
            update_micro_batch(*waiting.pop(0))
        hooks.optimizer_step()
        components = {name: torch.cat([c[name] for c in components]) for name in components[0]}
        parts = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
        # the fused update's stats are all of its one (first) update
        return StepReport(traj, cond, torch.cat(rewards), components, torch.cat(advantages), records, [], stats,
                          -(-num // self.sampling.rollout_batch_size), skipped, parts)
