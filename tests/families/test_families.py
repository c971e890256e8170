"""Every model family on its tiny offline twin: detection, round trip, schedule, exact first update,
GRPO/JAGG gradients against hand-written references, and `jagg fit` writing an adapter the family's
own pipeline loads. The twins are saved once per session and loaded through ``from_pretrained``."""

from contextlib import contextmanager
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from peft import PeftModel

from jagg_lightning.cli import cli_main
from jagg_lightning.data import PromptDataModule
from jagg_lightning.policies import build_policy, detect_family

from family_cases import CASES, PROMPTS, TRAINING_CASES, module_for, tiny_fit_args
from helpers import (MeanIntensity, checkpointed_gradient_error, handwritten_update_error, nonzero_advantages,
                     randomize_lora_b)
from plan_checks import assert_folder_plans_as_twin

ROOT = Path(__file__).resolve().parents[2]
by_case = pytest.mark.parametrize("case", CASES, ids=str)
by_training_case = pytest.mark.parametrize("case", TRAINING_CASES, ids=str)


@pytest.fixture(scope="session")
def twin_dirs(tmp_path_factory):
    """Each family's tiny twin (seed 0, float32), saved once with ``save_pretrained``."""
    root = tmp_path_factory.mktemp("twins")
    dirs = {}
    for case in CASES:
        dirs[case.name] = root / case.name
        case.build(0, torch.float32).save_pretrained(dirs[case.name])
    return dirs


def fit(module, prompts=PROMPTS, steps=1):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=prompts, batch_size=2, shuffle=False))
    return trainer


@by_case
def test_detection_picks_the_family_class(case, twin_dirs):
    config = case.config(pretrained=str(twin_dirs[case.name]))
    assert detect_family(config).name == case.family
    policy = build_policy(config)
    assert type(policy).__name__ == case.policy_class and policy.family == case.family
    assert policy.pipeline_class.__name__ == type(case.build(0, torch.float32)).__name__


@pytest.mark.parametrize("case", [c for c in CASES if c.family == "z_image"], ids=str)
def test_jagg_plan_reads_the_saved_twin_as_the_twin(case, twin_dirs):
    """`jagg plan` on the saved folder (its JSON files only) plans what the twin on meta plans (the families planned
    from local folders before issue 56 are read the same way; their presets plan from shipped configs)."""
    assert_folder_plans_as_twin(case.family, twin_dirs[case.name], (32, 32), **case.overrides)


@by_case
def test_twin_roundtrips_through_from_pretrained(case, twin_dirs, rng_seed):
    seed = rng_seed % 10_000
    config = case.config(seed=seed, guidance_scale=case.guidance[1], family=case.family)
    built = build_policy(config, pipeline=case.build(0, torch.float32))
    loaded = build_policy(case.config(seed=seed, guidance_scale=case.guidance[1], pretrained=str(twin_dirs[case.name])))
    for policy in (built, loaded):
        randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    z, t = torch.randn(2, *built.latent_shape, generator=gen), torch.rand(2, generator=gen)
    with torch.no_grad():
        v_built = built.velocity(z, t, built.encode_prompts(case.prompts))
        v_loaded = loaded.velocity(z, t, loaded.encode_prompts(case.prompts))
    assert v_built.shape == z.shape and v_built.abs().sum() > 0
    assert torch.equal(v_built, v_loaded)
    assert built.resolution == loaded.resolution and torch.equal(built.schedule(6), loaded.schedule(6))


# a non-square size: height != width, neither the twin's native 32 px (each side a multiple of every twin's 4)
TALL = [48, 32]
WIDE = [32, 48]


@by_case
@pytest.mark.parametrize("num_steps", [3, 8])
@pytest.mark.parametrize("resolution", [None, 64, [32, 64]], ids=["native", "64px", "32x64"])
def test_schedule_equals_the_family_pipeline(case, twin_dirs, num_steps, resolution):
    """The times the engine samples at are the sigmas the family pipeline's own __call__ sets, at the twin's
    native 32 px, at 64 px and at 32 x 64 (FLUX: another image sequence length, so another dynamic-shift mu)."""
    policy = build_policy(case.config(pretrained=str(twin_dirs[case.name]), resolution=resolution))
    expected = (32, 32) if resolution is None else (64, 64) if resolution == 64 else tuple(resolution)
    assert policy.resolution == expected
    height, width = policy.resolution
    pipe = case.build(0, torch.float32)
    pipe(prompt=list(map(str, case.prompts[:1])), num_inference_steps=num_steps, height=height, width=width,
         output_type="latent", max_sequence_length=4, **case.pipeline_kwargs(case.prompts[:1], height, width))
    times = policy.schedule(num_steps)
    assert times.dtype == torch.float32 and times.shape == (num_steps + 1,) and times[0] == 1 and times[-1] == 0
    assert torch.equal(times, pipe.scheduler.sigmas.float())
    if resolution is not None:  # the dynamic shift follows the resolution; SD3's static shift does not
        native = build_policy(case.config(pretrained=str(twin_dirs[case.name]))).schedule(num_steps)
        dynamic = bool(policy.scheduler.config.get("use_dynamic_shifting"))
        assert dynamic == case.dynamic_shift and torch.equal(times, native) != dynamic


def assert_pipeline_step_is_the_velocity(case, pipe, policy, z, guidance):
    """One Euler step of the family pipeline's own __call__ from t = 1 (z_out = z - v), at the policy's height and
    width, gives the policy's v."""
    layout = getattr(policy, "pack", lambda x: x)  # the pipeline's own latent layout
    height, width = policy.resolution
    for part in pipe.components.values():  # as from_pretrained leaves it: a twin built in memory trains (T5 dropout)
        if isinstance(part, torch.nn.Module):
            part.eval()
    with torch.no_grad():
        v = policy.velocity(z, torch.ones(len(z)), policy.encode_prompts(case.prompts))
        # a copy of the prompts (some pipelines, Z-Image, rewrite the list they are given), as plain strings
        out = pipe(prompt=list(map(str, case.prompts)), num_inference_steps=1, latents=layout(z), height=height, width=width,
                   guidance_scale=case.pipeline_guidance(guidance), output_type="latent",
                   max_sequence_length=policy.config.max_sequence_length,
                   **case.pipeline_kwargs(case.prompts, height, width)).images
    # FLUX.2's "latent" output is denormalised and unpatchified: back into the latents= layout
    out = getattr(policy, "latents_from_pipeline_output", lambda x: x)(out)
    assert v.abs().mean() > 0
    torch.testing.assert_close(layout(z) - out, layout(v), rtol=1e-4, atol=1e-5)
    assert policy.decode(z).shape == (len(z), 3, height, width)  # rows and columns where the pipeline has them


@by_case
@pytest.mark.parametrize("resolution", [None, TALL, WIDE], ids=["native", "48x32", "32x48"])
def test_velocity_is_the_family_pipelines(case, resolution, rng_seed):
    """The pipeline's own step gives the policy's v: same prompt encoding, latent layout (FLUX: 2x2 packing,
    position ids; Qwen-Image: its RoPE's image shapes), timestep scaling and guidance -- at a square and at a tall
    and a wide size (rows and columns swapped would pass a square test)."""
    seed = rng_seed % 10_000
    pipe = case.build(0, torch.float32)
    policy = build_policy(case.config(seed=seed, guidance_scale=case.guidance[1], family=case.family,
                                      resolution=resolution), pipeline=pipe)
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))  # the pipeline runs the adapter too
    z = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))
    assert_pipeline_step_is_the_velocity(case, pipe, policy, z, case.guidance[1])


@by_case
def test_bfloat16_weights_keep_the_sde_in_float32(case, twin_dirs, rng_seed):
    """bf16 frozen weights: the LoRA, its gradient and the whole SDE trajectory (latents, log-probs, recorded
    velocities) stay float32 through the module's rollout and update, close to the float32 model's."""
    seed = rng_seed % 10_000
    modules = [module_for(case, twin_dirs[case.name], seed, guidance=case.guidance[1], dtype=dtype,
                          reward=MeanIntensity(), skip_zero_advantage=False) for dtype in ("float32", "bfloat16")]
    m32, m16 = modules
    assert m16.policy.transformer.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in m16.policy.lora_parameters())
    trajs = [m.sampler.trajectories(case.prompts, [0, 1], step=0)[0] for m in modules]
    t16 = trajs[1]
    assert t16.latents.dtype == t16.log_probs.dtype == t16.velocities.dtype == t16.times.dtype == torch.float32
    assert torch.isfinite(t16.latents).all() and torch.isfinite(t16.log_probs).all()
    # same initial noise: the first velocity differs only by the bf16 rounding (measured over 12 seeds: relative
    # 0.021-0.028 for SD3 / SD3.5, 0.067-0.078 for FLUX; a wrong cast or layout would be of order 1)
    v32, v16 = trajs[0].velocities[0], t16.velocities[0]
    assert 0 < float((v16 - v32).norm() / v32.norm()) < 0.15
    before = [p.detach().clone() for p in m16.policy.lora_parameters()]
    fit(m16, case.prompts)  # a float32 update of the float32 LoRA through the bf16 transformer
    nonzero_advantages(m16.last_rollout.advantages, seed)  # (else AdamW's weight decay alone would move the LoRA)
    assert m16.first_update_ratio_deviation == 0.0  # bf16 forwards of the rollout's shapes: bit for bit too
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in m16.policy.lora_parameters())
    assert any(not torch.equal(p, b) for p, b in zip(m16.policy.lora_parameters(), before))


@by_training_case
@pytest.mark.parametrize("guided", [False, True], ids=["guidance_off", "guidance_on"])
def test_first_update_ratio_is_one(case, twin_dirs, guided, rng_seed):
    # no zero-advantage skip: it would repack a micro-batch smaller than the rollout's (tied rewards)
    module = module_for(case, twin_dirs[case.name], rng_seed % 10_000, guidance=case.guidance[int(guided)],
                        skip_zero_advantage=False)
    assert module.policy.guided == (guided and case.cfg)  # FLUX: embedded guidance, one forward
    rows = []  # of every transformer call, rollout and update: one shape throughout
    module.policy.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: rows.append(len(kwargs.get("hidden_states", args[0] if args else None))),
        with_kwargs=True)  # Z-Image's transformer takes a list of samples as its first argument
    fit(module, case.prompts)
    assert set(rows) == {4 * (2 if module.policy.guided else 1)} and len(rows) > module.sampling.num_steps
    # theta = theta_old and the training forwards have the rollout's batch shape: bit for bit, at every step
    assert module.first_update_ratio_deviation == 0.0 and not module.first_update_ratio_off
    assert {k for r in module.window_records for k in r.steps} == set(module.plan.trained_steps)
    assert any(r.routed for r in module.window_records) and any(r.backwards > 0 for r in module.window_records)


@by_training_case
@pytest.mark.parametrize("jagg_frac,window_size,resolution", [(0.0, 3, None), (1.0, 2, None), (1.0, 2, TALL)],
                         ids=["exact_grpo", "jagg_w2", "jagg_w2_48x32"])
def test_update_equals_handwritten_per_step_grpo(case, twin_dirs, jagg_frac, window_size, resolution, rng_seed):
    """float64: jagg_frac 0, and JAGG on W = 2 windows (no interior step), give the per-step GRPO step; at the
    twin's square size and at a non-square one."""
    seed, lr = rng_seed % 10_000, 0.5
    module = module_for(case, twin_dirs[case.name], seed, guidance=case.guidance[1], dtype="float64",
                        jagg_frac=jagg_frac, window_size=window_size, optimizer=lambda p: torch.optim.SGD(p, lr=lr),
                        max_grad_norm=None, resolution=resolution)
    assert module.policy.resolution == (tuple(resolution) if resolution else (32, 32))
    error = handwritten_update_error(module, case.prompts, lr, lambda m: fit(m, case.prompts),
                                     lambda adv: nonzero_advantages(adv, seed))
    full = [w for w in module.windows if len(w.steps) == window_size]
    assert full and all(w.routed == bool(jagg_frac) for w in full)
    assert error < 1e-10


@contextmanager
def transformer_of(policy, transformer):
    """The policy's velocity code around another transformer (e.g. a pipeline that loaded the export)."""
    own = policy.transformer
    policy.transformer = transformer
    try:
        yield policy
    finally:
        policy.transformer = own


@pytest.mark.slow
@by_training_case
def test_jagg_fit_writes_an_adapter_the_family_pipeline_loads(case, twin_dirs, tmp_path, rng_seed):
    """`jagg fit` with the family's tiny config (configs/<family>_tiny.yaml) on the saved twin, the family
    detected from its model_index.json, fewer steps, at a non-square size; the family pipeline's load_lora_weights
    reproduces it, its own __call__ at that size included."""
    seed = str(rng_seed % 10_000)
    args = tiny_fit_args(ROOT / case.tiny_config, seed, twin_dirs[case.name], tmp_path, case.prompts_file)
    if case.source_kwargs:  # an editing family: a sample grid of the folder's test rows, given from the command line
        args += ["--trainer.callbacks+=jagg_lightning.callbacks.SampleImages", "--trainer.callbacks.prompts_file",
                 str(ROOT / case.prompts_file), "--trainer.callbacks.every_n_steps", "2",
                 "--trainer.callbacks.num_steps", "2", "--trainer.callbacks.dirpath", str(tmp_path / "samples")]
    cli = cli_main([*args, "--model.policy.resolution", "[48, 32]"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    policy = cli.model.policy
    assert policy.resolution == (48, 32)
    if case.source_kwargs:
        assert_grid_starts_with_the_sources(cli.trainer, policy)
    assert policy.family == case.family and policy.config.guidance_scale > 1  # the config trains with guidance
    assert policy.guided == case.cfg  # SD3.5 / FLUX.2 / Z-Image: CFG; FLUX: embedded guidance, one forward
    final = tmp_path / "lora" / "final"

    gen = torch.Generator().manual_seed(int(seed))
    z, t = torch.randn(2, *policy.latent_shape, generator=gen), torch.rand(2, generator=gen)
    cond = policy.encode_prompts(case.prompts)
    pipe = case.build(0, torch.float32)
    with torch.no_grad():
        expected = policy.velocity(z, t, cond)
        with transformer_of(policy, pipe.transformer):
            base = policy.velocity(z, t, cond)
        pipe.load_lora_weights(str(final / "diffusers"))
        with transformer_of(policy, pipe.transformer):
            loaded = policy.velocity(z, t, cond)
    assert not torch.allclose(base, expected, rtol=1e-4, atol=1e-5)  # training moved the adapter
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-6)
    assert_pipeline_step_is_the_velocity(case, pipe, policy, z, policy.config.guidance_scale)

    fresh = PeftModel.from_pretrained(case.build(0, torch.float32).transformer, str(final / "peft")).base_model.model
    with torch.no_grad(), transformer_of(policy, fresh):
        torch.testing.assert_close(policy.velocity(z, t, cond), expected, rtol=1e-5, atol=1e-6)


def assert_grid_starts_with_the_sources(trainer, policy):
    """SampleImages read the test rows of the dataset folder: each row of its grid is source (fitted to the sampled
    size), base, fine-tuned."""
    from jagg_lightning.callbacks import SampleImages
    from jagg_lightning.models.conditions import condition_images, fit_to

    [samples] = [c for c in trainer.callbacks if isinstance(c, SampleImages)]
    assert [p.name for p in samples.written] == ["step_000002.png"]
    assert all(p.images for p in samples.prompts) and samples.last_layout.columns == 3
    height, width = policy.resolution
    grid = samples.last_grid
    assert grid.shape[:2] == (len(samples.prompts) * height, 3 * width)
    for r, prompt in enumerate(samples.prompts):
        source = fit_to(condition_images(prompt)[0], height, width).permute(1, 2, 0).numpy()
        assert np.array_equal(grid[r * height:(r + 1) * height, :width], (source * 255).round().astype(np.uint8))


@by_training_case
def test_gradient_checkpointing_keeps_the_lora_gradient(case, twin_dirs, rng_seed):
    seed = rng_seed % 10_000
    policy = build_policy(case.config(pretrained=str(twin_dirs[case.name]), seed=seed, guidance_scale=case.guidance[1]))
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    z, t = torch.randn(2, *policy.latent_shape, generator=gen), torch.rand(2, generator=gen)
    assert checkpointed_gradient_error(policy, z, t, policy.encode_prompts(case.prompts)) < 1e-5
