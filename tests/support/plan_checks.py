"""``jagg plan`` on a family's saved twin: the folder, read from its JSON files only (``memory_plan.models.local_spec``),
plans as the twin built on the meta device (``twin_spec``) -- the family tests call it on the twins their fixtures
save, so every family's local-folder reading is checked without saving a twin again."""

import dataclasses

import torch

from jagg_lightning.config import GRPOConfig, JAGGConfig, MemoryConfig, SamplingConfig
from jagg_lightning.memory_plan import Setup, plan_memory
from jagg_lightning.memory_plan.models import model_spec, twin_spec
from jagg_lightning.memory_plan.plan import base_params
from jagg_lightning.policies import PolicyConfig


def assert_folder_plans_as_twin(family: str, folder, size: tuple[int, int], frames: int | None = None,
                                **policy) -> None:
    """The saved twin in ``folder`` and the twin on meta agree on what the plan reads (family, VAE compression, the
    condition images' shapes, the frozen components' and the transformer's parameter counts) and give the same
    traced activations and rows at ``size`` (and ``frames``) -- so a local folder of the family is planned."""
    local = model_spec(PolicyConfig(family=family, pretrained=str(folder), **policy))
    twin = twin_spec(family)
    assert (local.family, local.vae_spatial, local.vae_temporal, local.experts) == \
        (twin.family, twin.vae_spatial, twin.vae_temporal, twin.experts)
    assert local.condition == twin.condition and local.components == twin.components
    assert base_params(local) == base_params(twin) > 0

    def plan(spec):
        config = PolicyConfig(family=family, resolution=list(size), num_frames=frames, **policy)
        sampling = SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=2)
        return plan_memory(config, sampling, GRPOConfig(train_batch_size=2), JAGGConfig(window_size=2), MemoryConfig(),
                           1, Setup(), spec=spec)

    by_folder, by_twin = plan(local), plan(twin)
    assert by_folder.geo == by_twin.geo
    torch.testing.assert_close(torch.tensor([r.bytes for r in by_folder.rows], dtype=torch.float64),
                               torch.tensor([r.bytes for r in by_twin.rows], dtype=torch.float64), rtol=0, atol=0)
    assert by_folder.passes["per_sample_bytes"] > 0


def columns_used(policy, cond, spec):
    """(Qwen2.5-VL tokens, ``spec`` with ByT5's glyph tokens) of HunyuanVideo 1.5's forward on ``cond``: the mask
    columns some row uses (the policy drops the rest; the plan's default is the bound, ``max_sequence_length`` and
    the pipeline's 256 glyph tokens; a prompt quoting no text uses one glyph column)."""
    from jagg_lightning.policies.hunyuan_video15 import used_columns

    k = policy.TEXT_ENTRIES
    glyph = used_columns(cond[3], cond[k + 3]) if len(cond) > k + 3 else used_columns(cond[3])
    text = used_columns(cond[1], cond[k + 1]) if len(cond) > k + 1 else used_columns(cond[1])
    return text, dataclasses.replace(spec, condition=spec.condition | {"glyph_tokens": glyph})
