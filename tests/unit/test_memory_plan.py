"""``jagg plan``'s parts on the twins: the planner's shapes and traced activation bytes (fake model, nothing
allocated) against the real policies and ``Sampler.activation_bytes``; and the shipped configs' parameter counts
against the published figures."""

import dataclasses

import pytest
import torch

from jagg_lightning.config import GRPOConfig, JAGGConfig, MemoryConfig, PolicyConfig, SamplingConfig
from jagg_lightning.memory_plan import Setup, plan_memory
from jagg_lightning.memory_plan.models import model_spec, shipped_spec, shipped_specs, twin_spec
from jagg_lightning.memory_plan.plan import base_params
from jagg_lightning.policies import build_policy
from jagg_lightning.training.sampler import Sampler

from helpers import fresh_seed

TWINS = {  # family -> policy settings of a twin (guided where the family has CFG: both branches traced)
    "sd3": dict(guidance_scale=2.0, lora_targets=["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]),
    "flux": dict(guidance_scale=3.5),
    "flux_kontext": dict(guidance_scale=3.5),  # the source's tokens after the latent's: twice the sequence
    "flux2": dict(guidance_scale=4.0),
    "flux2_dev": dict(guidance_scale=4.0),  # embedded guidance: one branch traced
    "wan": dict(guidance_scale=3.0),
    "wan22": dict(guidance_scale=3.0, guidance_scale_2=2.0),
    "qwen_image": dict(guidance_scale=1.0),
}


def _plan(policy_config, text_tokens=None, **setup):
    sampling = SamplingConfig(num_steps=5, group_size=2, rollout_batch_size=2)
    return plan_memory(policy_config, sampling, GRPOConfig(train_batch_size=2), JAGGConfig(window_size=2),
                       MemoryConfig(), 1, Setup(**setup), text_tokens=text_tokens)


@pytest.mark.parametrize("family", sorted(TWINS))
@pytest.mark.parametrize("trainable", ["lora", "full"])
def test_traced_activations_equal_the_real_policys(family, trainable):
    """The fake model's saved bytes for one sample equal what ``Sampler.activation_bytes`` measures on the real twin
    (same unit: distinct storages saved for backward, weights excluded), and the latent shapes agree."""
    extra = TWINS[family] if trainable == "lora" else {k: v for k, v in TWINS[family].items() if k != "lora_targets"}
    side = 32 if family != "sd3" else 16 * 2 ** (fresh_seed() % 2)  # a resolution other than native, sometimes
    config = PolicyConfig(family=family, trainable=trainable, resolution=side if family == "sd3" else None, **extra)
    policy = build_policy(config)
    measured = Sampler(policy, SamplingConfig(), 0.0).activation_bytes()  # of the prompt "a"
    # Qwen-Image's condition is as long as the prompt (the plan's default: the bound, max_sequence_length)
    text = policy.encode_prompts(["a"])[0].shape[1] if family == "qwen_image" else None
    plan = _plan(dataclasses.replace(config), text_tokens=text)
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


# the published transformer sizes (spec.json says where each is published) and the rounding they are given at
PUBLISHED = {
    "black-forest-labs/FLUX.1-dev": (12e9, 0.5e9),  # "12B"
    "black-forest-labs/FLUX.1-Kontext-dev": (12e9, 0.5e9),  # "12B": FLUX.1-dev's transformer
    "black-forest-labs/FLUX.2-klein-base-4B": (4e9, 0.5e9),  # "4B"
    "black-forest-labs/FLUX.2-dev": (32e9, 0.5e9),  # "32B"
    "Qwen/Qwen-Image": (20e9, 0.5e9),  # "20B"
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": (14e9, 0.5e9),  # "14B" per expert
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

    presets = ["sd35_medium", "flux_dev", "flux_kontext_dev", "flux2_klein", "flux2_dev", "qwen_image", "wan21_t2v_1_3b",
               "wan22_t2v_a14b"]
    families = ("sd3", "flux", "flux_kontext", "flux2", "flux2_dev", "qwen_image", "wan")
    for name in presets:
        pretrained = yaml.safe_load(open(find_local(f"configs/{name}.yaml")))["model"]["policy"]["pretrained"]
        assert model_spec(PolicyConfig(pretrained=pretrained)).family in families


@pytest.mark.parametrize("pretrained", ["Qwen/Qwen-Image-Edit", None])
def test_a_family_without_a_plan_is_refused_by_name(pretrained):
    """The editing families (their source tokens and VL image tokens are not planned): one line naming the family,
    before any file is looked for -- the hub id, or the twin."""
    with pytest.raises(ValueError, match="policy.family: jagg plan has no memory plan for the qwen_image_edit family"):
        model_spec(PolicyConfig(family="qwen_image_edit", pretrained=pretrained))


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
