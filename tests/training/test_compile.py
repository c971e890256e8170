"""``policy.compile: repeated_blocks`` on the tiny SD3 twin (real diffusers transformer, peft LoRA): a compiled
training step's velocities and gradient equal the eager module's on the same trajectory, three training steps
compile nothing after the first, and checkpoints, resume and the LoRA exports are the eager module's.

The module compiles its blocks with inductor; here they are compiled again, before their first call, with
``aot_eager``: the same dynamo graphs, guards, recompilations and AOT-autograd backward, without inductor's code
generation (about 90-120 s of cold compile per process on this CPU, which CI would pay in every run). Inductor's own
numerics on every family's twin are measured by ``benchmarks/compile_families.py`` (benchmarks/README.md)."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from safetensors.torch import load_file

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.callbacks import LoRAExport
from jagg_lightning.data import PromptDataModule
from jagg_lightning.models.compiling import compile_counts, compile_policy, is_compiled, repeated_blocks
from jagg_lightning.policies import PolicyConfig
from jagg_lightning.training.passes import reference_steps
from jagg_lightning.training.rollout import plan_rollout
from jagg_lightning.training.update import StepReport, UpdateHooks
from jagg_lightning.utils.checks import check_strategy

from helpers import lora_grads, randomize_lora_b, rel_error, tiny_policy_config

slow = pytest.mark.slow
PROMPTS = ["a red cat", "a blue dog"]

# float32 tolerances of compiled vs eager (relative, over the whole tensor / every LoRA gradient). Inductor fuses the
# block's elementwise ops and norms and may reorder their reductions, so a velocity differs from the eager one by a
# few float32 roundings per op (eps = 1.2e-7) through two blocks: measured ~1e-7 to 1e-6. The gradient goes through
# the backward graph too and through the GRPO loss, whose ratio exp(log pi - log pi_old) amplifies a velocity
# difference by the log-prob's sensitivity: measured ~1e-6 to 1e-5. The bounds leave a factor of ~10-100 of room and
# are still far below what a wrong graph gives (an adapter not applied, a block skipped: relative errors of order 1).
VELOCITY_TOLERANCE = 2e-5
GRADIENT_TOLERANCE = 5e-4


def make_module(seed, compile=True, fused=False, jagg_frac=1.0, kl_beta=0.0, guidance=1.0, train_batch_size=4):
    module = JAGGModule(
        tiny_policy_config(compile="repeated_blocks" if compile else None, guidance_scale=guidance),
        SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=4),
        GRPOConfig(train_batch_size=train_batch_size, kl_beta=kl_beta, adv_std="group", skip_zero_advantage=False),
        JAGGConfig(window_size=3, jagg_frac=jagg_frac, fused_rollout=fused),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        seed=seed,
    )
    module.configure_model()
    compile_policy(module.policy, backend="aot_eager")  # before any call: replaces inductor (the module docstring)
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def trainer(steps, root=None, callbacks=()):
    return L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=root, enable_checkpointing=root is not None,
                     callbacks=list(callbacks))


def data(seed=0):
    return PromptDataModule(prompts=PROMPTS, batch_size=2, seed=seed)


@slow
def test_only_the_repeated_blocks_are_compiled_and_names_are_unchanged(rng_seed):
    seed = rng_seed % 10_000
    compiled, eager = make_module(seed), make_module(seed, compile=False)
    blocks = repeated_blocks(compiled.policy.transformer)
    assert len(blocks) == 2 and all(is_compiled(b) for b in blocks)  # SD3 declares no _repeated_blocks: its list
    assert not any(is_compiled(m) for m in compiled.policy.transformer.modules() if all(m is not b for b in blocks))
    assert not any(is_compiled(m) for m in eager.policy.modules())
    # compiled in place: no _orig_mod anywhere, the same names, parameters and state-dict keys as the eager module
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert not any("_orig_mod" in n for n in compiled.state_dict())


@slow
@pytest.mark.parametrize("fused,jagg_frac,kl_beta,guidance", [(False, 0.0, 0.1, 4.0), (True, 1.0, 0.0, 1.0)],
                         ids=["exact_unfused_kl_cfg", "jagg_fused"])
def test_compiled_step_equals_eager_on_its_trajectory(fused, jagg_frac, kl_beta, guidance, rng_seed):
    """One training step of the compiled module (rollout, KL reference, passes or the fused mode's kept graphs): every
    recorded velocity, every reference velocity and the step's LoRA gradient equal the eager module's on the same
    trajectory and rewards (the eager gradient is the unfused update's: the fused one equals it, tests/unit/test_fused.py)."""
    seed = rng_seed % 10_000
    compiled = make_module(seed, fused=fused, jagg_frac=jagg_frac, kl_beta=kl_beta, guidance=guidance)
    eager = make_module(seed, compile=False, fused=fused, jagg_frac=jagg_frac, kl_beta=kl_beta, guidance=guidance)
    for a, b in zip(compiled.policy.lora_parameters(), eager.policy.lora_parameters()):
        assert torch.equal(a, b)
    plan, indices = plan_rollout(compiled.sampling, compiled.jagg, 0), [0, 1]
    grads = {}
    report = compiled.updater.step(PROMPTS, indices, 0, plan, compiled.reward_fn,
                                   UpdateHooks(optimizer_step=lambda: grads.setdefault("compiled", lora_grads(compiled.policy))))
    traj, cond = report.trajectory, report.cond
    n, errors = traj.latents.shape[1], []
    for k in plan.trained_steps:
        t = traj.times[k].expand(n)
        with torch.no_grad():
            errors.append(rel_error([traj.velocities[k]], [eager.sampler.velocity(traj.latents[k], t, cond)]))
            if kl_beta > 0:
                ref = eager.sampler.reference_velocity(traj.latents[k], t, cond)
                errors.append(rel_error([traj.ref_velocities[k]], [ref]))
        with torch.enable_grad():  # the passes' graph (grad mode) against eager
            v, v_eager = compiled.sampler.velocity(traj.latents[k], t, cond), eager.sampler.velocity(traj.latents[k], t, cond)
        errors.append(rel_error([v.detach()], [v_eager.detach()]))
    print(f"velocity relative errors compiled vs eager: max {max(errors):.2e}")
    assert max(errors) < VELOCITY_TOLERANCE and min(errors) >= 0
    # the first update's ratio is exactly 1: the compiled passes round as the compiled rollout did (measured on this
    # twin; not a promise of inductor's -- FirstUpdateRatioCheck tolerates float noise at run time)
    compiled.ratio_check(report.first_update_stats)
    assert compiled.ratio_check.deviation == 0.0 and report.first_update_stats
    # the eager update of the compiled rollout's trajectory and rewards
    again = StepReport(cond, trajectory=traj, _rewards=[report.rewards], _components=[report.components])
    eager.updater.guard.start_rollout(indices, traj.latents.device)
    eager.updater.update_rollout(again, plan, reference_steps(plan.windows, eager.jagg), 0, eager.reward_fn,
                                 UpdateHooks(optimizer_step=lambda: grads.setdefault("eager", lora_grads(eager.policy))))
    assert sum(float(g.abs().sum()) for g in grads["eager"]) > 0
    error = rel_error(grads["compiled"], grads["eager"])
    print(f"gradient relative error compiled vs eager: {error:.2e}")
    assert error < GRADIENT_TOLERANCE


class CompileCounts(Callback):
    def __init__(self):
        self.after = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(compile_counts())


@slow
def test_no_recompilation_after_the_first_step(rng_seed):
    """Three training steps: every compile happens in the first. The run has everything that makes a variant -- CFG
    (doubled batch), the KL reference (adapter off), passes of 2 samples against rollout micro-batches of 4, routed
    and exact windows; ``dynamic=True`` keeps the batch sizes in one graph. (The fused mode's rollout with grad at
    kept steps is the passes' grad-mode variant: counted 4 frames, none after step 1, when this branch was measured;
    not repeated here, a 30 s trace.)

    Counted from a clean dynamo cache (``torch._dynamo.reset``), so the first step's count is pinned: the tiny twin has
    two distinct blocks (the last is ``context_pre_only``), and each compiles once without grad, once with grad (the
    first block's input does not require grad, the last's does) and once with the adapter off: 6 frames."""
    seed = rng_seed % 10_000
    module = make_module(seed, jagg_frac=0.5, kl_beta=0.1, guidance=4.0, train_batch_size=2)
    torch._dynamo.reset()
    before, counts = compile_counts(), CompileCounts()
    trainer(3, callbacks=[counts]).fit(module, data(seed))
    first, second, third = counts.after
    assert first == second == third, f"recompiled after step 1: {counts.after}"
    assert first["frames"] == first["compiled"]  # no frame given up on (recompile limit) and run eagerly
    assert first["compiled"] - before["compiled"] == 6, (before, first)


@slow
def test_checkpoint_resume_and_export_keys_are_the_eager_modules(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    eager = make_module(seed, compile=False)
    trainer(1, tmp_path / "eager", [LoRAExport(str(tmp_path / "eager" / "lora"))]).fit(eager, data(seed))
    compiled = make_module(seed)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "compiled", save_last=True)
    trainer(1, tmp_path / "compiled", [checkpoint, LoRAExport(str(tmp_path / "compiled" / "lora"))]).fit(compiled, data(seed))
    ckpt = torch.load(tmp_path / "compiled" / "last.ckpt", weights_only=True)
    trainable = [n for n, p in eager.named_parameters() if p.requires_grad]
    assert sorted(ckpt["state_dict"]) == sorted(trainable) and trainable
    for part, file in (("peft", "adapter_model.safetensors"), ("diffusers", "pytorch_lora_weights.safetensors")):
        keys = set(load_file(str(tmp_path / "compiled" / "lora" / "final" / part / file)))
        assert keys == set(load_file(str(tmp_path / "eager" / "lora" / "final" / part / file))) and keys
        assert not any("_orig_mod" in k for k in keys)
    # a compiled module resumes from it: the checkpoint's LoRA is loaded by name (Lightning restores it at fit start;
    # max_steps already reached, nothing trains after)
    resumed = make_module(seed)
    randomize_lora_b(resumed.policy.transformer, torch.Generator().manual_seed(seed + 1))  # only the checkpoint can undo
    assert any(not torch.equal(p, ckpt["state_dict"][n]) for n, p in resumed.named_parameters() if p.requires_grad)
    trainer(1, tmp_path / "resumed").fit(resumed, data(seed), ckpt_path=str(tmp_path / "compiled" / "last.ckpt"))
    assert resumed.global_step == 1 and all(is_compiled(b) for b in repeated_blocks(resumed.policy.transformer))
    after = dict(resumed.named_parameters())
    for name, value in ckpt["state_dict"].items():
        assert torch.equal(after[name], value), name


def test_compile_is_refused_under_fsdp2_and_allowed_under_ddp():
    """``JAGGModule.setup`` refuses ``policy.compile`` under FSDP2 (it wraps each block after compilation) naming the
    field; DDP and one process run it. (Context parallelism is refused by the same check, on a strategy whose
    ``context_parallel`` is set once its processes exist: not built here.)"""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from jagg_lightning.strategies import DDPStrategy, FSDP2Strategy

    compiled = PolicyConfig(compile="repeated_blocks")
    with pytest.raises(ValueError, match=r"^policy.compile must be null under FSDP2 or context parallelism"):
        check_strategy(FSDP2Strategy(), ModelParallelStrategy, "fit", JAGGConfig(), compiled)
    with pytest.raises(ValueError, match=r"^policy.compile must be null"):
        check_strategy(FSDP2Strategy(), ModelParallelStrategy, "validate", JAGGConfig(), compiled)
    check_strategy(FSDP2Strategy(), ModelParallelStrategy, "fit", JAGGConfig(), PolicyConfig())  # eager: fine
    check_strategy(DDPStrategy(), ModelParallelStrategy, "fit", JAGGConfig(), compiled)
    with pytest.raises(ValueError, match=r"^policy.compile must be null \(eager\) or 'repeated_blocks'"):
        PolicyConfig(compile="max-autotune")
