"""Rewards on videos [B, F, 3, H, W]: an image reward on chosen frames (mean / min), the weight-free temporal
consistency, WeightedReward over both, and videos written as animated GIF."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from jagg_lightning.rewards import FrameReward, JpegCompressibility, TemporalConsistency, WeightedReward
from jagg_lightning.rewards.jpeg import jpeg_size_kb
from jagg_lightning.training.images import gif_bytes, image_grid


def smooth_videos(gen, b=3, f=6, side=32):
    """Videos of smooth images (random 4 x 4 colours upsampled) drifting slowly from frame to frame."""
    coarse = torch.rand(b, 1, 3, 4, 4, generator=gen) + 0.03 * torch.randn(b, f, 3, 4, 4, generator=gen).cumsum(1)
    frames = torch.nn.functional.interpolate(coarse.flatten(0, 1), size=(side, side), mode="bilinear")
    return frames.view(b, f, 3, side, side).clamp(0, 1)


def test_frame_reward_mean_and_min_are_the_frames_scores(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    videos = smooth_videos(gen)
    videos[1, 2] = torch.rand(3, 32, 32, generator=gen)  # one noisy (incompressible) frame: the worst of video 1
    per_frame = -torch.stack([jpeg_size_kb(videos[:, f]) for f in range(videos.shape[1])], 1)  # [B, F]
    prompts = ["a", "b", "c"]
    mean = FrameReward("jpeg_compressibility")(videos, prompts)
    worst = FrameReward(JpegCompressibility(), aggregate="min", name="jpeg_worst")(videos, prompts)
    torch.testing.assert_close(mean, per_frame.mean(1))
    assert torch.equal(worst, per_frame.min(1).values) and worst[1] == per_frame[1, 2]
    chosen = FrameReward("jpeg_compressibility", frames=[0, -1])(videos, prompts)
    torch.testing.assert_close(chosen, per_frame[:, [0, -1]].mean(1))


def test_frame_indices_and_bad_arguments():
    assert FrameReward("jpeg_compressibility", frames=3).frame_indices(9) == [0, 4, 8]
    assert FrameReward("jpeg_compressibility", frames=1).frame_indices(9) == [0]
    assert FrameReward("jpeg_compressibility", frames=20).frame_indices(4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="FrameReward.aggregate must be one of"):
        FrameReward("jpeg_compressibility", aggregate="median")
    with pytest.raises(ValueError, match="FrameReward.frames must be"):
        FrameReward("jpeg_compressibility", frames=0)
    with pytest.raises(ValueError, match="FrameReward.reward must be an image reward"):
        FrameReward(TemporalConsistency())


def test_image_reward_refuses_videos_naming_frame_reward(rng_seed):
    videos = torch.rand(2, 3, 3, 8, 8, generator=torch.Generator().manual_seed(rng_seed))
    with pytest.raises(ValueError, match="FrameReward"):
        JpegCompressibility()(videos, ["a", "b"])


def test_temporal_consistency_prefers_static_over_shuffled(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    videos = smooth_videos(gen)
    static = videos[:, :1].expand_as(videos).contiguous()
    shuffled = videos[:, [0, 3, 1, 5, 2, 4]]  # every neighbour 2-4 drift steps apart (a random order may be reversed)
    reward = TemporalConsistency()
    s_static, s_smooth, s_shuffled = (reward(v, ["a"] * 3) for v in (static, videos, shuffled))
    assert torch.equal(s_static, torch.zeros(3))
    assert (s_smooth < 0).all() and (s_shuffled < s_smooth).all()
    expected = -torch.stack([(videos[:, f + 1] - videos[:, f]).abs().flatten(1).mean(1) for f in range(5)], 1).mean(1)
    torch.testing.assert_close(s_smooth, expected)


def test_weighted_reward_logs_every_video_component(rng_seed):
    videos = smooth_videos(torch.Generator().manual_seed(rng_seed))
    frames, temporal = FrameReward("jpeg_compressibility", frames=2, aggregate="min"), TemporalConsistency()
    total, components = WeightedReward([frames, temporal], [1.0, 10.0]).score_with_components(videos, ["a"] * 3)
    assert set(components) == {"jpeg_compressibility_min", "temporal_consistency"}
    torch.testing.assert_close(total, components["jpeg_compressibility_min"] + 10 * components["temporal_consistency"])


def test_videos_become_animated_gifs(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    videos = [torch.rand(5, 3, 8, 8, generator=gen) for _ in range(4)]
    grid = image_grid([videos[:2], videos[2:]])  # per frame, 2 x 2 videos
    assert grid.shape == (5, 16, 16, 3) and grid.dtype == np.uint8
    np.testing.assert_array_equal(grid[3], image_grid([[v[3] for v in videos[:2]], [v[3] for v in videos[2:]]]))
    gif = Image.open(io.BytesIO(gif_bytes(grid)))
    assert gif.format == "GIF" and gif.n_frames == 5 and gif.size == (16, 16)
