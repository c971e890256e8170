"""The whole training step -- rollout + decode + reward + update -- for exact GRPO and JAGG, fused and unfused.

Each (configuration, repeat) runs in its own process, so its peak memory can be read (Linux VmHWM,
reset before the timed step); the repeats are interleaved round by round, so drift on a shared machine
hits every configuration alike. One thread. A process runs three real ``Trainer`` steps of the JPEG
reward on the same prompts; the second (warm caches) is timed and split into phases by wrapping the
module's own methods, the third measures memory:

* ``sample``: the rollout's transformer calls and SDE math (in the fused mode: with grad at the kept steps),
* ``kl ref``: the adapter-off reference forwards (taken inside the rollout, ``--kl-beta`` > 0),
* ``decode`` / ``reward``: the VAE and the reward,
* ``update``: the window gradients (forwards with grad, backward passes) and ``optim``: the optimizer step.

Reported: min and median of process CPU time (the number to compare on a shared machine), median wall
time, the ratio of the median CPU time to exact's, the share of each phase, the transformer passes the
module logged, and the peak of the activations autograd holds for backward during the step (every
tensor saved for backward, frozen weights excluded, counted from pack to release by saved-tensor hooks:
the device-independent part of peak memory; the hooks' Python cost is why this is a separate step).
Not a test: run it by hand:

    python benchmarks/whole_step.py --model tiny --repeats 3
    python benchmarks/whole_step.py --model 14m --repeats 3 [--kl-beta 0.04]
    python benchmarks/whole_step.py --model wan --only exact W=4 --repeats 3   # the video twin
    python benchmarks/whole_step.py --model 14m --only exact W=4 --compile --repeats 2
    python benchmarks/whole_step.py --model 14m --only exact W=4 --trained 4 --steps 15 --flash 2 --repeats 3

``--trained T`` trains the first T of the sampling steps and samples the rest as an ODE tail (``trained_steps`` with
``ode_after_trained``: Flow-GRPO-Fast / the digits job's shape); ``--flash n`` then runs every configuration also
with that tail in n DPM-Solver++(2M) steps (``sampling.ode_steps`` / ``ode_solver``: MixGRPO-Flash, docs/method.md
section 7), side by side.

``--compile`` runs every configuration twice, eager and with ``policy.compile: repeated_blocks`` (each transformer
block compiled by inductor, docs/method.md section 7), side by side. The timed step is the second, after every
compile (the first step compiles; the dynamo counters are read after each step to show the second and third compile
nothing); the one-off cost is reported as the first step's CPU time, each compiled process starting from an empty
inductor cache (``TORCHINDUCTOR_CACHE_DIR``: a fresh job's cold compile, not a warm on-disk cache's) and compiling in
its own process (``TORCHINDUCTOR_COMPILE_THREADS=1``), so the first step's CPU time counts the compiler's gcc runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "exact": dict(jagg_frac=0.0),
    "W=4": dict(window_size=4, jagg_frac=1.0),
    "W=4 chained": dict(window_size=4, jagg_frac=1.0, chained=True),
    "W=8": dict(window_size=8, jagg_frac=1.0),
}
KL_CONFIGS = {  # with --kl-beta > 0 only: the approximation of docs/method.md section 7
    "W=4 interpolated ref": dict(window_size=4, jagg_frac=1.0, interpolate_reference=True),
}
PHASES = ("sample", "kl ref", "decode", "reward", "update", "optim")


def build_14m(path: Path) -> None:
    """The tiny pipeline with a 14M-parameter SD3 transformer (6 joint blocks of width 256) in its place."""
    from diffusers import SD3Transformer2DModel

    from jagg_lightning.policies.sd3 import build_tiny_sd3_pipeline

    pipe = build_tiny_sd3_pipeline(0)
    pipe.transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=6, attention_head_dim=32,
        num_attention_heads=8, joint_attention_dim=32, caption_projection_dim=256, pooled_projection_dim=32,
        pos_embed_max_size=16,
    )
    pipe.save_pretrained(path)


# the video twin (--model wan): a Wan2.1-shaped pipeline whose transformer is large enough that the backward
# dominates; its frames x tokens: 17 frames at 64 px -> 5 latent frames x 4 x 4 patches = 80 video tokens per sample
WAN_FRAMES, WAN_RESOLUTION = 17, 64


def build_wan(path: Path) -> None:
    """The tiny Wan2.1 twin (UMT5, Wan VAE) with a 6.9M-parameter ``WanTransformer3DModel`` (6 blocks of width 256,
    (1, 2, 2) patches) in its place."""
    from diffusers import WanTransformer3DModel

    from jagg_lightning.policies.wan import TINY_Z_DIM, build_tiny_wan_pipeline

    pipe = build_tiny_wan_pipeline(0)
    pipe.transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=TINY_Z_DIM,
        out_channels=TINY_Z_DIM, text_dim=16, freq_dim=64, ffn_dim=1024, num_layers=6, rope_max_seq_len=32)
    pipe.save_pretrained(path)


def child(args) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
    from jagg_lightning.data import PromptDataModule
    from jagg_lightning.memory_plan.trace import SavedTensorPeak, weight_keys
    from jagg_lightning.models.compiling import compile_counts
    from jagg_lightning.policies import PolicyConfig

    torch.set_num_threads(1)
    video = args.model == "wan"
    reward = "jpeg_compressibility"
    if video:  # a video: the JPEG reward on three frames (first, middle, last), as configs/wan_tiny.yaml
        from jagg_lightning.rewards import FrameReward

        reward = FrameReward("jpeg_compressibility", frames=3)
    module = JAGGModule(
        PolicyConfig(pretrained=args.pretrained, guidance_scale=args.guidance, max_sequence_length=4,
                     compile="repeated_blocks" if args.compiled else None,
                     **({"trainable": "full"} if args.full else {"lora_rank": 8, "lora_alpha": 16}),
                     **({"family": "wan", "num_frames": WAN_FRAMES, "resolution": WAN_RESOLUTION} if video else {})),
        SamplingConfig(num_steps=args.steps + 1, group_size=args.samples // 2, rollout_batch_size=args.samples,
                       **({"trained_steps": args.trained, "ode_after_trained": True} if args.trained else {}),
                       **({"ode_steps": args.flashed, "ode_solver": "dpmpp_2m"} if args.flashed else {})),
        GRPOConfig(train_batch_size=args.samples, kl_beta=args.kl_beta, adv_std="group"),  # as measured; fused needs it
        JAGGConfig(**({"window_size": 4} | (CONFIGS | KL_CONFIGS)[args.config] | {"fused_rollout": args.fused})),
        reward=reward,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
    )
    module.configure_model()
    spent = {p: [0.0, 0.0] for p in PHASES}

    def timed(obj, name, phase):
        inner = getattr(obj, name)

        def wrapper(*a, **kw):
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent[phase][0] += time.process_time() - cpu
                spent[phase][1] += time.perf_counter() - wall

        setattr(obj, name, wrapper)

    # the parts look these up at call time, so wrapping the objects' attributes times every call
    for obj, name, phase in [(module.policy, "decode", "decode"), (module.sampler, "score", "reward"),
                             (module.sampler, "reference_velocity", "kl ref"), (module.updater, "engine_pass", "update"),
                             (module, "step_optimizer", "optim")]:
        timed(obj, name, phase)

    weights = weight_keys(module.policy)  # the tracker `jagg plan` is validated with (storages counted once)

    def cpu_with_children() -> float:  # inductor runs gcc in child processes (waited for: compile_threads 1)
        times = os.times()
        return time.process_time() + times.children_user + times.children_system

    class StepTimer(Callback):
        # the first step's CPU time with its compiler processes, and wall time; frames compiled per step
        first_cpu, first_wall, compiles = 0.0, 0.0, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.counts, self.cpu_children = compile_counts()["frames"], cpu_with_children()
            for p in spent:
                spent[p] = [0.0, 0.0]
            if batch_idx == 2:  # the memory step
                self.tracker = SavedTensorPeak(weights)
                self.hooks = torch.autograd.graph.saved_tensors_hooks(self.tracker.pack, self.tracker.unpack)
                self.hooks.__enter__()
            self.cpu, self.wall = time.process_time(), time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.compiles = self.compiles + [compile_counts()["frames"] - self.counts]
            if batch_idx == 0:
                self.first_cpu, self.first_wall = cpu_with_children() - self.cpu_children, time.perf_counter() - self.wall
            if batch_idx == 1:
                self.result = dict(cpu=time.process_time() - self.cpu, wall=time.perf_counter() - self.wall,
                                   phases={p: v[0] for p, v in spent.items()},
                                   passes={k[len("train/passes/"):]: float(v) for k, v in trainer.callback_metrics.items()
                                           if k.startswith("train/passes/")})
            if batch_idx == 2:
                self.hooks.__exit__(None, None, None)
                self.result["activation_peak_mb"] = self.tracker.peak / 2**20

    timer = StepTimer()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    prompts = [f"prompt {i}" for i in range(2)]
    trainer.fit(module, PromptDataModule(prompts=prompts * 3, batch_size=2, shuffle=False))
    result = timer.result
    result.update(first_step_cpu=timer.first_cpu, first_step_wall=timer.first_wall, compiles=timer.compiles)
    result["phases"]["sample"] = result["cpu"] - sum(v for p, v in result["phases"].items() if p != "sample")
    print("RESULT " + json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("tiny", "14m", "wan"), default="tiny",
                        help="wan: the video twin (Wan2.1-shaped, 17 frames at 64 px, a 6.9M-parameter transformer)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8, help="samples per step (2 prompts x samples/2)")
    parser.add_argument("--steps", type=int, default=16, help="trained steps (sampling steps - 1)")
    parser.add_argument("--guidance", type=float, default=1.0)
    parser.add_argument("--kl-beta", type=float, default=0.0)
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--full", action="store_true", help="policy.trainable full (every weight) instead of LoRA")
    parser.add_argument("--only", nargs="+", help="only these configurations (names as in the table)")
    parser.add_argument("--compile", action="store_true",
                        help="each configuration eager and with policy.compile: repeated_blocks, side by side")
    parser.add_argument("--trained", type=int, default=None,
                        help="train only the first T sampling steps, the rest an ODE tail (default: every SDE step)")
    parser.add_argument("--flash", type=int, default=None,
                        help="with --trained: each configuration also with the tail in n DPM-Solver++(2M) steps")
    parser.add_argument("--flashed", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--fused", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pretrained", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flash is not None and not args.trained:
        parser.error("--flash needs --trained (an ODE tail to shorten)")
    if args.config:
        return child(args)

    with tempfile.TemporaryDirectory() as tmp:
        pretrained = None
        if args.model in ("14m", "wan"):
            pretrained = str(Path(tmp) / args.model)
            (build_14m if args.model == "14m" else build_wan)(Path(pretrained))
        names = list(CONFIGS) + (list(KL_CONFIGS) if args.kl_beta > 0 else [])
        names = [n for n in names if args.only is None or n in args.only]
        runs = [(name, fused, compiled, flashed) for name in names for fused in (False, True)
                for compiled in ((False, True) if args.compile else (False,))
                for flashed in ((None, args.flash) if args.flash else (None,))]
        results = {run: [] for run in runs}
        for repeat in range(args.repeats):
            for name, fused, compiled, flashed in runs:
                cmd = [sys.executable, __file__, "--config", name, "--model", args.model, "--samples", str(args.samples),
                       "--steps",
                       str(args.steps), "--guidance", str(args.guidance), "--kl-beta", str(args.kl_beta)]
                cmd += ["--fused"] if fused else []
                cmd += ["--full"] if args.full else []
                cmd += ["--compiled"] if compiled else []
                cmd += ["--trained", str(args.trained)] if args.trained else []
                cmd += ["--flashed", str(flashed)] if flashed else []
                cmd += ["--pretrained", pretrained] if pretrained else []
                env = os.environ | {"OMP_NUM_THREADS": "1"}
                if compiled:  # an empty inductor cache per process (the cold compile a fresh job pays), compiled in
                    # this process (its gcc children counted in the first step's CPU time)
                    env |= {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=tmp, prefix=f"inductor{repeat}-"),
                            "TORCHINDUCTOR_COMPILE_THREADS": "1"}
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                if out.returncode or not line:
                    raise SystemExit(f"{name} fused={fused} compiled={compiled} flash={flashed} failed:\n"
                                     f"{out.stderr[-3000:]}")
                results[(name, fused, compiled, flashed)].append(json.loads(line[0][len("RESULT "):]))
    report(args, results)
    if args.json:
        args.json.write_text(json.dumps({label(*run): r for run, r in results.items()}, indent=1))


def label(name: str, fused: bool, compiled: bool, flashed: int | None = None) -> str:
    flash = f", 2M tail n={flashed}" if flashed else ""
    return f"{name} {'fused' if fused else 'unfused'}{' compiled' if compiled else ''}{flash}"


def report(args, results) -> None:
    import torch

    base = statistics.median(r["cpu"] for r in results[("exact", False, False, None)])
    trained = f"{args.trained} of {args.steps + 1} sampling steps trained" if args.trained else \
        f"{args.steps} trained steps"
    print(f"{args.model}: {args.samples} samples, {trained}, kl_beta {args.kl_beta}, guidance "
          f"{args.guidance}, torch {torch.__version__}, 1 thread, {args.repeats} repeats (one process each)")
    head = " | ".join(f"{p} %" for p in PHASES)
    extra = " vs eager | first step CPU s | compiles per step |" if args.compile else ""
    extra += " vs exact, same sampler |" if args.flash else ""
    print(f"| configuration | CPU s min | CPU s median | wall s median | vs exact |{extra} {head} | backward | grad fwd "
          f"| fused fwd | ref fwd | activation peak MB |")
    print("|" + "---|" * (10 + len(PHASES) + (3 if args.compile else 0) + (1 if args.flash else 0)))
    for (name, fused, compiled, flashed), rs in results.items():
        cpu = sorted(r["cpu"] for r in rs)
        med = statistics.median(cpu)
        shares = " | ".join(f"{100 * statistics.median(r['phases'][p] / r['cpu'] for r in rs):.0f}" for p in PHASES)
        p = rs[0]["passes"]
        columns = ""
        if args.compile:
            eager = statistics.median(r["cpu"] for r in results[(name, fused, False, flashed)])
            first = statistics.median(r["first_step_cpu"] for r in rs)  # with the compiler's child processes
            columns = f" {med / eager:.2f} | {first:.1f} | {'/'.join(str(c) for c in rs[0]['compiles'])} |"
        if args.flash:  # against exact with the same sampler (the same tail)
            columns += f" {med / statistics.median(r['cpu'] for r in results[('exact', False, compiled, flashed)]):.2f} |"
        flash = f", 2M tail n={flashed}" if flashed else ""
        print(f"| {name}{' fused' if fused else ''}{' compiled' if compiled else ''}{flash} | {cpu[0]:.3f} | {med:.3f} | "
              f"{statistics.median(r['wall'] for r in rs):.3f} | {med / base:.2f} |{columns} {shares} | "
              f"{p.get('backward', 0):.0f} | {p.get('grad_forward', 0):.0f} | {p.get('fused_forward', 0):.0f} | "
              f"{p.get('reference_forward', 0):.0f} | {statistics.median(r['activation_peak_mb'] for r in rs):.2f} |")


if __name__ == "__main__":
    main()
