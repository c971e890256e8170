"""Non-finite values never reach the weights: the checks of an update and the skip / stop decision.

Every value an update is made of is checked where it arises, on each process, as device-side masks over the
rollout's samples (no host read until the optimizer step): the sampled latents (:meth:`NonFiniteGuard.check_rollout`;
their images are scored made finite, so the reward never sees a NaN pixel), the rewards
(:meth:`NonFiniteGuard.check_rewards`),
the advantages (:meth:`~NonFiniteGuard.check_advantages`), each trained step's per-sample losses
(:meth:`~NonFiniteGuard.check_loss`) and the gradient, this process's own before the all-reduce and the reduced
one after it (:func:`gradient_is_nonfinite`). An update is faulty when any of ITS samples (:meth:`~NonFiniteGuard.train`)
has a non-finite reward, advantage or loss, or its gradient is non-finite on any process.

At the optimizer step each process contributes one fixed-size row (:meth:`~NonFiniteGuard.fault_row`: the first
stage, what it was, how many samples, the first few by prompt and sample) to ONE all-reduce of a [world, row]
table; every process reads the same table, so all reach the same decision (:meth:`~NonFiniteGuard.decide`) and
the stop message can name another process's samples. A faulty update is skipped (the caller zeroes the
gradients and leaves weights, optimizer, EMA and scheduler as they were) and counted; ``max_in_a_row`` skipped
updates in a row raise :class:`NonFiniteError`, one line naming where the first of them appeared.
Plain torch, no Lightning.
"""

from __future__ import annotations

import torch
from torch import Tensor

STAGES = ("rollout", "reward", "advantages", "loss", "gradient")  # in the order an update makes them
_MASKED = len(STAGES) - 1  # the stages checked per sample (the gradient is checked per process)
SHOWN = 4  # samples a message names per process
_STAGE, _DETAIL, _NAN, _COUNT, _REDUCED, _SAMPLES = range(6)  # the row's fields; then SHOWN (prompt, sample) pairs
ROW = _SAMPLES + 2 * SHOWN


class NonFiniteError(RuntimeError):
    """Too many updates in a row were skipped for non-finite values; the message (one line) says where the first
    one's value appeared (stage, process, samples)."""


def gradient_is_nonfinite(params: list[torch.nn.Parameter]) -> Tensor:
    """True (a 0-d device tensor, not read back) when the gradient norm of ``params`` is not finite: a NaN or Inf
    element, or a norm that overflows. A DTensor gradient (FSDP2) is checked on this process's shard."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.bool, device=params[0].device if params else "cpu")
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in local]))
    return ~torch.isfinite(norm)


class NonFiniteGuard:
    """The checks of one process's updates and the run's counts (module docstring).

    ``skipped``: updates skipped over the run (``train/skipped_nonfinite``); ``in_a_row``: the current run of
    them; ``first``: where the first of that run appeared (the stop message names it)."""

    def __init__(self, max_in_a_row: int, group_size: int):
        self.max_in_a_row, self.group_size = max_in_a_row, group_size
        self.skipped, self.in_a_row, self.first = 0, 0, None
        self.start_rollout([], "cpu")

    def state_dict(self) -> dict:
        return {"skipped": self.skipped}  # a resumed run starts a fresh run of skips

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))

    # ------------------------------------------------------------------ the checks (device side, no host read)
    def start_rollout(self, prompt_indices: list[int], device) -> None:
        """A new rollout of ``group_size`` samples per prompt (prompt-major): empty masks."""
        n = len(prompt_indices) * self.group_size
        self.prompt_indices = list(prompt_indices)
        self.components: list[str] = []  # the reward's components, sorted: alike on every process
        self.bad = torch.zeros(_MASKED, n, dtype=torch.bool, device=device)  # rollout ... loss: non-finite
        self.nan = torch.zeros(_MASKED, n, dtype=torch.bool, device=device)  # ... and NaN among them
        self.component_bad: dict[str, Tensor] = {}
        self.trained = torch.zeros(n, dtype=torch.bool, device=device)  # the samples of the current update

    def _mark(self, stage: int, rows, values: Tensor) -> None:
        values = values.detach()
        self.bad[stage, rows] |= ~torch.isfinite(values)
        self.nan[stage, rows] |= torch.isnan(values)

    def check_rollout(self, rows: slice, final: Tensor) -> None:
        """The final latents [n, ...] of the rollout's ``rows`` (a NaN or Inf anywhere in a sample's)."""
        flat = final.detach().flatten(1)
        self.bad[0, rows] |= ~torch.isfinite(flat).all(1)
        self.nan[0, rows] |= torch.isnan(flat).any(1)

    def check_rewards(self, rows: slice, rewards: Tensor, components: dict[str, Tensor]) -> None:
        """The total rewards [n] of the rollout's ``rows`` and each component (monitors, outside the advantages,
        are not checked: a NaN there skips nothing)."""
        self._mark(1, rows, rewards)
        self.components = self.components or sorted(n for n in components if not n.startswith("monitor/"))
        for name, values in components.items():
            if not name.startswith("monitor/"):
                mask = self.component_bad.setdefault(name, torch.zeros_like(self.trained))
                mask[rows] |= ~torch.isfinite(values.detach())

    def check_advantages(self, rows: slice, advantages: Tensor) -> None:
        self._mark(2, rows, advantages)

    def check_loss(self, samples: Tensor, loss: Tensor) -> None:
        """Per-sample losses [n] of the rollout samples ``samples`` (indices [n]) at one trained step."""
        self._mark(3, samples, loss)

    def train(self, samples: Tensor | slice) -> None:
        """``samples`` (indices, or rows) belong to the current update."""
        self.trained[samples] = True

    # ------------------------------------------------------------------ the decision (one row per process)
    def fault_row(self, own_gradient_bad: Tensor, reduced_gradient_bad: Tensor) -> Tensor:
        """This process's row of the table: the first stage (1-based, 0: none) in the current update's samples,
        its detail (the reward component's index), whether a NaN is among them, how many samples, whether the
        reduced gradient is non-finite, and the first ``SHOWN`` samples as (prompt index, sample in its group);
        the update's own samples when no stage of this process is faulty. One host read."""
        flags = torch.stack([own_gradient_bad, reduced_gradient_bad]).to(self.bad.device)
        masks = torch.cat([self.bad & self.trained, self.nan & self.trained, self.trained[None],
                           *[m[None] & self.trained for m in self.component_bad.values()]])
        masks, (own_bad, reduced_bad) = masks.cpu(), flags.cpu().tolist()
        n = _MASKED
        bad, nan, trained, component = masks[:n], masks[n:2 * n], masks[2 * n], masks[2 * n + 1:]
        row = torch.full((ROW,), -1, dtype=torch.int64)
        row[_STAGE], row[_NAN], row[_REDUCED] = 0, 0, int(reduced_bad)
        samples = trained
        stages = [i for i in range(n) if bad[i].any()] + ([n] if own_bad else [])
        if stages:
            stage = stages[0]
            row[_STAGE] = stage + 1
            if stage < n:
                samples, row[_NAN] = bad[stage], int(nan[stage].any())
            if STAGES[stage] == "reward" and len(component):
                names = list(self.component_bad)
                hit = [names[i] for i in range(len(names)) if (component[i] & bad[stage]).any()]
                row[_DETAIL] = self.components.index(hit[0]) if hit and hit[0] in self.components else -1
        index = samples.nonzero().flatten()
        row[_COUNT] = len(index)
        for j, i in enumerate(index[:SHOWN].tolist()):
            row[_SAMPLES + 2 * j] = self.prompt_indices[i // self.group_size]
            row[_SAMPLES + 2 * j + 1] = i % self.group_size
        return row

    def all_reduce_and_decide(self, params: list[torch.nn.Parameter], collectives, step: int) -> str | None:
        """The optimizer step's part: check this process's own gradient (under DDP, until the all-reduce; FSDP2 has
        reduced it inside the backward), make the ONE gradient all-reduce (``collectives``), check the reduced one,
        gather every process's row (one more all-reduce) and :meth:`decide`, alike on every process. A skipped
        update's gradients are dropped (``None``: an optimizer step then moves no weight and no optimizer state)."""
        reduces_here = collectives.world_size == 1 or collectives.ddp_model() is not None
        own_bad = gradient_is_nonfinite(params) if reduces_here else None
        collectives.all_reduce_gradients(params)
        reduced_bad = gradient_is_nonfinite(params)
        row = self.fault_row(reduced_bad if own_bad is None else own_bad, reduced_bad)
        skipped = self.decide(collectives.gather_rows(row.to(self.trained.device)), step)  # raises to stop
        if skipped is not None:
            for p in params:
                p.grad = None
        return skipped

    def decide(self, table: Tensor, step: int) -> str | None:
        """From every process's row (the same table on each): None when the update may go ahead, else what was
        non-finite (the update is skipped and counted). Raises :class:`NonFiniteError` when this makes
        ``max_in_a_row`` skipped updates in a row. Ends the current update (its samples are cleared)."""
        self.trained.zero_()
        table = table.cpu()
        if not (table[:, _STAGE] > 0).any() and not (table[:, _REDUCED] > 0).any():
            self.in_a_row, self.first = 0, None
            return None
        self.skipped += 1
        self.in_a_row += 1
        where = self.describe(table)
        if self.first is None:
            self.first = f"step {step}: {where}"
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(
                f"{self.in_a_row} update(s) in a row skipped for non-finite values (grpo.max_nonfinite_in_a_row: "
                f"{self.max_in_a_row}); the first, at {self.first}")
        return (f"update at step {step} skipped ({self.in_a_row} in a row, {self.skipped} in all; "
                f"grpo.max_nonfinite_in_a_row: {self.max_in_a_row}): {where}")

    def describe(self, table: Tensor) -> str:
        """Where the value first appeared: the earliest stage any process reports, and each such process's samples."""
        world = table.shape[0]
        stages = table[:, _STAGE]
        if not (stages > 0).any():  # only the reduced gradient: every process's own was finite
            ranks = list(range(world))
            what = ("a non-finite gradient after the all-reduce (each process's own was finite: the sum overflowed, "
                    "or FSDP2 reduced it inside the backward)")
        else:
            first = int(stages[stages > 0].min())
            ranks = [r for r in range(world) if int(stages[r]) == first]
            stage = STAGES[first - 1]
            kind = "NaN" if any(int(table[r, _NAN]) for r in ranks) else "Inf"
            if stage == "rollout":
                what = f"non-finite sampled latents of the rollout ({kind})"  # before any reward
            elif stage == "reward":
                detail = int(table[ranks[0], _DETAIL])
                name = f"reward {self.components[detail]}" if 0 <= detail < len(self.components) else "reward"
                what = f"non-finite {name} ({kind})"
            elif stage == "gradient":
                what = "a non-finite gradient (the rewards, advantages and losses were finite)"
            else:
                what = f"non-finite {'advantages' if stage == 'advantages' else 'per-sample loss'} ({kind})"
        parts = []
        for r in ranks:
            count = int(table[r, _COUNT])
            named = [f"prompt {int(table[r, _SAMPLES + 2 * j])} sample {int(table[r, _SAMPLES + 2 * j + 1])}"
                     for j in range(min(count, SHOWN))]
            more = f" and {count - SHOWN} more" if count > SHOWN else ""
            who = f"rank {r}: " if world > 1 else ""
            parts.append(f"{who}{', '.join(named)}{more} ({count} sample{'s' if count != 1 else ''})")
        return f"{what} in {'; '.join(parts)}"
