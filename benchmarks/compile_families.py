"""``policy.compile: repeated_blocks`` on every family's tiny twin, CPU inductor, float32: which blocks are compiled,
and the compiled policy's velocity (without and with grad) and LoRA gradient against the eager policy's (relative
errors), one thread. Not a test (each family's compile takes minutes on a 2-core machine); run it by hand:

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/compile_families.py [family ...] > compile_families.jsonl

One JSON line per family: ``blocks`` (how many compiled), ``classes`` (their class names: a family's declared
``_repeated_blocks``, or SD3's block list), the three relative errors, wall seconds (the compiles, mostly) and
torch's compile counters after it (cumulative over the process: families sharing a block class reuse its graphs).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support"), str(REPO / "tests" / "families")]

from helpers import randomize_lora_b, rel_error, tiny_policy_config  # noqa: E402
from test_cfg_one_batch import FAMILIES, PROMPTS  # noqa: E402  (each family's twin with guidance on)

from jagg_lightning.models.compiling import compile_counts, compile_policy  # noqa: E402
from jagg_lightning.policies import build_policy  # noqa: E402

FAMILIES = dict(FAMILIES, flux=dict(lora_targets=None, guidance_scale=3.5), sd35=None)


def make(family: str, compile: str | None):
    if family == "sd35":
        from jagg_lightning.policies.sd3 import build_tiny_sd3_pipeline

        policy = build_policy(tiny_policy_config(family="sd3", guidance_scale=4.0, compile=compile),
                              pipeline=build_tiny_sd3_pipeline(0, sd35=True))
    else:
        policy = build_policy(tiny_policy_config(family=family, compile=compile, **FAMILIES[family]))
    for i, network in enumerate(policy.trained_networks().values()):
        randomize_lora_b(network, torch.Generator().manual_seed(i))
    return policy


def measure(family: str) -> dict:
    start = time.time()
    eager, compiled = make(family, None), make(family, "repeated_blocks")
    blocks = compile_policy(compiled)
    cond = eager.encode_prompts(PROMPTS)
    gen = torch.Generator().manual_seed(0)
    z, t = torch.randn(2, *eager.latent_shape, generator=gen), torch.rand(2, generator=gen)
    if family == "wan22":  # one sample per expert
        t = torch.tensor([0.95, 0.5])
    with torch.no_grad():
        nograd = rel_error([compiled.velocity(z, t, cond).float()], [eager.velocity(z, t, cond).float()])
    outputs = []
    for policy in (eager, compiled):
        v = policy.velocity(z, t, cond)
        v.float().square().mean().backward()
        # a LoRA weight the twin's forward does not reach (Qwen-Image's) has no gradient: zero
        outputs.append((v.detach().float(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                                             for p in policy.lora_parameters()]))
    return dict(family=family, blocks=len(blocks), classes=sorted({type(b).__name__ for b in blocks}),
                nograd_velocity=nograd, grad_velocity=rel_error([outputs[1][0]], [outputs[0][0]]),
                gradient=rel_error(outputs[1][1], outputs[0][1]), seconds=round(time.time() - start),
                counts=compile_counts())


def main() -> None:
    torch.set_num_threads(1)
    for family in sys.argv[1:] or list(FAMILIES):
        try:
            print(json.dumps(measure(family)), flush=True)
        except Exception as err:  # a family that does not compile: reported, the others still run
            print(json.dumps(dict(family=family, error=f"{type(err).__name__}: {str(err)[:500]}")), flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    main()
