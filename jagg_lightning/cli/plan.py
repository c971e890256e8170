"""``jagg plan --config X [--devices N] [--device-memory GB] [--context C] [overrides]``: the memory of one training
step of a config per device, before anything is allocated (:mod:`jagg_lightning.memory_plan`).

The config is read as ``jagg fit --config X`` reads it (the same files and ``--model.*`` / ``--trainer.*`` /
``--data.*`` overrides; nothing is built). ``--devices`` defaults to ``trainer.devices x trainer.num_nodes``, the
strategy is the trainer's (``FSDP2Strategy``: sharded, its ``cpu_offload``; DDP otherwise on several devices),
``--context`` to the strategy's ``context_parallel_size`` (1 without one). ``--json``: the plan as one JSON object on
stdout, every row in bytes (:func:`~jagg_lightning.memory_plan.table.as_json`), instead of the table. While it reads
the config and traces, one line per phase goes to stderr (a large model traces for minutes). Exit status: 0 it fits,
1 it does not (the table names what to change), 2 a bad config or argument.
"""

from __future__ import annotations

import json
import sys
import time

from jagg_lightning.utils.strict_args import StrictParser

EPILOG = ("Other arguments are overrides, as for jagg fit (e.g. --model.policy.resolution 512 --trainer.devices 8). "
          "Exit status: 0 fits, 1 does not fit, 2 bad config. Nothing is downloaded or allocated: the model is built "
          "on the meta device from its config.json (shipped for the presets' hub ids, or a local pipeline folder's).")


def arguments() -> StrictParser:
    parser = StrictParser(prog="jagg plan", description="Memory per device of one training step of a "
                                     "config, before launch.", epilog=EPILOG)
    parser.add_argument("--config", action="append", required=True, help="the fit config (YAML); may repeat")
    parser.add_argument("--devices", type=int, help="processes in all (default: trainer.devices x trainer.num_nodes)")
    parser.add_argument("--device-memory", type=float, default=80.0, metavar="GB",
                        help="memory of one device in GiB (default: 80)")
    parser.add_argument("--context", type=int, help="context-parallel degree: context ranks per sample (default: "
                        "the strategy's context_parallel_size, else 1)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object, every row in bytes, "
                        "instead of the table")
    return parser


class Progress:
    """One line on stderr per phase, led by the seconds since the command started (not by ``jagg plan:``, which
    leads its one line of error)."""

    def __init__(self):
        self.start = time.monotonic()

    def __call__(self, what: str) -> None:
        print(f"[{time.monotonic() - self.start:4.0f} s] {what} ...", file=sys.stderr, flush=True)


def _get(namespace, key, default=None):
    value = namespace.get(key, default) if hasattr(namespace, "get") else getattr(namespace, key, default)
    return default if value is None else value


def strategy_of(trainer) -> tuple[str, dict]:
    """("single" | "ddp" | "fsdp2", the strategy's init args) of the trainer section."""
    strategy = _get(trainer, "strategy", "auto")
    if isinstance(strategy, str):
        name = strategy.lower()
        return ("fsdp2" if "fsdp" in name or "model_parallel" in name else "ddp" if "ddp" in name else "auto"), {}
    class_path = str(_get(strategy, "class_path", ""))
    init = dict(_get(strategy, "init_args", {}) or {})
    if class_path.endswith(("FSDP2Strategy", "ModelParallelStrategy", "FSDPStrategy")):
        return "fsdp2", init
    return ("ddp" if "DDP" in class_path else "auto"), init


def devices_of(trainer) -> int:
    devices, nodes = _get(trainer, "devices", 1), int(_get(trainer, "num_nodes", 1))
    if isinstance(devices, (list, tuple)):
        return len(devices) * nodes
    return (int(devices) if str(devices).isdigit() else 1) * nodes


def optimizer_states(optimizer) -> int:
    """float32 states per trainable weight: AdamW / Adam 2 (model.optimizer null: AdamW), SGD 1 with momentum."""
    path = str(_get(optimizer, "class_path", "torch.optim.AdamW")) if optimizer is not None else "torch.optim.AdamW"
    if path.endswith(".SGD"):
        return 1 if float(_get(_get(optimizer, "init_args", {}), "momentum", 0) or 0) else 0
    return 2


def plan_main(argv: list[str], parse_config) -> int:
    """The command (``parse_config``: the CLI's parse of a fit config, :func:`jagg_lightning.cli.parse_config`)."""
    parser = arguments()
    args, rest = parser.parse_known_args(argv)
    for arg in rest:  # the fit config's overrides are dotted (--model.x); an undotted near miss is one of ours
        name = arg.split("=", 1)[0]
        if name.startswith("--") and "." not in name and parser.closest(name):
            print(f"jagg plan: error: {parser.unknown(name)}", file=sys.stderr)
            return 2
    fit_args = [a for c in args.config for a in ("--config", c)] + rest
    progress = Progress()
    progress(f"reading {' + '.join(args.config)} as jagg fit reads it")
    config = parse_config(fit_args)
    try:
        return run(args, config, progress)
    except ValueError as err:
        print(f"jagg plan: error: {err}", file=sys.stderr)
        return 2


def run(args, config, progress=None) -> int:
    from jagg_lightning.config import (GRPOConfig, JAGGConfig, MemoryConfig, PolicyConfig, SamplingConfig, as_config,
                                       check_sections)
    from jagg_lightning.config.old_keys import move_old_keys
    from jagg_lightning.memory_plan import Setup, advise, as_json, plan_memory, render

    model, trainer = config.get("model"), config.get("trainer")
    plain = lambda cls, key: as_config(cls, dict(_get(model, key).items()) if _get(model, key) is not None else None)  # noqa: E731
    policy, sampling, grpo = plain(PolicyConfig, "policy"), plain(SamplingConfig, "sampling"), plain(GRPOConfig, "grpo")
    jagg, memory = plain(JAGGConfig, "jagg"), plain(MemoryConfig, "memory")
    move_old_keys(policy, sampling, jagg, memory)
    check_sections(sampling, grpo, jagg)
    strategy, init = strategy_of(trainer)
    devices = args.devices or devices_of(trainer)
    context = args.context or int(init.get("context_parallel_size") or 1)
    for name, value in (("--devices", devices), ("--context", context), ("--device-memory", args.device_memory)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if devices % context:
        raise ValueError(f"--context {context} must divide the devices ({devices})")
    if strategy == "auto":
        strategy = "ddp" if devices > 1 else "single"
    setup = Setup(devices=devices, device_memory_gib=args.device_memory, strategy=strategy,
                  cpu_offload=bool(init.get("cpu_offload", False)), context=context,
                  optimizer_states=optimizer_states(_get(model, "optimizer")), ema=_get(model, "ema_decay") is not None,
                  reward_workers=int(_get(model, "reward_workers", 0)))
    prompts = int(_get(config.get("data"), "batch_size", 1)) if config.get("data") is not None else 1
    if progress is not None:
        progress(f"building the transformer of {policy.pretrained or 'the twin'} on the meta device")
    plan = plan_memory(policy, sampling, grpo, jagg, memory, prompts, setup, progress=progress)
    plan.suggestions = advise(plan, policy, sampling, grpo, jagg, memory, prompts, progress=progress)
    print(json.dumps(as_json(plan), indent=2) if args.json else render(plan))
    return 0 if plan.fits else 1
