"""Real write faults for tests/training/test_failed_writes.py: a file size limit (``RLIMIT_FSIZE``, SIGXFSZ
ignored), under which a write past N bytes fails with EFBIG the way a write to a full disk fails with ENOSPC.

- :class:`LimitFileSizeAt`: a callback that, after training step ``step`` and before that step's checkpoint is
  saved (Lightning runs checkpoint callbacks last), records a digest of every file under ``watch`` and sets the
  limit between the adapter's and the checkpoint's sizes (``fail: checkpoint``: the adapter export still fits,
  the checkpoint does not) or below the adapter's (``fail: adapter``);
- ``python write_faults.py <kind> <dir> <seed> <limit>``: one write (kind: checkpoint | adapter | full_export)
  under the limit, in a process of its own; prints the error's message as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import sys
from pathlib import Path

import lightning as L
import torch


def limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def digests(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root`` (a symlink: "-> its target")."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class LimitFileSizeAt(L.Callback):
    def __init__(self, step: int, watch: str, record: str, fail: str = "checkpoint"):
        super().__init__()
        self.step, self.watch, self.record, self.fail = step, Path(watch), Path(record), fail

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        adapter = max(p.stat().st_size for p in self.watch.rglob("*.safetensors"))
        checkpoint = min(p.stat().st_size for p in self.watch.rglob("*.ckpt") if not p.is_symlink())
        assert adapter < checkpoint, (adapter, checkpoint)
        limit = (adapter + checkpoint) // 2 if self.fail == "checkpoint" else adapter // 2
        self.record.write_text(json.dumps({"digests": digests(self.watch), "limit": limit}))
        limit_file_size(limit)


class RecordStart(L.Callback):
    """Writes the global step training starts from (a resumed run: the checkpoint's)."""

    def __init__(self, record: str):
        super().__init__()
        self.record = Path(record)

    def on_train_start(self, trainer, pl_module) -> None:
        self.record.write_text(str(trainer.global_step))


def tiny_lora_policy(seed: int):
    from helpers import randomize_lora_b, tiny_policy_config

    from jagg_lightning.policies.sd3 import SD3Policy

    policy = SD3Policy(tiny_policy_config(seed=seed))
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    return policy


def tiny_full_policy(seed: int):
    from jagg_lightning.policies import PolicyConfig
    from jagg_lightning.policies.sd3 import SD3Policy

    policy = SD3Policy(PolicyConfig(trainable="full", guidance_scale=1.0, max_sequence_length=4, seed=seed))
    with torch.no_grad():
        for p in policy.transformer.parameters():
            p.add_(torch.randn_like(p), alpha=0.01)
    return policy


def checkpoint_of(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"global_step": seed, "state_dict": {f"w{i}": torch.randn(64, 64, generator=generator) for i in range(8)}}


def build(kind: str, seed: int):
    return {"checkpoint": checkpoint_of, "adapter": tiny_lora_policy, "full_export": tiny_full_policy}[kind](seed)


def write(kind: str, what, target: Path, step: int) -> None:
    """One write of ``what`` (:func:`build`) to ``target`` the way training writes it."""
    if kind == "checkpoint":
        from jagg_lightning.callbacks import AtomicCheckpointIO

        AtomicCheckpointIO().save_checkpoint(what, target)
    elif kind == "adapter":
        from jagg_lightning.models.adapters import save_adapter

        save_adapter(what, target, step=step)
    else:
        from jagg_lightning.models.export import save_transformer

        save_transformer(what, target, step=step, max_shard_size=40_000)  # sharded: several files


if __name__ == "__main__":
    kind, target, seed, limit = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    what = build(kind, seed)  # before the limit: only the write is to fail
    limit_file_size(limit)
    try:
        write(kind, what, target, seed)
    except Exception as err:
        print(json.dumps({"type": type(err).__name__, "message": str(err)}))
        raise SystemExit(3)
    print(json.dumps({"type": None}))
