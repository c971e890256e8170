"""A weighted sum of rewards that reports every component as well as the total."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jagg_lightning.rewards.base import Reward, scored


class WeightedReward(Reward):
    """total = sum_i weight_i * reward_i(images, prompts); each component is scored once per call."""

    name = "weighted"
    accepts_video = True  # each component checks what it is given (image rewards refuse videos by name)

    def __init__(self, rewards: list[Reward], weights: list[float] | None = None):
        super().__init__()
        if not rewards:
            raise ValueError("WeightedReward.rewards must not be empty")
        weights = [1.0] * len(rewards) if weights is None else list(weights)
        if len(weights) != len(rewards):
            raise ValueError(f"WeightedReward.weights must have {len(rewards)} entries, got {len(weights)}")
        names = [r.name for r in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"WeightedReward.rewards must have distinct names, got {names}")
        self.rewards = nn.ModuleList(rewards)
        self.weights = dict(zip(names, (float(w) for w in weights)))
        self.freeze()

    def needs_images(self) -> bool:
        return any(r.needs_images() for r in self.rewards)

    def check_prompts(self, prompts: list[str], field: str) -> None:
        for reward in self.rewards:
            reward.check_prompts(prompts, field)

    def needs_latents(self) -> bool:
        return any(r.needs_latents() for r in self.rewards)

    def score_with_components(self, images: Tensor | None, prompts: list[str],
                              latents: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        # each component checks what it is given and names itself when it fails
        components = {r.name: scored(r, images, prompts, latents) for r in self.rewards}
        total = torch.stack([self.weights[n] * c for n, c in components.items()]).sum(0)
        return total, components

    @torch.no_grad()
    def forward(self, images: Tensor | None, prompts: list[str], latents: Tensor | None = None) -> Tensor:
        return self.score_with_components(images, prompts, latents)[0]

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.score_with_components(images, prompts)[0]


def component_weights(reward: Reward) -> dict[str, float] | None:
    """The weight of each component that makes up ``reward``'s total: a WeightedReward's own weights, a
    monitored reward's trained reward's (monitors have none), any other reward is its one component with
    weight 1; None where the reward's components are unknown before it scores (a reward whose own
    ``score_with_components`` reports them, e.g. a served WeightedReward)."""
    inner = getattr(reward, "trained_reward", None)
    if inner is not None:
        return component_weights(inner)
    if isinstance(reward, WeightedReward):
        return dict(reward.weights)
    if type(reward).score_with_components is not Reward.score_with_components:
        return None
    return {reward.name: 1.0}
