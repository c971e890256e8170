"""The scenes recipe in several sittings: a checkpoint of the transformer stage every N steps, and a bit-identical
continuation from it (``--checkpoint-every``, ``--stop-at``, ``--resume``).

A sitting's checkpoint (``<out>.sitting.pt`` beside the folder the run will write) holds everything the transformer
stage's next step depends on: the transformer's and text encoders' weights, AdamW's moments, the learning-rate
schedule's step, the EMA's shadow weights, the batch generator's and torch's global random states, the step, the
loss history and the learning curves -- plus the trained VAE (so a later sitting skips that stage) and the
arguments of the run. The data are not saved: they are rendered and encoded again from the same seed (the same
pixels, the same latents). Continuing on the same machine kind with the same ``--threads`` gives the weights an
uninterrupted run gives, bit for bit (``tests/training/test_scenes_recipe.py``); other arguments than where to stop
and how often to checkpoint are refused, since they would change the run -- except ``--dit-steps`` under a constant
rate (:func:`extendable`): a run may be lengthened, or ended sooner, as long as its steps so far stay the same.

Written crash-safely (:func:`~jagg_lightning.faults.io.atomic_write`), read with ``weights_only=True``.
"""

from __future__ import annotations

from pathlib import Path

import torch

# arguments a later sitting may change: where it stops, how often it saves, that it resumes, how it evaluates
SITTING_ARGUMENTS = ("stop_at", "checkpoint_every", "resume", "out")


def sitting_path(out: str | Path) -> Path:
    """Where the run writing ``out`` keeps its sitting's checkpoint."""
    out = Path(out)
    return out.parent / f"{out.name}.sitting.pt"


def run_arguments(args) -> dict:
    """The arguments that define the run (those a sitting must share)."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in SITTING_ARGUMENTS}


def save_sitting(path: Path, *, args, step: int, modules, opt, sched, ema, gen: torch.Generator, record: dict,
                 vae) -> None:
    """The transformer stage's whole state after ``step`` steps (module docstring), written atomically."""
    from jagg_lightning.faults.io import atomic_write

    state = {
        "arguments": run_arguments(args), "step": step,
        "modules": [m.state_dict() for m in modules], "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "ema": [s.clone() for s in ema.shadow], "generator": gen.get_state(), "torch_rng": torch.get_rng_state(),
        "record": record, "vae": vae.state_dict(),
        "vae_factors": [float(vae.config.shift_factor), float(vae.config.scaling_factor)],
    }
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_sitting(path: Path, args) -> dict:
    """The checkpoint at ``path``, refused (SystemExit naming the argument) when it is missing or ``args`` change
    the run it came from."""
    if not path.exists():
        raise SystemExit(f"--resume: no checkpoint {path} (a run writes it with --checkpoint-every N)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved, now = state["arguments"], run_arguments(args)
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if changed == ["dit_steps"] and extendable(saved, now):
        changed = []  # a constant-rate run may be lengthened: no step before the new end depends on it
    if changed:
        details = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise SystemExit(f"--resume: the checkpoint {path} was written by another run ({details}); give the "
                         f"same arguments (only {', '.join('--' + a.replace('_', '-') for a in SITTING_ARGUMENTS)} "
                         f"may change)")
    return state


def extendable(saved: dict, now: dict) -> bool:
    """Whether a run of ``saved`` arguments may continue to another ``dit_steps``: under a constant rate after a
    warm-up of min(200, steps / 10) steps, nothing but the end depends on the total once both totals give the
    same warm-up (>= 2,000 steps)."""
    return (saved["lr_schedule"] == now["lr_schedule"] == "constant"
            and min(200, saved["dit_steps"] // 10) == min(200, now["dit_steps"] // 10))


def restore_sitting(state: dict, *, modules, opt, sched, ema, gen: torch.Generator) -> int:
    """Load ``state`` into the stage's parts; returns the step to continue from."""
    for m, saved in zip(modules, state["modules"]):
        m.load_state_dict(saved)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    with torch.no_grad():
        for s, saved in zip(ema.shadow, state["ema"]):
            s.copy_(saved)
    gen.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def restore_vae(vae, state: dict) -> None:
    """The sitting's trained VAE (weights and latent factors) into ``vae``."""
    vae.load_state_dict(state["vae"])
    vae.register_to_config(shift_factor=state["vae_factors"][0], scaling_factor=state["vae_factors"][1])
    vae.eval().requires_grad_(False)
