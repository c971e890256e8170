"""Prompts: a text file (one prompt a line) or an inline list, served as a Lightning datamodule.

The loader is resumable: Lightning saves its ``state_dict`` (epoch and batches consumed) in every
checkpoint, so a run resumed mid-epoch sees exactly the prompts it would have seen.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def read_prompts(path: str | Path) -> list[str]:
    """Non-empty, stripped lines of a UTF-8 text file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.prompts_file: no such file {str(path)!r}")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class PromptDataset(Dataset):
    """Item i is {"prompt": str, "index": i}; the index seeds that prompt's rollout noise."""

    def __init__(self, prompts: list[str]):
        self.prompts = list(prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict:
        return {"prompt": self.prompts[i], "index": i}


class EpochSampler(DistributedSampler):
    """Order of epoch e: a permutation seeded by (seed, e) (or 0..n-1), dealt round-robin to the ranks;
    it can resume mid-epoch.

    A ``DistributedSampler`` subclass that shards by itself, so Lightning keeps it under DDP instead of
    rebuilding the loader; every rank sees the same number of prompts (the tail is dropped), and the
    prompt indices -- which seed the rollout noise -- do not depend on the number of processes.
    """

    def __init__(self, size: int, shuffle: bool, seed: int):
        distributed = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
        if size < world:
            raise ValueError(f"data: {size} prompts cannot feed {world} processes")
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


class ResumablePromptLoader(DataLoader):
    """A DataLoader Lightning treats as stateful (it has ``state_dict`` / ``load_state_dict``).

    ``consumed`` counts the batches handed to ``training_step`` in the current epoch (the datamodule
    bumps it in ``on_before_batch_transfer``, which Lightning calls once per trained batch, after any
    prefetching), so the saved position is exact.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool, seed: int):
        self.epoch_sampler = EpochSampler(len(dataset), shuffle, seed)
        super().__init__(dataset, batch_size=batch_size, sampler=self.epoch_sampler,
                         drop_last=len(self.epoch_sampler) >= batch_size)
        self.consumed = 0

    def __iter__(self):
        if self.epoch_sampler.resume_at is None:
            self.consumed = 0
        return super().__iter__()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch_sampler.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch_sampler.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        # at an epoch's end the next iteration simply starts the next epoch
        self.epoch_sampler.resume_at = self.consumed * self.batch_size if self.consumed < len(self) else None


class PromptDataModule(L.LightningDataModule):
    """``batch_size`` prompts per training step; each prompt becomes one GRPO group of K samples.

    Give exactly one of ``prompts`` (inline list) or ``prompts_file`` (relative to the working directory).
    """

    def __init__(
        self,
        prompts: list[str] | None = None,
        prompts_file: str | None = None,
        batch_size: int = 2,
        shuffle: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        if (prompts is None) == (prompts_file is None):
            raise ValueError("data: give exactly one of data.prompts or data.prompts_file")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.prompts = list(prompts) if prompts is not None else read_prompts(prompts_file)
        if not self.prompts:
            raise ValueError("data: the prompt list must not be empty")
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self._loader: ResumablePromptLoader | None = None

    def train_dataloader(self) -> ResumablePromptLoader:
        self._loader = ResumablePromptLoader(PromptDataset(self.prompts), self.batch_size, self.shuffle, self.seed)
        return self._loader

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if self.trainer is not None and self.trainer.training and self._loader is not None:
            self._loader.consumed += 1
        return batch
