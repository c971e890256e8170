"""A checkpoint written by the code before the redesign (issue 17) resumes with today's code as the
uninterrupted old run continued (tests/fixtures/pre_redesign, made by its make_fixture.py at the commit in
``expected.safetensors``' metadata): LoRA weights, their EMA and the AdamW moments after two more steps.

float64 throughout. Where today's code computes the first two steps exactly as the old code did (same CPU kernels,
same summation order: re-running them reproduces the checkpoint's weights bit for bit) the comparison is bit for
bit -- it was, on the machine that wrote the fixture, for the redesign commit. Elsewhere it is to 1e-9 relative:
another CPU's kernels, or a deliberate change of float summation order (since then the training micro-batches keep
the rollout's row order, which moves float64 sums by ulps), stay far below that, while any change of behaviour
moves the weights by ~1e-2 a step (lr 1e-2)."""

import sys
from pathlib import Path

import lightning as L
import torch
from safetensors import safe_open
from safetensors.torch import load_file

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "pre_redesign"
sys.path.insert(0, str(FIXTURE))
import make_fixture as fx  # noqa: E402


def test_pre_redesign_checkpoint_resumes_as_the_old_run_continued(tmp_path):
    ckpt = torch.load(FIXTURE / "step2.ckpt", weights_only=True)
    expected = load_file(FIXTURE / "expected.safetensors")
    with safe_open(FIXTURE / "expected.safetensors", "pt") as f:
        meta = f.metadata()
    assert int(meta["final_step"]) == fx.FINAL_STEP and ckpt["global_step"] == fx.CHECKPOINT_STEP

    # today's code, uninterrupted to the checkpoint's step: does this CPU round like the fixture's?
    L.seed_everything(fx.SEED)
    again = fx.build_module()
    fx.trainer(tmp_path / "again", fx.CHECKPOINT_STEP, False).fit(again, fx.data())
    same_kernels = all(torch.equal(again.get_parameter(n).detach(), w) for n, w in ckpt["state_dict"].items())

    resumed = fx.build_module()  # fresh frozen weights (same seed); LoRA, EMA, AdamW, RNG from the checkpoint
    trainer = fx.trainer(tmp_path / "resumed", fx.FINAL_STEP, False)
    trainer.fit(resumed, fx.data(), ckpt_path=str(FIXTURE / "step2.ckpt"))
    got = fx.final_state(resumed, trainer)
    assert set(got) == set(expected) and any(k.startswith("adam/") for k in got) and any(k.startswith("ema/") for k in got)
    moved = max(float((expected[f"lora/{n}"] - w).abs().max()) for n, w in ckpt["state_dict"].items())
    assert moved > 1e-4  # the two resumed steps really trained
    for name, want in expected.items():
        if same_kernels:
            assert torch.equal(got[name], want), name
        else:
            assert float((got[name] - want).abs().max()) <= 1e-9 * float(want.abs().max()) + 1e-300, name
