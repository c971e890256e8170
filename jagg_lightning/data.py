"""Prompts: a text file (one prompt a line) or an inline list, served as a Lightning datamodule."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


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
            raise ValueError("data: the prompt list is empty")
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            PromptDataset(self.prompts), batch_size=self.batch_size, shuffle=self.shuffle, generator=generator,
            drop_last=len(self.prompts) >= self.batch_size,
        )
