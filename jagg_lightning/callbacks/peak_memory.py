"""Peak device memory of every training step against ``jagg plan``'s prediction, on CUDA (``memory/*``); elsewhere
nothing: no metric, no summary line."""

from __future__ import annotations

import lightning as L
import torch

from jagg_lightning.memory_plan import Setup, plan_memory

GiB = 2 ** 30


def plan_setup(trainer, pl_module, device_memory_gib: float) -> Setup:
    """The :class:`~jagg_lightning.memory_plan.Setup` ``jagg plan`` reads from a fit config, here from the running
    Trainer: its processes, its strategy (``FSDP2Strategy``: sharded, ``cpu_offload``; context ranks), the optimizer's
    float32 states per weight, EMA and the reward workers."""
    strategy = trainer.strategy
    context = int(getattr(strategy, "context_parallel_size", 1) or 1)
    sharded = type(strategy).__name__ in ("FSDP2Strategy", "ModelParallelStrategy")
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    states = 2  # AdamW's moments (what jagg plan assumes of an optimizer it does not know)
    if isinstance(optimizer, torch.optim.SGD):
        states = 1 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    return Setup(devices=trainer.world_size, device_memory_gib=device_memory_gib,
                 strategy="fsdp2" if sharded else "ddp" if trainer.world_size > 1 else "single",
                 cpu_offload=bool(getattr(strategy, "cpu_offload", False)), context=context, optimizer_states=states,
                 ema=getattr(pl_module, "ema_decay", None) is not None,
                 reward_workers=int(getattr(pl_module, "reward_workers", 0)))


def planned_peak(trainer, pl_module, device_memory_gib: float = 80.0) -> float:
    """``jagg plan``'s peak bytes per device for the module's config as this Trainer runs it."""
    datamodule = getattr(trainer, "datamodule", None)
    prompts = int(getattr(datamodule, "batch_size", 1) or 1)
    return plan_memory(pl_module.policy_config, pl_module.sampling, pl_module.grpo, pl_module.jagg, pl_module.memory,
                       prompts, plan_setup(trainer, pl_module, device_memory_gib)).peak


class PeakMemory(L.Callback):
    """The device's peak allocated memory per training step (``memory/peak_gib``, ``torch.cuda.max_memory_allocated``
    since the step began) and ``jagg plan``'s prediction for this config (``memory/planned_gib``), to every logger;
    the run's peak against the plan in the closing summary (``RunSummary``). On CUDA only: on a CPU (or any other
    device) it logs nothing and adds no summary line. The ``jagg`` CLI adds it to every fit.

    The plan counts the training step (weights, LoRA, optimizer state, the update's activations, the kept graphs); the
    measured peak counts whatever the process allocated (the VAE decode and a local reward model too), so a peak above
    the plan by about those is expected. The plan is traced at the start of training (meta device: seconds for the
    test beds, minutes for a 12B transformer); ``plan=False`` skips it and logs the peak alone.

    Args:
        plan (bool): Trace the prediction of `jagg plan` at the start of training (default True).
    """

    def __init__(self, plan: bool = True):
        super().__init__()
        self.plan = plan
        self.device: torch.device | None = None
        self.peak = 0  # bytes, the run's highest step peak
        self.planned: float | None = None  # bytes
        self.unplanned = ""  # why there is no plan (a family jagg plan cannot trace)

    def on_train_start(self, trainer, pl_module) -> None:
        self.device, self.peak, self.planned, self.unplanned = None, 0, None, ""
        if pl_module.device.type != "cuda" or not torch.cuda.is_available():
            return
        self.device = pl_module.device
        if self.plan:
            total = torch.cuda.get_device_properties(self.device).total_memory / GiB
            try:
                self.planned = planned_peak(trainer, pl_module, total)
            except Exception as err:  # noqa: BLE001 -- a family jagg plan cannot trace: the run goes on, measured
                self.unplanned = f"{type(err).__name__}: {err}".splitlines()[0][:120]
        torch.cuda.reset_peak_memory_stats(self.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.device is None:
            return
        step_peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = max(self.peak, step_peak)
        values = {"memory/peak_gib": step_peak / GiB}
        if self.planned is not None:
            values["memory/planned_gib"] = self.planned / GiB
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)

    def summary_line(self) -> str | None:
        """``peak X GiB of Y GiB planned (jagg plan; ratio R)`` -- None where nothing was measured (not on CUDA)."""
        if self.device is None or not self.peak:
            return None
        measured = f"peak {self.peak / GiB:.1f} GiB"
        if self.planned:
            return f"{measured}, jagg plan {self.planned / GiB:.1f} GiB (measured / planned {self.peak / self.planned:.2f})"
        return measured + (f" (no plan: {self.unplanned})" if self.unplanned else "")


__all__ = ["PeakMemory", "planned_peak", "plan_setup"]
