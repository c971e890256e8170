"""The consolidated export of a full fine-tune: the trained transformer written the way its family pipeline
loads it. Plain torch, no Lightning.

``save_transformer(policy, dir)`` writes ``dir`` as diffusers' ``save_pretrained`` does: ``config.json`` and
``diffusion_pytorch_model.safetensors`` (sharded as ``diffusion_pytorch_model-0000i-of-0000n.safetensors``
with an index above ``max_shard_size``), so ::

    transformer = <Family>Transformer.from_pretrained(dir)
    pipeline = <FamilyPipeline>.from_pretrained(base, transformer=transformer)

load it (Wan2.2: ``save_transformer(policy, dir2, network="transformer_2")`` too, and ``transformer_2=`` given to
the pipeline). Under FSDP2 each weight is gathered from its shards one at a time (a collective: every rank calls
:func:`transformer_state_dict`) to the CPU and rank 0 writes. The weights are written in the compute dtype
(``policy.dtype``): what the sharded forward computed with; ``dtype`` chooses another.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from jagg_lightning.faults.io import atomic_directory
from jagg_lightning.utils.dtypes import DTYPES
from jagg_lightning.utils.sharding import full_tensor

WEIGHTS_PATTERN = "diffusion_pytorch_model{suffix}.safetensors"  # diffusers' SAFETENSORS_WEIGHTS_NAME, sharded
IDENTITY_FILE = "jagg_full.json"


def full_identity(policy) -> dict:
    """What a full fine-tune's checkpoint only fits: the family, the base model and which modules train."""
    config = policy.config
    base = config.pretrained if config.pretrained is not None else f"tiny-random(seed={config.seed})"
    return {"family": str(policy.family), "base_model": str(base), "trainable": "full",
            "trainable_modules": None if config.trainable_modules is None else sorted(config.trainable_modules)}


def transformer_state_dict(transformer, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Whole CPU copies of every transformer weight and buffer (gathered one at a time under FSDP2: call on
    every rank), cast to ``dtype`` when given."""
    out = {}
    for name, t in transformer.state_dict().items():
        whole = full_tensor(t.detach()).to("cpu", copy=True)
        out[name] = (whole.to(dtype) if dtype is not None and whole.is_floating_point() else whole).contiguous()
    return out


def save_transformer(policy, target: str | Path, weights: dict[str, torch.Tensor] | None = None,
                     dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB",
                     step: int | None = None, network: str = "transformer") -> Path:
    """Write the policy's transformer (or another trained network, ``policy.trained_networks()[network]``: Wan2.2's
    ``transformer_2``) under ``target`` (replaced atomically); ``weights`` from :func:`transformer_state_dict`
    when gathered already (under FSDP2), else taken here."""
    from huggingface_hub import save_torch_state_dict

    dtype = dtype or DTYPES[policy.config.dtype]
    module = policy.trained_networks()[network]
    weights = transformer_state_dict(module, dtype) if weights is None else weights
    target = Path(target)
    with atomic_directory(target) as tmp:  # a failed or killed write leaves the previous export whole
        module.save_config(tmp)
        config = json.loads((tmp / "config.json").read_text())  # FSDP2 renames the class FSDP<Name>
        config["_class_name"] = next(c.__name__ for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_torch_state_dict(weights, tmp, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)
        identity = full_identity(policy) | {"dtype": str(dtype).removeprefix("torch.")}
        (tmp / IDENTITY_FILE).write_text(json.dumps(identity | ({} if step is None else {"global_step": int(step)}),
                                                    indent=2) + "\n")
    return target
