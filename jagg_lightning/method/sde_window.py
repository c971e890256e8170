"""The checks of ``sampling``'s SDE window (Flow-GRPO-Fast, MixGRPO, Flash-GRPO): which steps may be stochastic and
trained, and how the window is drawn (the draws themselves: :mod:`jagg_lightning.training.rollout`). Plain, a leaf of the
config: it imports only the step kinds and the check helpers."""

from __future__ import annotations

from jagg_lightning.method.sde import STEP_KINDS
from jagg_lightning.utils.checks import check


def check_sde_window(s) -> None:
    """The SDE window's fields of the ``SamplingConfig`` ``s`` (a message names the field and its range)."""
    if s.sde_window_size is None:
        check(s.sde_window_range is None, "sampling.sde_window_range", "null without sampling.sde_window_size",
              s.sde_window_range)
        check(s.sde_window_draw == "rollout", "sampling.sde_window_draw", "'rollout' without sampling.sde_window_size",
              s.sde_window_draw)
        return
    check(s.sde_window_size >= 1, "sampling.sde_window_size", ">= 1 or null", s.sde_window_size)
    check(s.trained_steps is None, "sampling.trained_steps", "null with sampling.sde_window_size (the window "
          "is what is trained)", s.trained_steps)
    if s.sde_window_range is None:
        s.sde_window_range = [0, s.num_steps - 1]
    into_zero = STEP_KINDS[s.step_kind].deterministic_into_zero
    last = s.num_steps - 1 if into_zero else s.num_steps
    r = s.sde_window_range
    ok = len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
    ok = ok and 0 <= r[0] and r[1] <= last and r[1] - r[0] >= s.sde_window_size
    check(ok, "sampling.sde_window_range", f"[lo, hi] (integers) with 0 <= lo, hi <= {last} (num_steps"
          f"{f' - 1: a {s.step_kind} step into t = 0 is deterministic' if into_zero else ''}) and "
          f"hi - lo >= sde_window_size={s.sde_window_size}", r)
    check(s.sde_window_schedule in ("random", "progressive"), "sampling.sde_window_schedule",
          "'random' or 'progressive'", s.sde_window_schedule)
    for name in ("sde_window_shift_every", "sde_window_stride"):
        check(getattr(s, name) >= 1, f"sampling.{name}", ">= 1", getattr(s, name))
    check(s.sde_window_draw in ("rollout", "group"), "sampling.sde_window_draw", "'rollout' or 'group'",
          s.sde_window_draw)
    check(s.sde_window_draw == "rollout" or (s.sde_window_size == 1 and s.sde_window_schedule == "random"),
          "sampling.sde_window_draw", "'rollout' unless sampling.sde_window_size is 1 and sde_window_schedule "
          "'random' (a step drawn per group: Flash-GRPO)", s.sde_window_draw)
