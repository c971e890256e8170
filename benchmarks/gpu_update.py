"""Time and peak memory of one GRPO update on an SD3.5-Medium-sized transformer (or Wan2.1 1.3B video): exact vs JAGG.

A random-weight ``SD3Transformer2DModel`` with SD3.5 Medium's configuration (2.5 B parameters, 24
joint blocks, 13 of them dual-attention), bf16 frozen weights, a float32 peft LoRA on Flow-GRPO's
targets (r 32, alpha 64), random prompt embeddings of the real shapes (333 x 4096 tokens, pooled 2048).
Nothing is downloaded. For each setting one SDE rollout is shared by every configuration; the update
(all window gradients over ``--samples`` samples, first update after the rollout, the module's own
engine and loss) then runs for exact GRPO (jagg_frac 0) and JAGG (every full window routed),
interleaved and repeated; the median wall time, the process CPU time and the peak GPU memory of the
update are printed, with the backward / forward passes the engine counted.

    python benchmarks/gpu_update.py                   # on a GPU: the SD3.5-Medium-sized table
    python benchmarks/gpu_update.py --tiny            # on a CPU: the same code on the tiny test model
    python benchmarks/gpu_update.py --gradient-checkpointing --repeats 5
    python benchmarks/gpu_update.py --cfg 4.5         # classifier-free guidance: two forwards' batch per velocity
    python benchmarks/gpu_update.py --full            # every weight trained (fp32 masters, bf16 autocast)
    python benchmarks/gpu_update.py --model wan21_1_3b --gradient-checkpointing   # video: Wan2.1-T2V-1.3B
    python benchmarks/gpu_update.py --model wan21_1_3b --tiny                     # its code path on a CPU
    torchrun --nproc_per_node 2 benchmarks/gpu_update.py --model wan21_1_3b --context-parallel 2 \
        --context-kind ring --attention-backend _native_cudnn                     # context parallel, 2 GPUs
    torchrun --nproc_per_node 2 benchmarks/gpu_update.py --model wan21_1_3b --tiny --context-parallel 2  # CPU

``--context-parallel C`` (under ``torchrun --nproc_per_node C``, one GPU per rank): the transformer runs under
diffusers' context parallelism (``jagg_lightning.distributed.context_parallel``; ``--context-kind`` ulysses or ring, ring needing
an attention backend that returns the log-sum-exp: ``--attention-backend _native_cudnn``, ``_native_flash`` or
``flash``). Every rank holds the same rollout (the same seeds); the update's gradients are summed over the context
ranks inside the timed region (the one all-reduce a training step makes). Before the table, rank 0 prints the
relative error of one velocity and of its LoRA gradient under context parallelism against the same model without it.
SD3.5 has no ``_cp_plan`` in diffusers and is refused.

``--model wan21_1_3b``: a random-weight ``WanTransformer3DModel`` with Wan2.1-T2V-1.3B's configuration (1.4 B
parameters, 30 blocks of width 1536), bf16, a float32 LoRA (r 64, configs/wan21_t2v_1_3b.yaml) on the family's
targets, random UMT5 embeddings of the real shape (512 x 4096), the preset's 480 x 832 px and 81 frames: latents
[16, 21, 60, 104], 32 760 video tokens per sample; 2 samples per update by default (one sample's activations
without gradient checkpointing are tens of GiB at this size).

A configuration that runs out of GPU memory prints "OOM" in its row and the table goes on (at 1024 px
the batched JAGG anchors of 8 samples can exceed one GPU: try --low-memory, --gradient-checkpointing
or fewer --samples).

Not a test: it measures, it does not assert.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from jagg_lightning.method.grpo import StepRecord, step_loss
from jagg_lightning.method.jagg import accumulate_gradients, plan_windows
from jagg_lightning.method.routing import interpolation_residual, route_windows
from jagg_lightning.method.sde import flow_match_sigmas
from jagg_lightning.training.rollout import sample_generators, sample_trajectories

SD35_MEDIUM = dict(  # stabilityai/stable-diffusion-3.5-medium transformer/config.json
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
TINY = dict(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32,
            pos_embed_max_size=16)
LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out"]
# (name, latent shape, sampling steps): 512 px and 1024 px, Flow-GRPO-like step counts
SETTINGS = [("512px 10 steps", (16, 64, 64), 10), ("1024px 10 steps", (16, 128, 128), 10)]
TINY_SETTINGS = [("32px 10 steps", (4, 16, 16), 10), ("32px 16 steps", (4, 16, 16), 16)]
TOKENS = 333  # 77 CLIP + 256 T5 tokens, as the SD3 pipeline concatenates them

WAN21_1_3B = dict(  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)
TINY_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
# configs/wan21_t2v_1_3b.yaml's 480 x 832 px and 81 frames (the VAE's 4x temporal / 8x spatial compression):
# 21 x 30 x 52 = 32,760 tokens per sample
WAN_SETTINGS = [("480x832 81f 10 steps", (16, 21, 60, 104), 10)]
TINY_WAN_SETTINGS = [("32px 9f 10 steps", (4, 3, 4, 4), 10)]
WAN_TOKENS = 512  # UMT5 tokens, WanPipeline's max_sequence_length

# per model: diffusers class, configuration, tiny configuration, settings, text tokens, LoRA targets and rank,
# samples per update
MODELS = {
    "sd35": dict(cls="SD3Transformer2DModel", config=SD35_MEDIUM, tiny=TINY, settings=SETTINGS,
                 tiny_settings=TINY_SETTINGS, tokens=TOKENS, targets=LORA_TARGETS, rank=32, samples=8),
    "wan21_1_3b": dict(cls="WanTransformer3DModel", config=WAN21_1_3B, tiny=TINY_WAN, settings=WAN_SETTINGS,
                       tiny_settings=TINY_WAN_SETTINGS, tokens=WAN_TOKENS, targets=None, rank=64, samples=2),
}


def build_transformer(config: dict, dtype: torch.dtype, device: torch.device, rank: int, checkpointing: bool,
                      full: bool = False, cls: str = "SD3Transformer2DModel", targets=None):
    import diffusers
    from peft import LoraConfig

    torch.manual_seed(0)
    with torch.device(device):
        transformer = getattr(diffusers, cls)(**config)
    # as from_pretrained(torch_dtype=dtype) loads it: the model's _keep_in_fp32_modules (Wan: rope, time embedder,
    # norms, scale_shift_table) stay float32, everything else in dtype
    keep = () if full else (getattr(transformer, "_keep_in_fp32_modules", None) or ())
    for name, p in transformer.named_parameters():
        p.data = p.data.to(torch.float32 if full or any(k in name.split(".") for k in keep) else dtype)
    if full:  # every weight trained: float32 masters, the forward under bf16 autocast (velocity below)
        if checkpointing:
            transformer.enable_gradient_checkpointing()
        return transformer.requires_grad_(True)
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights="gaussian",
                                       target_modules=targets or LORA_TARGETS))
    for name, p in transformer.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
            if "lora_B" in name:  # nonzero B, so both factors get gradients
                p.data.normal_(0, 0.01)
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    return transformer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="sd35",
                        help="sd35: SD3.5 Medium (images); wan21_1_3b: Wan2.1-T2V-1.3B (video, 480x832, 81 frames)")
    parser.add_argument("--tiny", action="store_true", help="the tiny test model on the CPU (checks the script)")
    parser.add_argument("--samples", type=int, help="samples per update (one micro-batch; default 8, Wan 2)")
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, help="default 32 (Flow-GRPO's SD3), Wan 64 (its preset)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--low-memory", action="store_true", help="JAGG anchors as two passes")
    parser.add_argument("--full", action="store_true", help="every weight trainable (float32 masters, bf16 "
                        "autocast on a GPU) instead of the LoRA: policy.trainable full")
    parser.add_argument("--cfg", type=float, default=1.0, help="CFG scale (> 1: conditional and unconditional "
                        "rows in one forward, as SD3's pipeline and the sd35_medium preset)")
    parser.add_argument("--context-parallel", type=int, default=1, help="context degree C (run under torchrun "
                        "--nproc_per_node C): the sequence of every forward split over C ranks")
    parser.add_argument("--context-kind", choices=["ulysses", "ring"], default="ulysses")
    parser.add_argument("--attention-backend", help="diffusers attention backend (ring: _native_cudnn, _native_flash "
                        "or flash; the native SDPA returns no log-sum-exp)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    context = None
    if args.context_parallel > 1:
        import os

        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        from jagg_lightning.distributed.context_parallel import build

        context = build(args.context_parallel, args.context_kind, device, args.attention_backend)
    say = print if context is None or dist.get_rank() == 0 else (lambda *a, **k: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(1)  # CPU: one thread, so wall and CPU time compare
    model = MODELS[args.model]
    video = args.model != "sd35"
    args.samples = args.samples or model["samples"]
    config = model["tiny" if args.tiny else "config"]
    if video:
        from jagg_lightning.policies.wan import WAN_LORA_TARGETS

        model["targets"] = WAN_LORA_TARGETS
    transformer = build_transformer(config, dtype, device, args.lora_rank or model["rank"], args.gradient_checkpointing,
                                    args.full, model["cls"], model["targets"])
    params = [p for p in transformer.parameters() if p.requires_grad]
    total = sum(p.numel() for p in transformer.parameters())
    say(f"transformer {total / 1e6:.1f} M parameters ({sum(p.numel() for p in params) / 1e6:.2f} M {'trained in full' if args.full else 'LoRA'}), "
          f"{dtype}, {device}{' ' + torch.cuda.get_device_name() if cuda else ''}, torch {torch.__version__}, "
          f"gradient checkpointing {args.gradient_checkpointing}, low memory {args.low_memory}, "
          f"{args.samples} samples per update, W = {args.window}, CFG {args.cfg}, median of {args.repeats}, "
          f"{args.model}, context parallel {args.context_parallel} ({args.context_kind})")

    gen = torch.Generator().manual_seed(0)
    n = args.samples
    tokens = model["tokens"] if not args.tiny else 4
    if video:  # UMT5's prompt embeddings only
        cond = (torch.randn(n, tokens, config["text_dim"], generator=gen).to(device, dtype),)
    else:
        cond = (torch.randn(n, tokens, config["joint_attention_dim"], generator=gen).to(device, dtype),
                torch.randn(n, config["pooled_projection_dim"], generator=gen).to(device, dtype))

    negative = tuple(torch.randn(1, *c.shape[1:], generator=gen).to(device, dtype) for c in cond)  # one "" prompt

    def velocity(z, t, c):
        with torch.autocast("cuda", torch.bfloat16, enabled=cuda and args.full):
            return guided_velocity(z, t, c)

    def forward(z, t, c):
        pooled = {} if video else {"pooled_projections": c[1]}  # Wan: UMT5 embeddings only
        return transformer(hidden_states=z.to(dtype), timestep=t.float() * 1000, encoder_hidden_states=c[0],
                           return_dict=False, **pooled)[0]

    def guided_velocity(z, t, c):
        if args.cfg <= 1.0:
            return forward(z, t, c)
        neg = [x.expand(z.shape[0], *x.shape[1:]) for x in negative]  # the same negative prompt for every row
        out = forward(torch.cat([z, z]), torch.cat([t, t]), [torch.cat([a, b]) for a, b in zip(neg, c)])
        v_u, v_c = out.chunk(2)
        return v_u + args.cfg * (v_c - v_u)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def sum_over_context():  # each context rank's gradient is partial: the true one is their sum
        if context is not None:
            flat = torch.cat([p.grad.flatten() for p in params])
            dist.all_reduce(flat)
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))

    if context is not None:  # one velocity and its gradient, without and with context parallelism
        latent0 = (model["tiny_settings" if args.tiny else "settings"])[0][1]
        z = torch.randn(1, *latent0, generator=gen).to(device)
        t, weight = torch.full((1,), 0.7, device=device), torch.randn(1, *latent0, generator=gen).to(device)
        errors = []
        for enabled in (False, True):
            if enabled:
                context.apply([transformer], "wan" if video else "sd3")
            v = velocity(z, t, tuple(c[:1] for c in cond)).float()
            grads = torch.autograd.grad((v * weight).sum(), params)
            if enabled:
                flat = torch.cat([g.flatten() for g in grads])
                dist.all_reduce(flat)
                errors = [float((v.detach() - errors[0]).norm() / errors[0].norm()),
                          float((flat - errors[1]).norm() / errors[1].norm())]
            else:
                errors = [v.detach(), torch.cat([g.flatten() for g in grads])]
        say(f"context parallel {args.context_parallel} ({args.context_kind}, backend {args.attention_backend or 'native'}) "
            f"vs none: velocity relative error {errors[0]:.2e}, LoRA gradient (summed over the context ranks) "
            f"{errors[1]:.2e}")

    header = (f"{'setting':22s} {'configuration':10s} {'update s':>9s} {'cpu s':>7s} {'vs exact':>8s} "
              f"{'peak GiB':>9s} {'backward':>8s} {'grad fwd':>8s} {'nograd fwd':>10s}")
    say(header)
    for name, latent, steps in model["tiny_settings" if args.tiny else "settings"]:
        times = flow_match_sigmas(steps, 3.0).to(device)
        gens = sample_generators(0, 0, range(n // 2), 2)
        with torch.no_grad():
            traj = sample_trajectories(velocity, cond, gens, latent, times,
                                       ["sde"] * steps, 0.7, n, device, torch.float32)
        trained = list(range(steps - 1))
        adv = torch.randn(n, generator=gen).to(device)
        scores = [interpolation_residual(traj.velocities, traj.times, w.steps)
                  for w in plan_windows(trained, args.window)]

        def update(jagg_frac: float):
            windows = route_windows(plan_windows(trained, args.window), scores, jagg_frac, args.window)

            def loss_of_step(k, v):
                rec = StepRecord(traj.latents[k], traj.latents[k + 1], float(traj.times[k]), float(traj.times[k + 1]),
                                 traj.log_probs[k], adv)
                return step_loss(v, rec)[0].mean() / len(trained)

            for p in params:
                p.grad = None
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            sync()
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                records = accumulate_gradients(velocity, traj.latents, traj.times, cond, loss_of_step, windows,
                                               traj.velocities, args.low_memory)
            except torch.cuda.OutOfMemoryError:
                for p in params:
                    p.grad = None
                torch.cuda.empty_cache()
                return None
            sum_over_context()
            sync()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            counts = [sum(getattr(r, k) for r in records) for k in ("backwards", "grad_forwards", "nograd_forwards")]
            return wall, cpu, peak, counts

        configurations = {"exact": 0.0, "jagg": 1.0}
        fits = {c: update(frac) is not None for c, frac in configurations.items()}  # warm-up (kernels, allocator)
        results = {c: [] for c in configurations}
        for _ in range(args.repeats):
            for c, frac in configurations.items():  # interleaved: drift hits both alike
                if fits[c]:
                    results[c].append(update(frac))
        base = statistics.median(r[0] for r in results["exact"]) if fits["exact"] else float("nan")
        for c, rs in results.items():
            if not fits[c]:
                say(f"{name:22s} {c:10s} {'OOM':>9s}")
                continue
            wall = statistics.median(r[0] for r in rs)
            cpu = statistics.median(r[1] for r in rs)
            peak = max(r[2] for r in rs)
            b, g, f = rs[-1][3]
            peak = f"{peak:9.2f}" if cuda else f"{'-':>9s}"
            say(f"{name:22s} {c:10s} {wall:9.3f} {cpu:7.2f} {wall / base:8.2f} {peak} {b:8d} {g:8d} {f:10d}")
        del traj
    if context is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
