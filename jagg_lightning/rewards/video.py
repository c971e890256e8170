"""Rewards on videos [B, F, 3, H, W] in [0, 1]: any image reward on chosen frames, and temporal consistency.

``FrameReward(reward, frames, aggregate)`` scores frames f_1..f_n of each video with an image reward (one
batched call of B n images) and aggregates per video:

    mean:  R(video) = (1 / n) sum_j r(video[f_j])      (the usual per-frame average, e.g. DanceGRPO's)
    min:   R(video) = min_j r(video[f_j])              ("no bad frame": the worst chosen frame's score)

``TemporalConsistency`` needs no weights:

    R(video) = -(1 / (F - 1)) sum_{f=1}^{F-1} mean_pixels |x_{f+1} - x_f|      (0 for one frame)

the negative mean absolute change between consecutive frames, in [-1, 0]; a static video scores 0, the most.
It rewards smoothness only (a frozen video is its optimum): combine it with a content reward in
``WeightedReward``, which logs every component.
"""

from __future__ import annotations

from torch import Tensor

from jagg_lightning.rewards.base import Reward
from jagg_lightning.rewards.registry import build_reward

AGGREGATES = ("mean", "min")


class FrameReward(Reward):
    """An image reward on chosen frames of each video, aggregated by ``mean`` or ``min`` (module docstring).

    reward: a Reward instance or a registered reward name. frames: None = every frame; an int n = n frames
    evenly spaced from the first to the last; a list = those frame indices (negative counts from the end).
    name: the component name in ``WeightedReward`` (default ``<reward>_<aggregate>``).
    """

    name = "frames"
    accepts_video = True

    def __init__(self, reward: Reward | str, frames: int | list[int] | None = None, aggregate: str = "mean",
                 name: str | None = None):
        super().__init__()
        if aggregate not in AGGREGATES:
            raise ValueError(f"FrameReward.aggregate must be one of {list(AGGREGATES)}, got {aggregate!r}")
        if isinstance(frames, bool) or not (frames is None or (isinstance(frames, int) and frames >= 1) or (
                isinstance(frames, (list, tuple)) and frames and all(isinstance(f, int) for f in frames))):
            raise ValueError(f"FrameReward.frames must be null (all), an integer >= 1 (evenly spaced) or a non-empty "
                             f"list of frame indices, got {frames!r}")
        self.reward = build_reward(reward)
        if getattr(self.reward, "accepts_video", False):
            raise ValueError(f"FrameReward.reward must be an image reward, got the video reward {self.reward.name!r}")
        self.frames, self.aggregate = frames, aggregate
        self.name = name or f"{self.reward.name}_{aggregate}"
        self.freeze()

    def frame_indices(self, num_frames: int) -> list[int]:
        """The frames scored in a video of ``num_frames`` frames."""
        if self.frames is None:
            return list(range(num_frames))
        if isinstance(self.frames, int):
            n = min(self.frames, num_frames)
            return [round(j * (num_frames - 1) / (n - 1)) for j in range(n)] if n > 1 else [0]
        if not all(-num_frames <= f < num_frames for f in self.frames):
            raise ValueError(f"FrameReward.frames {list(self.frames)} out of range for {num_frames} frames")
        return [f % num_frames for f in self.frames]

    def score(self, videos: Tensor, prompts: list[str]) -> Tensor:
        idx = self.frame_indices(videos.shape[1])
        images = videos[:, idx].flatten(0, 1)  # [B n, 3, H, W], video-major
        scores = self.reward(images, [p for p in prompts for _ in idx]).view(len(prompts), len(idx))
        return scores.mean(1) if self.aggregate == "mean" else scores.min(1).values


class TemporalConsistency(Reward):
    """-(mean over consecutive frame pairs and pixels of |x_{f+1} - x_f|): 0 for a static video (module docstring)."""

    name = "temporal_consistency"
    accepts_video = True

    def __init__(self):
        super().__init__()
        self.freeze()

    def score(self, videos: Tensor, prompts: list[str]) -> Tensor:
        if videos.shape[1] < 2:
            return videos.new_zeros(videos.shape[0])
        return -(videos[:, 1:].float() - videos[:, :-1].float()).abs().flatten(1).mean(1)
