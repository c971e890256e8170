"""Rank script of tests/distributed/test_failed_sharded_write.py: ``python write_fault_ranks.py MODE OUT SEED``.

``fail``: FSDP2 full fine-tuning with a distributed checkpoint after every step; after step 2 rank 1 alone gets a
file size limit below its shard's size (a real EFBIG, as its disk filling would), so step 2's checkpoint fails on
rank 1 part-way. Rank 0 records a digest of the checkpoint folder first. Every rank prints the error it got.
``resume``: one process loads the step-1 checkpoint the failure left and trains one step on from it."""

import json
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from full_ft_ranks import build, fit, fsdp
from write_faults import digests, limit_file_size


class FailRankOneAt(L.Callback):
    def __init__(self, step, folder):
        self.step, self.folder = step, Path(folder)

    def on_train_batch_end(self, trainer, module, *args):
        if trainer.global_step != self.step:
            return
        if trainer.global_rank == 0:
            (self.folder.parent / "record.json").write_text(json.dumps(digests(self.folder)))
        trainer.strategy.barrier()
        if trainer.global_rank == 1:
            limit_file_size(min(p.stat().st_size for p in self.folder.rglob("__1_*.distcp")) // 2)


class Start(L.Callback):
    def on_train_start(self, trainer, module):
        print(f"start step {trainer.global_step}")


def main(mode, out, seed):
    folder = f"{out}/ckpt"
    if mode == "fail":
        checkpoint = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=1, save_top_k=1,
                                     save_last=True)
        try:
            fit(build(seed), fsdp(save_distributed_checkpoint=True), 3,
                callbacks=[checkpoint, FailRankOneAt(2, folder)])
        except Exception as err:
            print(f"{type(err).__name__}: {err}")
    else:
        fit(build(seed), fsdp(save_distributed_checkpoint=True), 2, devices=1, batch_size=2,
            ckpt_path=f"{folder}/step=1.ckpt", callbacks=[Start()])
        print("resumed ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
