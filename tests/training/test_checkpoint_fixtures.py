"""Checkpoints written by earlier code resume with today's code as the uninterrupted old run continued: the trained
weights, their EMA and the AdamW moments after two more steps (tests/fixtures/<name>/, each made by its
make_fixture.py at the commit in ``expected.safetensors``' metadata).

* ``pre_redesign``: a LoRA run (KL, EMA, scheduler) from before the redesign of issue 17;
* ``before_shape_pass/lora``: the fused mode with chained windows (KL, EMA, scheduler), from before issue 27;
* ``before_shape_pass/full``: a full fine-tune with its frozen KL reference and the control variate (EMA,
  scheduler), from before issue 27.

float64 policies, but the fixtures' code computed the advantages in float32 (the reward's dtype; today's code: in
float64, ``Sampler.scored``), so the test re-runs them with the old code's float32 advantages
(:func:`float32_advantages`): today's float64 advantages differ by float32's rounding, which AdamW's sign-like steps
magnify to 3e-5 to 5e-4 relative after two steps (measured), near what a changed behaviour does. And float32 sums
round by the CPU's vector width: on another CPU than the fixture's the run drifts by ~1e-6 to 1e-4 relative after
two steps (AdamW's second step divides two gradients, so it magnifies the advantages' rounding; measured on an
AVX-512 machine against a fixture written elsewhere: 5.6e-6 at step 2, 2.7e-6 at step 4; on another,
``before_shape_pass/full``: 9.4e-5). So the test first re-runs the old run's first two steps with today's code and
measures how far this CPU is from the fixture's, ``drift`` (relative, worst weight):

* ``drift`` 0 (same kernels, same summation order): the resumed run must match bit for bit;
* else ``drift`` must be small (<= 3e-4, ``DRIFT_BOUND``: today's code trains those steps as the old code did -- a
  change of behaviour moves the weights by 1e-3 to 1e-1, measured by changing one reward by one JPEG byte; the bound
  sits 3x under that and 3x over the largest CPU drift measured, 9.4e-5, which a bound of 1e-4 nearly met) and the resumed
  run must match to max(1e-9, 20 drift) relative: a resume that restores something wrongly (RNG, EMA, optimizer,
  scheduler, the rollout counter) moves them by as much as a changed behaviour does."""

import importlib.util
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from jagg_lightning.training.update import Updater

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DRIFT_BOUND = 3e-4  # another CPU's float32 rounding (<= 9.4e-5 measured) < this < a change of behaviour (>= 1e-3)


def fixture_module(folder: str):
    spec = importlib.util.spec_from_file_location(f"make_fixture_{folder.replace('/', '_')}",
                                                  FIXTURES / folder / "make_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = {  # fixture folder -> (its make_fixture.py folder, the run's name in it or None, prefix of the weights)
    "pre_redesign": ("pre_redesign", None, "lora/"),
    "before_shape_pass/lora": ("before_shape_pass", "lora", "weight/"),
    "before_shape_pass/full": ("before_shape_pass", "full", "weight/"),
}


@pytest.fixture
def float32_advantages(monkeypatch):
    """The fixtures' code's advantages: computed from float32 rewards (today's: from the rewards in float64, a float64
    run's compute dtype). The rewards are float32 values either way (every reward scores in float32), so the cast
    back is exact and the advantages are the old code's bit for bit."""
    advantages = Updater.reward_advantages

    def from_float32_rewards(self, rewards, components, *args, **kwargs):
        assert rewards.dtype == torch.float64  # else the fixtures' runs are not today's float64 runs
        return advantages(self, rewards.float(), {n: c.float() for n, c in components.items()}, *args, **kwargs)

    monkeypatch.setattr(Updater, "reward_advantages", from_float32_rewards)


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_old_checkpoint_resumes_as_the_old_run_continued(case, tmp_path, float32_advantages):
    folder, run, prefix = CASES[case]
    fx = fixture_module(folder)
    build = (lambda: fx.build_module()) if run is None else (lambda: fx.build_module(run))
    ckpt = torch.load(FIXTURES / case / "step2.ckpt", weights_only=True)
    expected = load_file(FIXTURES / case / "expected.safetensors")
    with safe_open(FIXTURES / case / "expected.safetensors", "pt") as f:
        meta = f.metadata()
    assert int(meta["final_step"]) == fx.FINAL_STEP and ckpt["global_step"] == fx.CHECKPOINT_STEP

    # today's code, uninterrupted to the checkpoint's step: does this CPU round like the fixture's?
    L.seed_everything(fx.SEED)
    again = build()
    fx.trainer(tmp_path / "again", fx.CHECKPOINT_STEP, False).fit(again, fx.data())
    drift = max(float((again.get_parameter(n).detach() - w).abs().max() / w.abs().max())
                for n, w in ckpt["state_dict"].items())
    assert drift <= DRIFT_BOUND, (f"today's code trains the fixture's first {fx.CHECKPOINT_STEP} steps {drift:.2e} "
                                  "(relative) away from the old code: more than another CPU's float32 rounding explains")

    resumed = build()  # fresh frozen weights (same seed); trained weights, EMA, AdamW, RNG from the checkpoint
    trainer = fx.trainer(tmp_path / "resumed", fx.FINAL_STEP, False)
    trainer.fit(resumed, fx.data(), ckpt_path=str(FIXTURES / case / "step2.ckpt"))
    got = fx.final_state(resumed, trainer)
    assert set(got) == set(expected) and any(k.startswith("adam/") for k in got) and any(k.startswith("ema/") for k in got)
    moved = max(float((expected[prefix + n] - w).abs().max()) for n, w in ckpt["state_dict"].items())
    assert moved > 1e-5  # the two resumed steps really trained
    tolerance = max(1e-9, 20 * drift)
    print(f"drift {drift:.3e}")
    for name, want in expected.items():
        if drift == 0:
            assert torch.equal(got[name], want), name
        else:
            error = float((got[name] - want).abs().max()) / max(float(want.abs().max()), 1e-300)
            assert error <= tolerance, f"{name}: {error:.2e} relative (drift at the checkpoint {drift:.2e})"
