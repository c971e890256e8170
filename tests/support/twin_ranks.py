"""The video twins' distributed check, shared by the image-to-video, HunyuanVideo 1.5 and LTX-2 tests: each
``(twin, strategy)`` run trains one step on 2 gloo ranks, one prompt per rank (:func:`train_on_ranks`, in the rank
script), and its update must equal one process's on both prompts in one batch (:func:`assert_ranks_equal_one_process`,
in the test).

``make_module(twin)`` builds the twin's module (the same on every rank and in the test), ``prompts(twin)`` its two
prompts; ``image_to_video`` names the twins whose policy holds an image encoder (it stays frozen outside the
shards)."""

import lightning as L
import torch

from jagg_lightning.data import PromptDataModule

from helpers import rel_error


def weights_file(out, twin: str, kind: str, rank: int) -> str:
    return f"{out}/{twin}_{kind}_rank{rank}.safetensors"


def train_on_ranks(runs, make_module, prompts, out, image_to_video=frozenset()) -> None:
    """In each rank: every run's one step under DDP or FSDP2 (its LoRA really sharded, or not), the trained weights
    (gathered from the shards) saved per rank; then every rank leaves the process group together."""
    from lightning.pytorch.strategies import DDPStrategy
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    from jagg_lightning.distributed.collectives import end_process_group
    from jagg_lightning.strategies import FSDP2Strategy

    for twin, kind in runs:
        module = make_module(twin)
        strategy = (FSDP2Strategy(process_group_backend="gloo") if kind == "fsdp2" else
                    DDPStrategy(process_group_backend="gloo"))
        trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(module, PromptDataModule(prompts=prompts(twin), batch_size=1, shuffle=False))
        lora = module.policy.lora_parameters()
        assert lora and all(isinstance(p, DTensor) == (kind == "fsdp2") for p in lora)  # really sharded, or not
        encoder = getattr(module.policy, "image_encoder", None)  # an image-to-video policy's CLIP / SigLIP
        assert (encoder is not None) == (twin in image_to_video), twin
        assert encoder is None or not any(isinstance(p, DTensor) for p in encoder.parameters())
        weights = {n: (p.full_tensor() if kind == "fsdp2" else p).detach().contiguous()
                   for n, p in module.named_parameters() if p.requires_grad}
        save_file(weights, weights_file(out, twin, kind, trainer.global_rank))
    end_process_group()  # every rank finished: leave together (collectives.end_process_group)


def assert_ranks_equal_one_process(runs, make_module, prompts, out, tolerance: float = 1e-6) -> None:
    """Per twin: one process's step on both prompts (JAGG routed, a nonzero update), and each of its runs' ranks
    holding one and the same model whose update is that one within ``tolerance`` (float64; one prompt per rank vs two
    in one batch rounds differently where a model computes in float32: its time embedding, LTX-2's RoPE)."""
    from safetensors.torch import load_file

    for twin in dict.fromkeys(t for t, _ in runs):
        single = make_module(twin)
        initial = {n: p.detach().clone() for n, p in single.named_parameters() if p.requires_grad}
        L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(single, PromptDataModule(prompts=prompts(twin), batch_size=2,
                                                                            shuffle=False))
        assert any(r.routed for r in single.window_records)
        names = sorted(initial)
        update = [single.get_parameter(n).detach() - initial[n] for n in names]
        assert sum(float(u.abs().sum()) for u in update) > 0, twin
        for kind in [k for t, k in runs if t == twin]:
            ranks = [load_file(weights_file(out, twin, kind, r)) for r in (0, 1)]
            assert all(sorted(r) == names for r in ranks)
            assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in names), (twin, kind)  # one model on both ranks
            error = rel_error([ranks[0][n] - initial[n] for n in names], update)
            assert error < tolerance, (twin, kind, error)
