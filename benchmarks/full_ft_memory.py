"""Memory of a full fine-tune on the CPU, measured against the formula docs/distributed.md plans with.

For the tiny SD3 twin (and the 14M-parameter twin of whole_step.py with ``--model 14m``), LoRA and full:
bytes of the transformer's weights, the trainable weights, their gradients after a backward, the AdamW state
after a step, the frozen reference copy (bf16 compute: full FT with KL), and the activations one sample's
forward with grad keeps for its backward (``Sampler.activation_bytes``: an exact step's pass; a batched JAGG
window keeps two). The formula: masters 4 T, gradients 4 T, AdamW 8 T, reference 2 T (bf16), all / P under
FSDP2. Not a test: it measures and prints.

    python benchmarks/full_ft_memory.py [--model 14m]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(pretrained, trainable: str, dtype: str) -> dict:
    from jagg_lightning import SamplingConfig
    from jagg_lightning.models.reference import attach_reference
    from jagg_lightning.policies import PolicyConfig, build_policy
    from jagg_lightning.training.sampler import Sampler

    extra = {"trainable": "full"} if trainable == "full" else {}
    policy = build_policy(PolicyConfig(pretrained=pretrained, guidance_scale=1.0, max_sequence_length=4, dtype=dtype,
                                       **extra))
    reference = attach_reference(policy, kl_beta=0.1)
    params = policy.lora_parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    sampler = Sampler(policy, SamplingConfig(num_steps=4, group_size=2), kl_beta=0.1)
    cond = policy.encode_prompts(["a cat"])
    z = torch.randn(1, *policy.latent_shape)
    policy.velocity(z, torch.tensor([0.5]), cond).float().square().mean().backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if t.ndim]
    base = [p for p in policy.transformer.parameters() if not p.requires_grad]
    return {"T (transformer params)": sum(p.numel() for p in policy.transformer.parameters()),
            "frozen weights MB": nbytes(base) / 2**20, "trainable weights MB": nbytes(params) / 2**20,
            "gradients MB": nbytes([p.grad for p in params]) / 2**20, "AdamW state MB": nbytes(state) / 2**20,
            "reference copy MB": 0.0 if reference is None else nbytes(list(reference.parameters())) / 2**20,
            "activations / sample MB": sampler.activation_bytes() / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("tiny", "14m"), default="tiny")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        pretrained = None
        if args.model == "14m":
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from whole_step import build_14m

            pretrained = str(Path(tmp) / "sd3-14m")
            build_14m(Path(pretrained))
        rows = {mode: measure(pretrained, mode, args.dtype) for mode in ("lora", "full")}
    T = rows["full"]["T (transformer params)"]
    print(f"model {args.model}, policy.dtype {args.dtype}, T = {T / 1e6:.2f} M")
    print("| quantity | LoRA | full | full formula |")
    print("|---|---|---|---|")
    formula = {"trainable weights MB": 4 * T, "gradients MB": 4 * T, "AdamW state MB": 8 * T,
               "reference copy MB": 2 * T if args.dtype in ("bfloat16", "float16") else 4 * T}
    for key in rows["full"]:
        if key.startswith("T "):
            continue
        f = formula.get(key)
        print(f"| {key} | {rows['lora'][key]:.3f} | {rows['full'][key]:.3f} | {'' if f is None else f'{f / 2**20:.3f}'} |")
    print(f"activations full / LoRA: {rows['full']['activations / sample MB'] / rows['lora']['activations / sample MB']:.2f}")


if __name__ == "__main__":
    main()
