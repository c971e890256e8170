"""The reward protocol: images [B, 3, H, W] in [0, 1] and their prompts -> scores [B]."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn


def check_images(images: Tensor, prompts: list[str], name: str, video: bool = False) -> None:
    """Refuse what no reward should score: wrong shape, wrong count, values outside [0, 1]. ``video``: the
    reward also takes videos [B, F, 3, H, W]; an image reward given videos says how to score them."""
    if not isinstance(images, Tensor):
        raise ValueError(f"reward {name}: scores images, got {type(images).__name__} (a latent reward beside it does "
                         f"not make the sampler decode; declare needs_images)")
    if images.ndim == 5 and images.shape[2] == 3 and not video:
        raise ValueError(f"reward {name}: got videos {tuple(images.shape)}; score their frames with "
                         "jagg_lightning.rewards.FrameReward(reward, frames, aggregate)")
    if not ((images.ndim == 4 and images.shape[1] == 3) or (video and images.ndim == 5 and images.shape[2] == 3)):
        shapes = "[B, 3, H, W] or [B, F, 3, H, W]" if video else "[B, 3, H, W]"
        raise ValueError(f"reward {name}: images must be {shapes}, got shape {tuple(images.shape)}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"reward {name}: got {images.shape[0]} images but {len(prompts)} prompts")
    if not torch.isfinite(images).all() or images.min() < 0 or images.max() > 1:
        raise ValueError(f"reward {name}: image values must lie in [0, 1]")


def check_latents(latents: Tensor, prompts: list[str], name: str) -> None:
    """Refuse latents a latent reward cannot score: not a floating tensor [B, ...], or B != the prompts."""
    if not isinstance(latents, Tensor) or not latents.is_floating_point() or latents.ndim < 2:
        shown = tuple(latents.shape) if isinstance(latents, Tensor) else type(latents).__name__
        raise ValueError(f"reward {name}: scores latents, so it must be called with latents=[B, ...] (a floating "
                         f"tensor: the sampler's final latents), got {shown}")
    if len(prompts) != latents.shape[0]:
        raise ValueError(f"reward {name}: got {latents.shape[0]} latents but {len(prompts)} prompts")


def to_pil(images: Tensor) -> list[Image.Image]:
    """[B, 3, H, W] in [0, 1] -> RGB PIL images (what the scorers' own preprocessing expects)."""
    arrays = (images.detach().float().clamp(0, 1).cpu().permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in arrays]


def require_path(reward: str, field: str, path: str | None, allow_download: bool, hub_default: str | None = None) -> str:
    """A local path that exists, or -- only when the user allows it -- a hub id to download from."""
    if path is None:
        if allow_download and hub_default is not None:
            return hub_default
        raise ValueError(f"reward {reward}: {field} is required (a local path), or set allow_download: true")
    if not Path(path).exists() and not allow_download:
        raise FileNotFoundError(f"reward {reward}: {field} {path!r} does not exist (downloads are off)")
    return path


class RewardError(RuntimeError):
    """A reward failed while scoring; the message names it."""


def _plain_args(value):
    """Constructor arguments as plain data (rewards as their descriptions); TypeError for anything else."""
    if isinstance(value, Reward):
        described = value.describe()
        if "not_rebuildable" in described:
            raise TypeError(described["not_rebuildable"])
        return described
    if isinstance(value, dict):
        return {str(k): _plain_args(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_args(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"argument of type {type(value).__name__} is not plain data")


class Reward(nn.Module):
    """A frozen scorer. Subclasses implement :meth:`score`; ``forward`` checks inputs and outputs.

    Higher is better. Scores are float32 on the images' device, one per image. Every parameter is
    frozen (``requires_grad_(False)``, eval mode): DDP's reducer skips it, and the LoRA checkpoint, which
    keeps trainable weights only, never holds it.
    """

    name: str = "reward"
    accepts_video: bool = False  # True: scores videos [B, F, 3, H, W] too (rewards/video.py)
    # True: ``score(latents, prompts)`` scores the sampler's final latents [B, *latent_shape] (passed as
    # ``latents=``), so the rollout skips the VAE decode for it (it decodes only when another reward needs images)
    scores_latents: bool = False

    def __new__(cls, *args, **kwargs):
        # remember the constructor arguments, so the hyper-parameters can describe (and rebuild) the reward
        obj = super().__new__(cls)
        object.__setattr__(obj, "_init_call", (args, kwargs))
        return obj

    def __init__(self):
        super().__init__()

    def describe(self) -> dict:
        """Plain data: ``{"class_path", "init_args"}`` (nested rewards described alike), or, when an argument
        is not plain data, ``{"class_path", "not_rebuildable": why}``."""
        import inspect

        cls = type(self)
        path = f"{cls.__module__}.{cls.__qualname__}"
        args, kwargs = getattr(self, "_init_call", ((), {}))
        try:
            bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
        except TypeError as err:
            return {"class_path": path, "not_rebuildable": str(err)}
        init_args = {k: v for k, v in bound.arguments.items() if k != next(iter(bound.arguments))}
        try:
            return {"class_path": path, "init_args": _plain_args(init_args)}
        except TypeError as err:
            return {"class_path": path, "not_rebuildable": str(err)}

    def freeze(self) -> Reward:
        """Call at the end of a subclass ``__init__``, once the scorer's weights exist."""
        self.requires_grad_(False)
        return self.eval()

    def train(self, mode: bool = True) -> Reward:
        return super().train(False)  # a reward model never leaves eval mode

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        raise NotImplementedError

    def check_prompts(self, prompts: list[str], field: str) -> None:
        """Refuse, before training, a prompt of the data field ``field`` that this reward could never score (one
        error naming the field and the prompt). Default: every prompt can be scored."""

    def needs_images(self) -> bool:
        """Whether scoring needs the decoded images (a reward holding others: whether any of them does)."""
        return not self.scores_latents

    def needs_latents(self) -> bool:
        """Whether scoring needs the final latents (``latents=``; a reward holding others: any of them)."""
        return self.scores_latents

    @torch.no_grad()
    def forward(self, images: Tensor | None, prompts: list[str], latents: Tensor | None = None) -> Tensor:
        """Scores [B]; ``images`` [B, 3, H, W] in [0, 1], or for a latent reward (``scores_latents``) ``latents``
        (images may then be None)."""
        if self.scores_latents:
            if latents is None:
                raise ValueError(f"reward {self.name}: scores latents, so it must be called with latents=[B, ...] "
                                 f"(the sampler's final latents), not images")
            check_latents(latents, prompts, self.name)
            inputs, what = latents, "latents"
        else:
            check_images(images, prompts, self.name, self.accepts_video)
            inputs, what = images, "images"
        try:
            scores = self.score(inputs, prompts)
        except RewardError:
            raise
        except Exception as err:  # name the scorer that failed (inside a WeightedReward too)
            raise RewardError(f"reward {self.name} ({type(self).__name__}) failed: {type(err).__name__}: {err}") from err
        scores = scores.to(device=inputs.device, dtype=torch.float32).reshape(-1)
        if scores.shape[0] != inputs.shape[0]:
            raise RuntimeError(f"reward {self.name}: returned {scores.shape[0]} scores for {inputs.shape[0]} {what}")
        # a NaN or Inf score is returned as it is: training skips the update it would enter and names the reward
        # (jagg_lightning/faults/nonfinite.py); an evaluation mean shows it
        return scores

    def score_with_components(self, images: Tensor | None, prompts: list[str],
                              latents: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The total and every component by name (a single reward is its own component)."""
        total = self(images, prompts, latents=latents)
        return total, {self.name: total}


def scored_components(reward: Reward, images: Tensor | None, prompts: list[str],
                      latents: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """``reward.score_with_components``, handed ``latents=`` only when the reward needs them (a reward whose own
    ``score_with_components`` predates latent rewards takes none)."""
    if latents is not None and reward.needs_latents():
        return reward.score_with_components(images, prompts, latents=latents)
    return reward.score_with_components(images, prompts)


def scored(reward: Reward, images: Tensor | None, prompts: list[str], latents: Tensor | None = None) -> Tensor:
    """``reward(images, prompts)``, handed ``latents=`` only when the reward needs them (as :func:`scored_components`)."""
    if latents is not None and reward.needs_latents():
        return reward(images, prompts, latents=latents)
    return reward(images, prompts)


def callable_name(fn) -> str:
    """A reward name for a plain callable: its function's ``__name__`` (a ``functools.partial``'s function's, a
    callable object's class name), reduced to letters, digits, ``_ . -`` (a lambda's ``<lambda>`` is ``lambda``)."""
    import re

    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None) or type(fn).__name__
    return re.sub(r"[^0-9A-Za-z_.-]+", "", name) or "reward"


class CallableReward(Reward):
    """A plain callable ``fn(images, prompts) -> scores`` as a :class:`Reward` (``JAGGModule(reward=fn)`` wraps
    it): named after the function (:func:`callable_name`, or ``name``), checked like every reward (images
    [B, 3, H, W] in [0, 1], one finite-or-flagged score per image), scored under ``torch.no_grad``. ``fn`` may
    return a tensor, an array or a list of numbers. Frozen like the other rewards: an ``nn.Module`` given as
    ``fn`` is a submodule, its parameters ``requires_grad_(False)`` and in eval mode; a function's closure is not
    a submodule, so weights it closes over are never trained, saved in a checkpoint or seen by DDP either. Not
    recorded in the hyper-parameters (a function is not plain data): pass ``reward=`` again to
    ``load_from_checkpoint``."""

    def __init__(self, fn, name: str | None = None):
        super().__init__()
        if isinstance(fn, Reward) or not callable(fn):
            raise TypeError(f"CallableReward wraps a callable fn(images, prompts) -> scores, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or callable_name(fn)
        self.freeze()

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        scores = self.fn(images, prompts)
        if isinstance(scores, Tensor):
            return scores.detach()
        return torch.as_tensor(np.asarray(scores, dtype=np.float32))

    def describe(self) -> dict:
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}",
                "not_rebuildable": f"reward {self.name!r} is a plain callable (not plain data): pass reward=... again"}
