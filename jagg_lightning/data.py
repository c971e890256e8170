"""Prompts: a text file (one prompt a line) or an inline list, served as a Lightning datamodule.

The data contract (for your own DataLoader): every batch is ``{"prompt": [str, ...], "index": [int, ...]}``
-- what a default-collated DataLoader over :class:`PromptDataset` yields. The index seeds the prompt's
rollout noise, so it must identify the prompt (not its position in the batch). A batch of plain strings
(a DataLoader over a list of prompts) or ``{"prompt": [...]}`` without indices is accepted too: each prompt's
index is then :func:`prompt_index` of its text, which survives shuffling, resuming, batch size and the number
of processes. Validation and predict loaders follow the same contract. A conditioned prompt (image editing,
image-to-video: :class:`jagg_lightning.models.conditions.ConditionedPrompt`, a ``str`` carrying its condition images, what a
``.jsonl`` data file or dataset folder gives) travels the same way, its images with it.

The loader is resumable: Lightning saves its ``state_dict`` (epoch and batches consumed) in every
checkpoint, so a run resumed mid-epoch sees exactly the prompts it would have seen.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Callable

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from jagg_lightning.models.conditions import ConditionedPrompt, metadata_of, repeated_per_task


def read_prompts(path: str | Path, field: str = "data.prompts_file", split: str = "train") -> list[str]:
    """Non-empty, stripped lines of a UTF-8 text file (a shipped name such as ``digits_heldout``, a path from the
    working directory or from the package's directory: :mod:`jagg_lightning.utils.assets`); a ``.jsonl`` file or a
    dataset folder: conditioned prompts (:func:`jagg_lightning.models.conditions.read_conditioned_prompts`, its ``split``'s
    ``<split>_metadata.jsonl`` in a folder)."""
    from jagg_lightning.models.conditions import read_conditioned_prompts
    from jagg_lightning.utils.assets import find_local, resolve_path

    found = find_local(path)
    if found is not None and (found.is_dir() or found.suffix == ".jsonl"):
        return read_conditioned_prompts(found, field, split)
    path = Path(resolve_path(path, field, kind="file"))
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# `jagg fit` with no data section: a few prompts so the bare command runs (configs/prompts/ has more)
DEFAULT_PROMPTS = ["a cat sitting on a mat", "a lighthouse at night", "a bowl of fruit on a table", "a red bicycle"]


def tags_of(prompts) -> list[str]:
    """Each prompt's GenEval task (its metadata's ``tag``; '' for a prompt without one)."""
    return [metadata_of(p).get("tag", "") for p in prompts]


def check_prompts(prompts, field: str) -> list[str]:
    """A list of non-blank strings; a bare string (which would become one prompt per character) is refused."""
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise ValueError(f"{field} must be a list of strings, got {type(prompts).__name__} {prompts!r}"
                         + (" (use data.prompts_file for a file)" if isinstance(prompts, str) else ""))
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"{field}[{i}] must be a non-blank string, got {p!r}")
    if not prompts:
        raise ValueError(f"{field}: the prompt list must not be empty")
    return [p if isinstance(p, ConditionedPrompt) else p.strip() for p in prompts]  # a conditioned one is stripped


def prompt_index(prompt: str) -> int:
    """The index of a prompt given without one: the first 4 bytes of the SHA-256 of its UTF-8 text, little-endian,
    shifted right by one (an int in [0, 2**31)). It depends on the text alone -- not on the order a shuffle deals
    the prompts, the batch, the process, or how far a resumed loader had got -- so a prompt draws the same noise at
    a given step in every run (a position in the epoch would change with each shuffle, and a plain DataLoader does
    not restore its position on resume). Two identical prompts share it (and so their noise at a step)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") >> 1


def unpack_prompt_batch(batch) -> tuple[list[str], list[int]]:
    """The data contract: a batch is ``{"prompt": [str, ...], "index": [int, ...]}`` (what a DataLoader over
    :class:`jagg_lightning.data.PromptDataset` yields); the index seeds that prompt's noise. Plain strings (a
    list, a tuple or one ``str``) or ``{"prompt": [...]}`` alone take :func:`prompt_index` of each text."""
    if isinstance(batch, str):
        batch = [batch]
    if isinstance(batch, (list, tuple)) and batch and all(isinstance(p, str) for p in batch):
        batch = {"prompt": list(batch)}
    if isinstance(batch, dict) and "prompt" in batch and "index" not in batch:
        prompts = [batch["prompt"]] if isinstance(batch["prompt"], str) else list(batch["prompt"])
        if not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"a batch's prompts must be strings, got {[type(p).__name__ for p in prompts]}")
        batch = {"prompt": prompts, "index": [prompt_index(p) for p in prompts]}
    if not (isinstance(batch, dict) and "prompt" in batch and "index" in batch):
        raise TypeError(
            f"JAGGModule batches must be prompt strings or dicts {{'prompt': [str], 'index': [int]}} (each prompt's "
            f"index seeds its noise), got {type(batch).__name__}: wrap your prompts in "
            "jagg_lightning.data.PromptDataset(prompts) or use PromptDataModule"
        )
    prompts, indices = list(batch["prompt"]), [int(i) for i in batch["index"]]
    if len(prompts) != len(indices) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"a batch needs one str prompt per index, got {len(prompts)} prompts, {len(indices)} indices")
    return prompts, indices


class PromptDataset(Dataset):
    """Item i is {"prompt": str, "index": i}; the index seeds that prompt's rollout noise."""

    def __init__(self, prompts: list[str]):
        self.prompts = list(prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict:
        return {"prompt": self.prompts[i], "index": i}


def data_ranks(trainer=None) -> tuple[int, int]:
    """(data-parallel processes, this one's index): the strategy's ``distributed_sampler_kwargs`` (under context
    parallelism the context ranks of one data rank share it, so they draw the same prompts), else every process."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
    if kwargs:
        return int(kwargs["num_replicas"]), int(kwargs["rank"])
    distributed = dist.is_available() and dist.is_initialized()
    return (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)


class EpochSampler(DistributedSampler):
    """Order of epoch e: a permutation seeded by (seed, e) (or 0..n-1), dealt round-robin to the ranks;
    it can resume mid-epoch.

    A ``DistributedSampler`` subclass that shards by itself, so Lightning keeps it under DDP instead of
    rebuilding the loader; every rank sees the same number of prompts (the tail is dropped), and the
    prompt indices -- which seed the rollout noise -- do not depend on the number of processes.
    """

    def __init__(self, size: int, shuffle: bool, seed: int, replicas: tuple[int, int] | None = None):
        world, rank = replicas or data_ranks()
        if size < world:
            raise ValueError(f"data: {size} prompts cannot feed {world} data-parallel processes")
        self.size = size
        super().__init__(range(size), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.epoch = -1  # the epoch of the last iteration started
        self.resume_at: int | None = None  # items of this rank to skip when resuming inside ``epoch``

    def __iter__(self):
        if self.resume_at is None:
            self.epoch += 1
            skip = 0
        else:
            skip, self.resume_at = self.resume_at, None
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch))
        else:
            order = torch.arange(self.size)
        mine = order[: self.num_samples * self.num_replicas][self.rank :: self.num_replicas]
        yield from mine[skip:].tolist()

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this each epoch; the epoch is counted by the iterations themselves."""


class EvalSampler(DistributedSampler):
    """Evaluation order: rank r takes prompts r, r + world, ... -- every prompt exactly once over all processes
    (a plain DistributedSampler pads with repeats, which would bias the means). A DistributedSampler subclass,
    so Lightning keeps it under DDP."""

    def __init__(self, size: int, replicas: tuple[int, int] | None = None):
        world, rank = replicas or data_ranks()
        if size < world:
            raise ValueError(f"data: {size} evaluation prompts cannot feed {world} data-parallel processes")
        super().__init__(range(size), num_replicas=world, rank=rank, shuffle=False)
        self.mine = list(range(rank, size, world))

    def __iter__(self):
        return iter(self.mine)

    def __len__(self) -> int:
        return len(self.mine)


class ResumablePromptLoader(DataLoader):
    """A DataLoader Lightning treats as stateful (it has ``state_dict`` / ``load_state_dict``).

    ``consumed`` counts the batches handed to ``training_step`` in the current epoch (the datamodule
    bumps it in ``on_before_batch_transfer``, which Lightning calls once per trained batch, after any
    prefetching), so the saved position is exact.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool, seed: int,
                 replicas: tuple[int, int] | None = None):
        self.epoch_sampler = EpochSampler(len(dataset), shuffle, seed, replicas)
        super().__init__(dataset, batch_size=batch_size, sampler=self.epoch_sampler,
                         drop_last=len(self.epoch_sampler) >= batch_size)
        self.consumed = 0
        # batches handed out whose training step did not finish (the datamodule asks the trainer): 1 in a checkpoint
        # written on an exception inside a step (OnExceptionCheckpoint), so its prompts are trained again on resume
        self.unfinished_batches: Callable[[], int] = lambda: 0

    def __iter__(self):
        if self.epoch_sampler.resume_at is None:
            if 0 < self.consumed < len(self):
                # the last iterator was left part-way (Lightning, resumed from a checkpoint written at an epoch's
                # end, runs one more batch in the finished epoch and then starts a new iterator): continue this
                # epoch's order, so the prompts follow each other exactly as in the uninterrupted run
                self.epoch_sampler.resume_at = self.consumed * self.batch_size
            else:
                self.consumed = 0
        return super().__iter__()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch_sampler.epoch, "consumed": self.consumed - self.unfinished_batches()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch_sampler.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        # at an epoch's end the next iteration simply starts the next epoch
        self.epoch_sampler.resume_at = self.consumed * self.batch_size if self.consumed < len(self) else None


class PromptDataModule(L.LightningDataModule):
    """Prompts: the training prompts, and the held-out prompts of validate, test and predict.

    Each training step takes `batch_size` prompts; each prompt becomes one GRPO group of K samples
    (`sampling.group_size`). Of each kind of prompts give at most one: a list or a file.

    Args:
        prompts: Training prompts, a list of non-blank strings (a bare string is refused, not read as one prompt
            per character); neither this nor `prompts_file` = `DEFAULT_PROMPTS`.
        prompts_file: Training prompts from a file: UTF-8, one prompt a line (relative to the working directory,
            or a shipped name: `digits_train`, `digits_heldout`, `scenes_train`, `scenes_heldout`), a `.jsonl` file
            (conditioned prompts, or GenEval metadata rows) or a dataset folder of conditioned prompts
            (docs/configuration.md).
        batch_size: Prompts per training step (each becomes a group), an integer >= 1.
        shuffle: Shuffle the training prompts every epoch (the order seeded per epoch by `seed`).
        seed: The seed of the prompts' epoch order (nothing of the algorithm draws from it: that is `model.seed`).
        val_prompts: Held-out prompts for `jagg validate` / `jagg test` and `trainer.val_check_interval`, a list as
            `prompts`; none (nor `val_prompts_file`) = no validation.
        val_prompts_file: Held-out prompts from a file, as `prompts_file` (a dataset folder: its test split).
        predict_prompts: The prompts `jagg predict` draws, a list as `prompts`; none (nor `predict_prompts_file`) =
            the validation prompts.
        predict_prompts_file: The prompts `jagg predict` draws, from a file as `prompts_file`.
        eval_batch_size: Prompts per validation / test / predict batch, an integer >= 1.
        balance_tasks: GenEval metadata prompts only: repeat each task's training rows so every task has about as
            many as the largest (`models.conditions.repeated_per_task`), so a batch draws the six tasks alike
            (the scenes train rows are 252 colour-binding rows of 332; docs/testbed.md).
    """

    def __init__(
        self,
        prompts: list[str] | str | None = None,  # a str is refused with a message, not parsed as characters
        prompts_file: str | None = None,
        batch_size: int = 2,
        shuffle: bool = True,
        seed: int = 0,
        val_prompts: list[str] | str | None = None,
        val_prompts_file: str | None = None,
        predict_prompts: list[str] | str | None = None,
        predict_prompts_file: str | None = None,
        eval_batch_size: int = 4,
        balance_tasks: bool = False,
    ):
        super().__init__()
        self.prompts, self.val_prompts, self.predict_prompts = self.check_arguments(
            prompts, prompts_file, batch_size, shuffle, seed, val_prompts, val_prompts_file, predict_prompts,
            predict_prompts_file, eval_batch_size, balance_tasks)
        if balance_tasks:
            self.prompts = repeated_per_task(self.prompts, max(Counter(tags_of(self.prompts)).values()))
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.eval_batch_size = eval_batch_size
        self._loader: ResumablePromptLoader | None = None
        if self.val_prompts is None:  # Lightning then sees no validation loader at all (no empty-loader warnings)
            self.val_dataloader = L.LightningDataModule.val_dataloader.__get__(self)
            self.test_dataloader = L.LightningDataModule.test_dataloader.__get__(self)

    @classmethod
    def check_arguments(cls, prompts=None, prompts_file=None, batch_size=2, shuffle=True, seed=0, val_prompts=None,
                        val_prompts_file=None, predict_prompts=None, predict_prompts_file=None, eval_batch_size=4,
                        balance_tasks=False):
        """Every argument checked (the CLI calls this before it builds any model): (train, val, predict) prompts."""
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{name} must be an integer >= 1, got {value!r}")
        train = cls._prompts(prompts, prompts_file, "prompts") or list(DEFAULT_PROMPTS)
        if balance_tasks and "" in tags_of(train):
            raise ValueError("data.balance_tasks: true needs GenEval metadata prompts (every row a `tag`, e.g. "
                             "prompts_file: scenes_train); these training prompts name no task")
        return (train, cls._prompts(val_prompts, val_prompts_file, "val_prompts"),
                cls._prompts(predict_prompts, predict_prompts_file, "predict_prompts"))

    @staticmethod
    def _prompts(inline, file, field: str) -> list[str] | None:
        if inline is not None and file is not None:
            raise ValueError(f"data: give at most one of data.{field} or data.{field}_file")
        if inline is not None:
            return check_prompts(inline, f"data.{field}")
        if file is not None:
            split = "train" if field == "prompts" else "test"  # a dataset folder's file for each
            return check_prompts(read_prompts(file, f"data.{field}_file", split), f"data.{field}_file")
        return None

    def train_dataloader(self) -> ResumablePromptLoader:
        self._loader = ResumablePromptLoader(PromptDataset(self.prompts), self.batch_size, self.shuffle, self.seed,
                                             data_ranks(self.trainer))
        if self.trainer is not None:
            self._loader.unfinished_batches = self._unfinished_batches
        return self._loader

    def _eval_loader(self, prompts: list[str]) -> DataLoader:
        sampler = EvalSampler(len(prompts), data_ranks(self.trainer))
        return DataLoader(PromptDataset(prompts), batch_size=self.eval_batch_size, sampler=sampler)

    def val_dataloader(self):
        return self._eval_loader(self.val_prompts)

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_dataloader(self):
        prompts = self.predict_prompts or self.val_prompts
        if prompts is None:
            raise ValueError("data: jagg predict needs data.predict_prompts (or data.val_prompts)")
        return self._eval_loader(prompts)

    def _unfinished_batches(self) -> int:
        """Batches of this epoch handed out (``ready``) minus those whose training step returned (``processed``)."""
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return max(progress.ready - progress.processed, 0)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if self.trainer is not None and self.trainer.training and self._loader is not None:
            self._loader.consumed += 1
        return batch
