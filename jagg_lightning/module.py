"""JAGGModule: GRPO fine-tuning of a LoRA DiT where JAGG replaces most per-step backward passes.

``training_step`` (manual optimization) reads as the algorithm, one direction of data flow:

    plan (seed, step) -> rollout + reward (``sampler.py``) -> group advantages -> routed update
    (``update.py``: routing on the recorded velocities, JAGG windows per micro-batch) -> optimizer step

The work is done by plain parts beside this class (``docs/architecture.md``): it holds the Lightning
lifecycle, the optimizer step, evaluation and the checkpoint hooks. Callbacks read
:attr:`JAGGModule.window_records`, :attr:`JAGGModule.windows` and :attr:`JAGGModule.plan`; they never reach
into rollout internals.

Drop the module into any ``Trainer``: ``Trainer(max_steps=...).fit(JAGGModule(...), PromptDataModule(...))``.
``__init__`` only validates; the policy (``policies/``, any supported family) and the parts that work on it
(``sampler``, ``updater``) are built in ``configure_model``, which the Trainer and ``load_from_checkpoint`` call (call
it yourself to use ``module.policy`` outside a Trainer). Checkpoints hold only the trainable LoRA weights (plus
optimizer, scheduler, EMA and RNG states, and Lightning's counters); the frozen weights are rebuilt from ``policy``.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import nullcontext

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from jagg_lightning.config import EvalConfig, GRPOConfig, JAGGConfig, MemoryConfig, SamplingConfig, as_config, check_sections
from jagg_lightning.config.objective import ObjectiveConfig
from jagg_lightning.config.old_keys import move_old_keys, resolve_seeds
from jagg_lightning.data import unpack_prompt_batch
from jagg_lightning.distributed.collectives import Collectives, destroy_process_group_at_exit
from jagg_lightning.distributed.strategies import shard_policy
from jagg_lightning.faults import preemption
from jagg_lightning.method.jagg import Window, WindowGradientCheck, WindowRecord
from jagg_lightning.method.routing import rounding_note
from jagg_lightning.models.compiling import compile_policy
from jagg_lightning.models.conditions import check_data_conditions
from jagg_lightning.models.reference import attach_reference, reference_networks
from jagg_lightning.objectives import build_objective
from jagg_lightning.policies import Policy, PolicyConfig, build_policy, policy_class
from jagg_lightning.policies.checks import check_policy
from jagg_lightning.rewards import Reward, build_reward, describe_reward
from jagg_lightning.training import state
from jagg_lightning.training.ema import LoRAEMA
from jagg_lightning.training.grids import weights_label
from jagg_lightning.training.images import log_dir, write_image
from jagg_lightning.training.metrics import EvalSums, FirstUpdateRatioCheck, train_metrics
from jagg_lightning.training.rollout import RolloutBatch, RolloutPlan, plan_rollout
from jagg_lightning.training.sampler import EVAL_STEP, Sampler
from jagg_lightning.training.update import StepReport, UpdateHooks
from jagg_lightning.utils.checks import (
    check, check_learning_rates, check_optimizer, check_precision, check_strategy, default_optimizer,
)
from jagg_lightning.utils.dtypes import compute_dtype
from jagg_lightning.utils.timing import CLOCK, timed

__all__ = ["JAGGModule"]


def _full_precision_defaults(step):
    """Lightning's "-true" half precisions make half the default dtype inside the step; the SDE and GRPO math
    creates tensors without a dtype and must stay float32 (float64 with a float64 policy)."""

    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.sde_dtype)
        try:
            return step(self, *args, **kwargs)
        finally:
            torch.set_default_dtype(previous)

    return wrapper


def _to_arguments(args: tuple, kwargs: dict) -> tuple:
    """(device, dtype) that ``Module.to(*args, **kwargs)`` was asked for (None where not): a device (a string, an
    index or a ``torch.device``), a dtype, or a tensor whose device and dtype to match."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, Tensor):
            device, dtype = arg.device, arg.dtype
        elif isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, (str, torch.device)) or (isinstance(arg, int) and not isinstance(arg, bool)):
            device = arg
    return device, dtype


def say_jagg_frac_rounding(module) -> None:
    """On the first process, one line when ``jagg.jagg_frac`` rounds to every or no window of the module's next
    rollout (the main job: 0.5 of one window routes it; :func:`jagg_lightning.method.routing.rounding_note`)."""
    plan = plan_rollout(module.sampling, module.jagg, module.global_step, module.rollouts_done,
                        module.policy.expert_starts(module.sampler.times))
    note = rounding_note(module.jagg.jagg_frac, plan.windows, module.jagg.window_size)
    if note and module.trainer.is_global_zero:
        print(note, flush=True)


def _save_hyperparameters(module, optimizer, lr_scheduler, ema_decay, reward_workers, seed) -> None:
    """The module's hyper-parameters: LightningCLI's own config when it built the module (plain data,
    re-instantiable), else plain data only (yaml.safe_load, weights_only=True; the reward as class path + init args)."""
    if _given_hyperparameters.get() is not None:
        module.save_hyperparameters()
        return
    module.save_hyperparameters(state.plain({
        "policy": module.policy_config, "sampling": module.sampling, "grpo": module.grpo, "jagg": module.jagg,
        "reward": describe_reward(module.reward_fn), "optimizer": state.describe_callable(optimizer, default_optimizer),
        "lr_scheduler": state.describe_callable(lr_scheduler, None), "ema_decay": ema_decay,
        "reward_workers": reward_workers, "evaluation": module.evaluation, "memory": module.memory, "seed": seed,
        "objective": module.objective.config}))


def quiet_manual_checkpoint_warning() -> None:
    """trainer.global_step counts optimizer steps (docs/configuration.md; one per rollout unless grpo.inner_epochs or
    micro_batches_per_update say more): ModelCheckpoint(every_n_train_steps=N) saves after the N-th, with the weights,
    optimizer, EMA and RNG state a resume continues from exactly. Lightning's manual-optimization path warns that no
    "pre-optimization state" was saved: that state would resume one step back, so this module keeps none."""
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization and every_n_train_steps, "
                            "but no pre-optimization state was saved", category=UserWarning)


def timed_hooks(module, collectives: Collectives, step: int) -> UpdateHooks:
    """The update's hooks for one training step: each backward and optimizer step timed as its phase."""
    return UpdateHooks(timed("update/backward", module.manual_backward),
                       timed("optimizer", functools.partial(module.step_optimizer, collectives)), collectives,
                       functools.partial(preemption.check, collectives.max_over_world, step))


class JAGGModule(L.LightningModule):
    """GRPO with JAGG window gradients on a LoRA-adapted flow-matching transformer (manual optimization).

    Args:
        reward: A registered reward name (`jpeg_compressibility`, `digits`, ...) or a `Reward` (in a config: its
            `class_path` and `init_args`; docs/rewards.md); in Python also a callable `fn(images, prompts) -> scores`.
        optimizer: The optimizer over the trainable (LoRA) parameters; null = AdamW, lr 1e-4, weight decay 1e-4.
        lr_scheduler: A learning-rate scheduler, stepped once per optimizer step; null = none.
        ema_decay: The decay of an EMA of the LoRA weights, in (0, 1) (export and evaluation use it); null = off.
        reward_workers: Threads scoring each rollout micro-batch while the next samples, >= 0 (0: the training thread).
        seed: The root of every random draw of the algorithm; each stream is drawn from it with a tag of its own.
    """

    strict_loading = False  # checkpoints carry only the LoRA weights

    def __init__(
        self,
        # typed without `| None` (None still works): the CLI shows full sections and the dataclasses' own errors
        policy: PolicyConfig = PolicyConfig(),
        sampling: SamplingConfig = SamplingConfig(),
        grpo: GRPOConfig = GRPOConfig(),
        jagg: JAGGConfig = JAGGConfig(),
        reward: str | Reward = "jpeg_compressibility",
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        ema_decay: float | None = None,
        reward_workers: int = 0,
        evaluation: EvalConfig = EvalConfig(),
        memory: MemoryConfig = MemoryConfig(),
        seed: int = 0,
        objective: ObjectiveConfig = ObjectiveConfig(),
    ):
        super().__init__()
        self.automatic_optimization = False
        self.policy_config = as_config(PolicyConfig, policy)
        self.sampling = as_config(SamplingConfig, sampling)
        self.grpo = as_config(GRPOConfig, grpo)
        self.jagg = as_config(JAGGConfig, jagg)
        self.memory = as_config(MemoryConfig, memory)
        self.evaluation = as_config(EvalConfig, evaluation)
        # Everything that can be checked is checked before any model is built.
        move_old_keys(self.policy_config, self.sampling, self.jagg, self.memory)  # one deprecation line each
        check_sections(self.sampling, self.grpo, self.jagg)
        self.objective = build_objective(as_config(ObjectiveConfig, objective), self.sampling, self.grpo, self.jagg)
        check_policy(self.policy_config)  # the family registry and the files the policy config names
        optimizer = state.rebuild_callable("optimizer", optimizer) or default_optimizer
        lr_scheduler = state.rebuild_callable("lr_scheduler", lr_scheduler)
        self.optimizer_factory, self.lr_scheduler_factory = check_optimizer(optimizer), lr_scheduler
        check(ema_decay is None or 0.0 < ema_decay < 1.0, "ema_decay", "in (0, 1) or null", ema_decay)
        check(reward_workers >= 0, "reward_workers", ">= 0 (0 scores in the training thread)", reward_workers)
        self.reward_workers = reward_workers
        self.reward_fn = build_reward(reward)
        _save_hyperparameters(self, optimizer, lr_scheduler, ema_decay, reward_workers, seed)
        # every stream's seed from the root (after the hyper-parameters: they keep what was given)
        resolve_seeds(seed, self.policy_config, self.sampling, self.evaluation)
        self.seed = seed

        # the policy, its parts and the EMA of its LoRA are built in configure_model; windows need only the config
        self.ema_decay, self.ema = ema_decay, None
        self._ema_restored = False  # set when a checkpoint's EMA state is loaded
        self.rollouts_done = 0  # training steps (rollouts) so far; global_step counts optimizer steps
        self._step_rng: dict | None = None  # the RNG streams as the running training step found them
        self.exact_backwards = 0  # backward passes exact GRPO would have made in the last training step
        self.trained_steps = self.sampling.trainable_steps  # every step a rollout may train
        self.plan: RolloutPlan = plan_rollout(self.sampling, self.jagg, 0)  # of the last rollout (callbacks read it)
        self.windows: list[Window] = self.plan.windows
        self.skipped_samples = 0  # zero-advantage samples given no pass in the last training step
        self.ratio_check = FirstUpdateRatioCheck(self.sampling, self.grpo, self.jagg, self.sde_dtype)
        self.first_update_ratio_deviation = float("nan")  # max |log rho| in the first update of the last step
        self.first_update_ratio_off = False  # that deviation exceeds float noise (a warning was raised)
        self.window_records: list[WindowRecord] = []  # of the last training step, all micro-batches
        self.last_rollout: RolloutBatch | None = None
        self._eval = EvalSums()  # reward sums and counts, grid images, over this process's eval samples
        self._sharded = False  # FSDP2 applied by configure_model

    @property
    def sde_dtype(self) -> torch.dtype:
        """The dtype of the SDE and GRPO math: float32 whatever the model dtype (float64 with a float64 policy)."""
        return compute_dtype(self.policy_config.dtype)

    def _trainable_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def inference_weights(self):
        """Context in which the policy holds the weights to export or sample with (EMA when enabled)."""
        return self.ema.applied() if self.ema is not None else nullcontext()

    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        """Build (or load) the policy and the parts that work on it -- here rather than in ``__init__`` so that a
        strategy can wrap or shard it as it is created. Idempotent: the Trainer calls it for every fit/validate/predict."""
        if not hasattr(self, "policy"):  # not built yet (__getattr__ says so)
            self.policy: Policy = build_policy(self.policy_config)
            attach_reference(self.policy, self.grpo.kl_beta)  # full FT with KL: a frozen copy of the initial weights
            if self.policy_config.gradient_checkpointing:
                self.policy.enable_gradient_checkpointing()
            compile_policy(self.policy)  # policy.compile: the repeated blocks, after the LoRA and reference copies
            self.sampler = Sampler(self.policy, self.sampling, self.grpo.kl_beta, self.reward_workers)
            self.updater = self.objective.updater(self.policy, self.sampling, self.grpo, self.jagg, self.memory, self.sampler)
        context = getattr(self._trainer.strategy, "context_parallel", None) if self._trainer is not None else None
        if context is not None:  # diffusers' context parallelism on every network that runs (before FSDP2 wraps them)
            context.apply(self.policy.sharded_networks() + reference_networks(self.policy), self.policy.family)
        mesh = self.device_mesh  # set by ModelParallelStrategy (FSDP2Strategy) before this hook
        if mesh is not None and not self._sharded:
            # FSDP2: one unit per transformer block (+ the reference copy); the parameters become DTensor shards,
            # so an EMA made before this point would track the old tensors (nothing has trained yet: rebuild it)
            shard_policy(self.policy, mesh["data_parallel"], self.trainer.strategy)
            self._sharded, self.ema = True, None
        if self.ema_decay is not None and self.ema is None:
            self.ema = LoRAEMA(self._trainable_named_parameters(), self.ema_decay,
                               self.policy.trained_networks().values())

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name not in ("policy", "sampler", "updater"):
                raise
            raise AttributeError(f"JAGGModule.{name} is built in configure_model(): the Trainer calls it; outside a "
                                 "Trainer call module.configure_model() first") from None

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.policy.lora_parameters())
        check_learning_rates(optimizer)
        if self.lr_scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.lr_scheduler_factory(optimizer)}

    def setup(self, stage: str) -> None:
        destroy_process_group_at_exit()  # Lightning leaves it to interpreter shutdown, where gloo can abort
        check_precision(self.trainer.precision, self.policy_config.dtype)
        check_data_conditions(getattr(self.trainer, "datamodule", None), policy_class(self.policy_config), self.reward_fn)
        check_strategy(self.trainer.strategy, ModelParallelStrategy, stage, self.jagg, self.policy_config)

    def teardown(self, stage: str) -> None:
        if "sampler" in self.__dict__:
            self.sampler.close()

    # ------------------------------------------------------------------ training
    @_full_precision_defaults
    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        self._step_rng = state.rng_state()  # a checkpoint written on an exception inside the step restarts it
        prompts, indices = unpack_prompt_batch(batch)
        step = self.global_step
        self.plan = plan = plan_rollout(self.sampling, self.jagg, step, self.rollouts_done,
                                        self.policy.expert_starts(self.sampler.times))
        self.windows, collectives = plan.windows, Collectives(self.trainer)
        hooks = timed_hooks(self, collectives, step)
        decoded = self.sampler.decoded_samples  # train/decodes: the samples this step decodes (0: latent rewards alone)
        # rollout -> rewards -> advantages -> routed update -> optimizer step(s), fused or not (update.py)
        with CLOCK.phase("rollout"):  # time no inner phase claims is the rollout's (utils/timing.py)
            report = self.updater.step(prompts, indices, step, plan, self.reward_fn, hooks)
        self._record_step(report, collectives, self.sampler.decoded_samples - decoded)
        self.rollouts_done += 1
        self._step_rng = None
        quiet_manual_checkpoint_warning()  # before ModelCheckpoint's on_train_batch_end: a checkpoint is after the step
        return report.rewards.mean()

    def step_optimizer(self, collectives: Collectives) -> None:
        """All-reduce and non-finite check (nonfinite.py), clip, step, EMA, scheduler: after an update's backwards."""
        optimizer = self.optimizers()
        if all(p.grad is None for p in self.policy.lora_parameters()):
            # every sample skipped (zero advantage): the zero gradient the optimizer would have seen
            for p in self.policy.lora_parameters():
                p.grad = torch.zeros_like(p)
        skipped = self.updater.guard.all_reduce_and_decide(self.policy.lora_parameters(), collectives, self.global_step)
        if skipped is not None:  # gradients dropped: weights and optimizer state stay, Lightning still counts the step
            rank_zero_warn(skipped)
            return optimizer.step()  # EMA and scheduler do not step
        if self.grpo.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.grpo.max_grad_norm, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()

    def _record_step(self, report: StepReport, collectives: Collectives, decodes: int = 0) -> None:
        """Keep what callbacks read, check the first update's ratio and log ``train/*``."""
        self.window_records, self.skipped_samples = report.records, report.skipped_samples
        self.windows = report.windows if report.windows is not None else self.windows  # forward-process: the levels'
        self.last_rollout = RolloutBatch(report.trajectory, report.cond, report.advantages)
        if warning := self.ratio_check(report.first_update_stats):
            rank_zero_warn(warning)
        self.first_update_ratio_deviation, self.first_update_ratio_off = self.ratio_check.deviation, self.ratio_check.off
        # backwards the objective makes without JAGG, counted by it (records cannot tell micro-batches from parts)
        self.exact_backwards = report.exact_backwards
        values = train_metrics(report, self.windows, self.ratio_check, self.exact_backwards,
                               collectives.gradient_all_reduces, self.updater.guard.skipped, decodes)
        rewards = report.rewards
        self.log_dict({f"train/{k}": v.float() for k, v in values.items()}, batch_size=rewards.shape[0])
        self.log("reward", rewards.mean().float(), prog_bar=True, batch_size=rewards.shape[0], logger=False)
        # every component under its own name, a single reward too (as well as train/reward_mean)
        self.log_dict({f"train/reward/{n}": c.mean().float() for n, c in report.components.items()},
                      batch_size=rewards.shape[0])

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def generate(self, prompts: list[str], prompt_indices: list[int], with_latents: bool = False):
        """``evaluation.samples_per_prompt`` images per prompt (prompt-major) [N, 3, H, W] in [0, 1] (and latents:
        ``Sampler.ode_images``): ODE sampling, ``evaluation.num_steps`` steps and guidance, inference (EMA) weights."""
        ev = self.evaluation
        with self.inference_weights():
            return self.sampler.ode_images(prompts, prompt_indices, ev.samples_per_prompt, ev.seed, EVAL_STEP,
                                           ev.num_steps, self.policy.guidance(ev.guidance_scale), with_latents)

    def on_validation_epoch_start(self) -> None:
        self._eval = EvalSums(self.device, self.evaluation.grid_prompts * self.evaluation.samples_per_prompt)

    on_test_epoch_start = on_validation_epoch_start

    @_full_precision_defaults
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        prompts, indices = unpack_prompt_batch(batch)
        images, latents = self.generate(prompts, indices, with_latents=True)  # latents reach latent rewards alone
        sample_prompts = [p for p in prompts for _ in range(self.evaluation.samples_per_prompt)]
        self._eval.add(images, *self.sampler.score(self.reward_fn, images, sample_prompts, latents), sample_prompts)

    test_step = validation_step

    def on_validation_epoch_end(self) -> None:
        self._log_evaluation("test" if self.trainer.testing else "val")

    on_test_epoch_end = on_validation_epoch_end

    def _log_evaluation(self, stage: str) -> None:
        """Means over every sample of every process (sums and counts all-reduced), and the sample grid."""
        if self.trainer.sanity_checking or not self._eval.sums:
            return
        means = self._eval.means(Collectives(self.trainer).sum)  # over the data ranks
        self.log_dict({f"{stage}/{n}": m for n, m in means.items()}, sync_dist=False)
        directory = log_dir(self.trainer) / "samples"  # on every process: trainer.log_dir broadcasts
        if self._eval.grid and self.trainer.is_global_zero:  # what was sampled (adapter, step) on it and in its name
            label, name = weights_label(self.trainer.state.fn, self.global_step, self.trainer.ckpt_path,
                                        self.policy_config.adapter)
            grid = self._eval.grid_picture(self.evaluation.samples_per_prompt, label, self.reward_fn)
            write_image(self.trainer, directory / f"{stage}_{name}.png", f"{stage}/samples", grid)

    @_full_precision_defaults
    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        """{"prompt", "index", "sample", "images" [N, 3, H, W] in [0, 1]} for a batch of prompts."""
        prompts, indices = unpack_prompt_batch(batch)
        per = self.evaluation.samples_per_prompt
        return {"prompt": [p for p in prompts for _ in range(per)], "index": [i for i in indices for _ in range(per)],
                "sample": [s for _ in prompts for s in range(per)], "images": self.generate(prompts, indices).cpu()}

    def check_window_gradients(self, max_samples: int | None = None) -> list[WindowGradientCheck]:
        """Exact vs JAGG gradient of every window on the last rollout's first ``max_samples`` samples,
        at the current theta. Leaves weights, ``.grad``, optimizer state and RNG streams untouched."""
        if self.last_rollout is None:
            return []
        return self.updater.check_windows(self.last_rollout, self.plan, [p for _, p in self._trainable_named_parameters()],
                                          max_samples)

    # ------------------------------------------------------------------ precision and checkpoints
    def to(self, *args, **kwargs):
        """Moves devices; a floating dtype is ignored. Precision plugins ("bf16-true", "16-true", "64-true") cast
        the whole module: the frozen weights already hold ``policy.dtype`` (paired with the precision by
        :func:`check_precision`) and the LoRA weights -- hence the optimizer state -- stay float32."""
        device, dtype = _to_arguments(args, kwargs)
        if dtype is None or not dtype.is_floating_point:
            return super().to(*args, **kwargs)
        return self if device is None else super().to(device=device, non_blocking=kwargs.get("non_blocking", False))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Checkpoints hold only the trainable (LoRA) weights (:func:`~jagg_lightning.training.state.trainable_keys_only`)."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        return state.trainable_keys_only(result, {n for n, _ in self._trainable_named_parameters()}, strict)

    def on_fit_start(self) -> None:
        if self.ema is not None:
            self.ema.start(resumed=self.global_step > 0 or self._ema_restored)
        say_jagg_frac_rounding(self)  # a jagg_frac rounded to every or no window: one line, once

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        trainable = {n for n, _ in self._trainable_named_parameters()}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        if "hyper_parameters" in checkpoint:  # plain data only, so weights_only=True can load it
            checkpoint["hyper_parameters"] = state.plain(dict(checkpoint["hyper_parameters"]))
        checkpoint["jagg"] = state.jagg_section(self.policy, self.ema, self.rollouts_done, self._step_rng) | {
            "nonfinite": self.updater.guard.state_dict(),  # the running count of skipped updates
            "objective": self.updater.objective_state()}  # e.g. DiffusionNFT's theta_old

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        try:  # the path the Trainer loads, for the error that names it (load_from_checkpoint: no Trainer)
            ckpt_path = self.trainer.ckpt_path
        except RuntimeError:
            ckpt_path = None
        state.check_checkpoint_adapter(checkpoint, self.policy, {n for n, _ in self._trainable_named_parameters()},
                                       ckpt_path)
        extra = checkpoint.get("jagg", {})
        self.rollouts_done = int(extra.get("rollouts", checkpoint.get("global_step", 0)))
        self.updater.guard.load_state_dict(extra.get("nonfinite", {}))
        self.updater.load_objective_state(extra.get("objective", {}))
        if self.ema is not None and extra.get("ema") is not None:
            self.ema.load_state_dict(extra["ema"])
            self._ema_restored = True
        state.restore_rng(extra.get("rng"))
