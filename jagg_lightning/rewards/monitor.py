"""Monitor rewards: scored and logged beside the trained reward, never part of the advantages.

Reward hacking shows as the trained reward rising while an independent judge of the same images falls
(OCR up, aesthetics down; a reward model's favourite artefacts up, a held-out judge down). A
:class:`MonitoredReward` scores its ``monitors`` on every image it scores -- every rollout, in the
reward pool with the trained reward, and every evaluation -- and reports them as components named
``monitor/<name>`` (logged as ``train/reward/monitor/<name>``, ``val/reward/monitor/<name>``); its total,
the only thing the advantages see, is the trained reward's. The
:class:`~jagg_lightning.callbacks.RewardHackingWatch` callback compares the two.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jagg_lightning.rewards.base import Reward, scored, scored_components

MONITOR_PREFIX = "monitor/"


class MonitoredReward(Reward):
    """``reward`` (trained) with ``monitors`` (watched): total = reward's total; components = the reward's
    components plus ``monitor/<name>`` for each monitor. Put it outermost (a WeightedReward keeps only the
    totals of the rewards inside it)."""

    name = "monitored"

    def __init__(self, reward: Reward, monitors: list[Reward]):
        super().__init__()
        if not isinstance(reward, Reward) or not monitors or not all(isinstance(m, Reward) for m in monitors):
            raise ValueError("MonitoredReward needs a reward and a non-empty list of monitors, each a Reward "
                             f"(class_path + init_args in a config), got {type(reward).__name__} and {monitors!r}")
        self.trained_reward = reward
        self.monitors = nn.ModuleList(monitors)
        names = [m.name for m in self.monitors]
        if len(set(names)) != len(names):
            raise ValueError(f"MonitoredReward.monitors must have distinct names, got {names}")
        self.name = self.trained_reward.name
        self.freeze()

    def needs_images(self) -> bool:
        return self.trained_reward.needs_images() or any(m.needs_images() for m in self.monitors)

    def needs_latents(self) -> bool:
        return self.trained_reward.needs_latents() or any(m.needs_latents() for m in self.monitors)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.trained_reward(images, prompts)

    @torch.no_grad()
    def forward(self, images: Tensor | None, prompts: list[str], latents: Tensor | None = None) -> Tensor:
        return scored(self.trained_reward, images, prompts, latents)

    def score_with_components(self, images: Tensor | None, prompts: list[str],
                              latents: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        total, components = scored_components(self.trained_reward, images, prompts, latents)
        watched = {f"{MONITOR_PREFIX}{m.name}": scored(m, images, prompts, latents) for m in self.monitors}
        return total, {**components, **watched}
