"""``jagg plan``'s parts on the twins: the planner's shapes and traced activation bytes (fake model, nothing
allocated) against the real policies and ``Sampler.activation_bytes``; and the shipped configs' parameter counts
against the published figures."""

import dataclasses
import math

import pytest
import torch

from jagg_lightning.config import GRPOConfig, JAGGConfig, MemoryConfig, PolicyConfig, SamplingConfig
from jagg_lightning.memory_plan import Setup, plan_memory
from jagg_lightning.memory_plan.models import model_spec, shipped_spec, shipped_specs, twin_spec
from jagg_lightning.memory_plan.plan import base_params
from jagg_lightning.policies import build_policy
from jagg_lightning.models.conditions import ConditionedPrompt
from jagg_lightning.training.sampler import Sampler

from helpers import fresh_seed
from plan_checks import columns_used

TWINS = {  # family -> policy settings of a twin (guided where the family has CFG: both branches traced)
    "sd3": dict(guidance_scale=2.0, lora_targets=["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]),
    "flux": dict(guidance_scale=3.5),
    "flux_kontext": dict(guidance_scale=3.5),  # the source's tokens after the latent's: twice the sequence
    "flux2": dict(guidance_scale=4.0),
    "flux2_dev": dict(guidance_scale=4.0),  # embedded guidance: one branch traced
    "wan": dict(guidance_scale=3.0),
    "wan22": dict(guidance_scale=3.0, guidance_scale_2=2.0),
    "qwen_image": dict(guidance_scale=1.0),
    # the conditioned families: their images' tokens and latents in the transformer's inputs, both CFG branches
    "qwen_image_edit": dict(guidance_scale=4.0),  # the source's 1,024 tokens after the latent's 4
    "z_image": dict(guidance_scale=5.0),
    "wan_i2v": dict(guidance_scale=3.0, max_sequence_length=512),  # 36 input channels, 17 CLIP tokens beside the text
    "wan22_ti2v": dict(guidance_scale=3.0),  # the image's latent frame first, per-token timesteps
    "ltx2": dict(guidance_scale=3.0, max_sequence_length=16),  # the joint video + audio latent, both streams
    "ltx2_i2v": dict(guidance_scale=3.0, max_sequence_length=16),  # the first frame's tokens first, at timestep 0
    # the condition latent + mask beside z, ByT5's glyph tokens and one zero image token (text-to-video: the forward's
    # branch on torch.all(image_embeds == 0) and its masked reorder decided by the trace) or SigLIP's 16
    "hunyuan_video15": dict(guidance_scale=6.0, max_sequence_length=16),
    "hunyuan_video15_i2v": dict(guidance_scale=6.0, max_sequence_length=16),
}
TEXT_AS_ENCODED = ("qwen_image", "qwen_image_edit", "z_image")  # the condition as long as the prompt (the plan: a bound)
COLUMNS_AS_USED = ("hunyuan_video15", "hunyuan_video15_i2v")  # padding no row uses is dropped (the plan: the bound)


def _plan(policy_config, text_tokens=None, spec=None, **setup):
    sampling = SamplingConfig(num_steps=5, group_size=2, rollout_batch_size=2)
    return plan_memory(policy_config, sampling, GRPOConfig(train_batch_size=2), JAGGConfig(window_size=2),
                       MemoryConfig(), 1, Setup(**setup), spec=spec, text_tokens=text_tokens)


@pytest.mark.parametrize("family", sorted(TWINS))
@pytest.mark.parametrize("trainable", ["lora", "full"])
def test_traced_activations_equal_the_real_policys(family, trainable, monkeypatch):
    """The fake model's saved bytes for one sample equal what ``Sampler.activation_bytes`` measures on the real twin
    (same unit: distinct storages saved for backward, weights excluded), and the latent shapes agree. Qwen-Image-Edit's
    source goes to its encoders at 128 x 128 instead of a megapixel, for the policy and the plan alike (both ask
    diffusers' ``calculate_dimensions``; the real area: test_the_edit_plan_counts_the_sources_tokens_...)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    original = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: original(128 * 128, ratio))
    extra = TWINS[family] if trainable == "lora" else {k: v for k, v in TWINS[family].items() if k != "lora_targets"}
    side = 32 if family != "sd3" else 16 * 2 ** (fresh_seed() % 2)  # a resolution other than native, sometimes
    config = PolicyConfig(family=family, trainable=trainable, resolution=side if family == "sd3" else None, **extra)
    policy = build_policy(config)
    sampler = Sampler(policy, SamplingConfig(), 0.0)
    measured = sampler.activation_bytes()  # of the prompt "a" (with grey condition images where the family takes any)
    # Qwen-Image's and Z-Image's conditions are as long as the prompt (the plan's default: the bound,
    # max_sequence_length), Qwen-Image-Edit's with the source's vision tokens (the plan counts them, tested below)
    probe = ConditionedPrompt("a", [torch.full((3, 8, 8), 0.5)] * policy.condition_images[0])
    text = sampler.encode([probe])[0].shape[1] if family in TEXT_AS_ENCODED else None
    spec = None
    if family in COLUMNS_AS_USED:
        text, spec = columns_used(policy, sampler.encode([probe]), twin_spec(family))
    plan = _plan(dataclasses.replace(config), text_tokens=text, spec=spec)
    assert tuple(plan.geo.latent) == tuple(policy.latent_shape)
    predicted = plan.passes["per_sample_bytes"]
    print(f"{family} {trainable}: traced {predicted} B, measured {measured} B ({predicted / measured - 1:+.2%})")
    assert measured > 0 and abs(predicted / measured - 1) < 0.05


def test_a_context_degree_and_fsdp2_divide_what_they_shard():
    config = PolicyConfig(family="wan", guidance_scale=3.0)
    one = _plan(config)
    four = _plan(config, devices=4, strategy="fsdp2")
    cp = _plan(config, devices=4, strategy="fsdp2", context=2)
    rows = lambda plan: {r.name: r.bytes for r in plan.rows}  # noqa: E731
    assert rows(four)["frozen transformer weights"] == pytest.approx(rows(one)["frozen transformer weights"] / 4)
    assert rows(four)["text encoders + VAE (frozen, whole)"] == rows(one)["text encoders + VAE (frozen, whole)"]
    # FSDP2 shards over every process, the context ranks too (the flattened mesh): / 4, not / (4 / 2)
    assert rows(cp)["frozen transformer weights"] == pytest.approx(rows(one)["frozen transformer weights"] / 4)
    act = "activations: exact pass"
    assert rows(cp)[act] == pytest.approx(rows(four)[act] / 2)


def test_the_advice_names_split_anchors_when_both_anchors_do_not_fit():
    """A device that holds one anchor's activations but not both at once (HunyuanVideo 1.5's presets' case): the
    advice names ``memory.anchors: split`` with the peak it gives, which fits."""
    from jagg_lightning.memory_plan import advise
    from jagg_lightning.memory_plan.plan import GiB

    config = PolicyConfig(family="wan", guidance_scale=3.0)
    sampling, grpo, jagg = SamplingConfig(num_steps=5, group_size=2, rollout_batch_size=2), GRPOConfig(
        train_batch_size=2), JAGGConfig(window_size=2, jagg_frac=1.0)
    batched = plan_memory(config, sampling, grpo, jagg, MemoryConfig(), 1, Setup())
    split = plan_memory(config, sampling, grpo, jagg, MemoryConfig(anchors="split"), 1, Setup())
    assert split.peak < batched.peak
    device = Setup(device_memory_gib=(batched.peak + split.peak) / 2 / 0.9 / GiB)
    plan = plan_memory(config, sampling, grpo, jagg, MemoryConfig(), 1, device)
    lines = advise(plan, config, sampling, grpo, jagg, MemoryConfig(), 1)
    assert not plan.fits and any(line.startswith("set memory.anchors: split") and "(fits)" in line for line in lines)


# the published transformer sizes (spec.json says where each is published) and the rounding they are given at
PUBLISHED = {
    "black-forest-labs/FLUX.1-dev": (12e9, 0.5e9),  # "12B"
    "black-forest-labs/FLUX.1-Kontext-dev": (12e9, 0.5e9),  # "12B": FLUX.1-dev's transformer
    "black-forest-labs/FLUX.2-klein-base-4B": (4e9, 0.5e9),  # "4B"
    "black-forest-labs/FLUX.2-dev": (32e9, 0.5e9),  # "32B"
    "Qwen/Qwen-Image": (20e9, 0.5e9),
    "Qwen/Qwen-Image-Edit": (20e9, 0.5e9),  # "20B": Qwen-Image's transformer
    "Tongyi-MAI/Z-Image": (6e9, 0.5e9),  # "6B"
    # "14B" names the Wan2.1 backbone (the T2V config above: 14.29B); the image cross-attention's key / value
    # projections (40 blocks x 2 x 5120 x 5120) and image embedder add 2.10B
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": (16.39e9, 0.05e9),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": (5e9, 0.5e9),  # "5B"  # "20B"
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": (14e9, 0.5e9),  # "14B" per expert
    # "8.3B" (HunyuanVideo 1.5's model card), both 480p transformers (one config but for task_type)
    "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v": (8.3e9, 0.05e9),
    "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v": (8.3e9, 0.05e9),
    # the names' figures, not roundings of the count: Wan2.1's "1.3B" (30 blocks of width 1536 count 1.42B) and
    # SD3.5 Medium's announced "2.5B" (the config, checked against two independent copies, counts 2.24B)
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": (1.3e9, 0.13e9),
    "stabilityai/stable-diffusion-3.5-medium": (2.5e9, 0.27e9),
}


@pytest.mark.parametrize("hub_id", sorted(PUBLISHED))
def test_shipped_configs_count_the_published_parameters(hub_id):
    spec = shipped_spec(shipped_specs()[hub_id], hub_id)
    count = base_params(spec)
    figure, rounding = PUBLISHED[hub_id]
    print(f"{hub_id}: {count / 1e9:.3f}B counted on meta, published {spec.published}")
    assert abs(count - figure) <= rounding
    assert spec.components and all(v > 1e7 for v in spec.components.values())


def test_every_preset_hub_id_has_a_shipped_config():
    import yaml

    from jagg_lightning.utils.assets import find_local

    specs = {}  # (hub id, family) -> its spec (several presets train one model; LTX-2's as two families)
    for path in sorted(find_local("configs").glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        if (config.get("trainer") or {}).get("accelerator") != "gpu":  # the GPU presets, as test_preset_fits's
            continue
        policy = config["model"]["policy"]
        key = (policy["pretrained"], policy.get("family"))
        if key not in specs:
            specs[key] = model_spec(PolicyConfig(pretrained=policy["pretrained"], family=policy.get("family")))
        spec = specs[key]
        assert spec.family == policy.get("family", spec.family) and "shipped config" in spec.source, path.name


def test_every_family_has_a_plan_and_another_name_is_refused():
    """Every registered family is planned (``test_preset_fits`` then skips no preset); a name that is none of them is
    refused in one line naming the field, before any file is looked for."""
    from jagg_lightning.memory_plan.models import PLANNED_FAMILIES
    from jagg_lightning.policies import FAMILIES

    assert set(FAMILIES) <= set(PLANNED_FAMILIES), sorted(set(FAMILIES) - set(PLANNED_FAMILIES))
    with pytest.raises(ValueError, match="policy.family: jagg plan has no memory plan for the wan_s2v family"):
        model_spec(PolicyConfig(family="wan_s2v", pretrained="Wan-AI/Wan2.2-S2V-14B"))


def test_the_trace_decides_a_branch_on_uniform_data_and_no_other(rng_seed):
    """Under ``UniformValues`` a fake tensor made of one value answers ``bool`` and indexes as a boolean mask as the
    real tensor does (all rows or none; through ``.bool()``, ``~``, ``==`` and row iteration), while a question about
    a tensor of unknown values still fails."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

    from jagg_lightning.memory_plan.trace import UniformValues

    gen = torch.Generator().manual_seed(rng_seed)
    rows, width = (int(x) for x in torch.randint(2, 9, (2,), generator=gen))
    fill = float(torch.randint(0, 2, (1,), generator=gen))  # the branch taken differs from draw to draw
    real = torch.full((rows, width), fill)
    expected = (bool(torch.all(real == 0)), [tuple(x[m].shape) for x, m in zip(real[:, :, None], real.bool())],
                [tuple(x[~m].shape) for x, m in zip(real[:, :, None], real.bool())])
    with FakeTensorMode(), UniformValues():
        x = torch.full((rows, width), fill)
        got = (bool(torch.all(x == 0)), [tuple(r[m].shape) for r, m in zip(x[:, :, None], x.bool())],
               [tuple(r[~m].shape) for r, m in zip(x[:, :, None], x.bool())])
        unknown = torch.empty(rows, width)
        with pytest.raises(DataDependentOutputException):
            bool(torch.all(unknown == 0))
        with pytest.raises(DynamicOutputShapeException):
            x[unknown > 0]
    assert got == expected


@pytest.mark.parametrize("processor_of", ["twin", "published"])
def test_the_edit_plan_counts_the_sources_tokens_as_the_pipeline_makes_them(processor_of):
    """Qwen-Image-Edit's source, resized to about a megapixel whatever size is sampled: its Qwen2.5-VL tokens are what
    a ``Qwen2VLImageProcessor`` with the spec's patching makes of an image of that size (``image_grid_thw``, merged)
    + the vision start / end tokens -- the twin's processor, and the published settings at a random aspect ratio; on
    the twin the plan's source grid is the policy's and its condition the instruction's bound + those tokens."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    from jagg_lightning.memory_plan.shapes import vision_tokens

    gen = torch.Generator().manual_seed(fresh_seed())
    if processor_of == "twin":
        spec, size = twin_spec("qwen_image_edit"), (64, 32 * int(torch.randint(1, 5, (1,), generator=gen)))
        policy = build_policy(PolicyConfig(family="qwen_image_edit", resolution=list(size)))
        processor = policy._pipeline.processor.image_processor
    else:
        spec = shipped_spec(shipped_specs()["Qwen/Qwen-Image-Edit"], "Qwen/Qwen-Image-Edit")
        size = tuple(16 * int(x) for x in torch.randint(32, 128, (2,), generator=gen))
        c = spec.condition
        processor = Qwen2VLImageProcessor(min_pixels=c["vision_min_pixels"], max_pixels=c["vision_max_pixels"],
                                          patch_size=c["vision_patch"], merge_size=c["vision_merge"])
    width, height, _ = calculate_dimensions(spec.condition["source_area"], size[1] / size[0])
    grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt").image_grid_thw
    merged = int(grid.prod()) // processor.merge_size ** 2
    assert vision_tokens(size, spec.condition) == merged + 2 > 2
    if processor_of == "twin":
        plan = _plan(PolicyConfig(family="qwen_image_edit", resolution=list(size), max_sequence_length=8))
        assert plan.geo.source == policy.source_grid and plan.geo.text == 8 + merged + 2
        assert plan.geo.tokens == math.prod(policy.grid) + math.prod(policy.source_grid)


def test_twin_spec_counts_the_twins_components():
    spec = twin_spec("sd3")
    policy = build_policy(PolicyConfig())
    assert sum(spec.components.values()) == sum(p.numel() for m in (*policy.text_encoders, policy.vae)
                                                for p in m.parameters())
    assert base_params(spec) == sum(p.numel() for n, p in policy.transformer.named_parameters() if "lora_" not in n)


def test_full_fine_tune_counts_masters_and_reference():
    config = PolicyConfig(family="flux", trainable="full", dtype="bfloat16")
    sampling = SamplingConfig(num_steps=5, group_size=2, rollout_batch_size=2)
    plan = plan_memory(config, sampling, GRPOConfig(train_batch_size=2, kl_beta=0.1), JAGGConfig(window_size=2),
                       MemoryConfig(), 1, Setup())
    rows = {r.name: r.bytes for r in plan.rows}
    n = base_params(plan.spec)
    assert rows["trainable weights + grads + optimizer (float32)"] == 16 * n  # master, grad, two AdamW moments
    assert rows["KL reference copy"] == 2 * n  # bfloat16 copy
    torch.testing.assert_close(torch.tensor(plan.params["trainable"]), torch.tensor(n))


def test_counting_saved_tensors_keeps_no_graph_alive():
    """``saved_bytes`` (the plan's trace) and ``SavedTensorPeak`` (the measurement) hold no saved tensor in a reference
    cycle: a forward never backwarded is freed with its output (the peak's live bytes back to 0, no tensor of a graph
    left alive), and a backward through the peak's hooks gives the gradient it gives without them."""
    import gc

    from jagg_lightning.memory_plan.trace import SavedTensorPeak, saved_bytes, weight_keys

    def graph_tensors():
        gc.collect()
        return {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn is not None}

    gen = torch.Generator().manual_seed(fresh_seed())
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    x = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    before = graph_tensors()
    # the first Linear saves its input, tanh its output, the last Linear its input (the same storage), exp its output
    assert saved_bytes(lambda: net(x).exp(), weight_keys(net)) == (5 * 8 + 5 * 16 + 5 * 4) * 8
    peak = SavedTensorPeak(weight_keys(net))
    with torch.autograd.graph.saved_tensors_hooks(peak.pack, peak.unpack):
        out = net(x).exp()
    assert peak.live == peak.peak > 0
    del out
    assert peak.live == 0 and graph_tensors() <= before

    with torch.autograd.graph.saved_tensors_hooks(peak.pack, peak.unpack):
        net(x).exp().sum().backward()
    hooked = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net(x).exp().sum().backward()
    for a, b in zip(hooked, (p.grad for p in net.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
