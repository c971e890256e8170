"""Classifier-free guidance runs the conditional and unconditional branches as ONE batched transformer forward: in
every family's ``velocity`` (one call of 2B rows per network, equal in float64 to the two-call reference
v_u + w (v_c - v_u); the image-to-video and editing families with their source in both branches), and everywhere a training run calls it on the tiny SD3 twin (rollout, KL reference, update
passes, evaluation): each velocity call makes exactly one transformer call, of twice its rows."""

import lightning as L
import pytest
import torch

from jagg_lightning import EvalConfig, GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.data import PromptDataModule
from jagg_lightning.policies import build_policy
from jagg_lightning.policies.base import Guidance

from family_cases import CONDITIONED_PROMPTS
from helpers import randomize_lora_b, rel_error, tiny_policy_config

PROMPTS = ["a red cat", "a small dog on green grass"]
WAN = dict(lora_targets=None, max_sequence_length=8, resolution=16, num_frames=5, guidance_scale=5.0)
# each family's twin with guidance on (the settings its own tests use)
FAMILIES = {
    "sd3": dict(guidance_scale=4.0),
    "flux2": dict(lora_targets=None, max_sequence_length=32, guidance_scale=4.0),
    "qwen_image": dict(lora_targets=None, negative_prompt=" ", max_sequence_length=16, resolution=32,
                       guidance_scale=4.0),
    "z_image": dict(lora_targets=None, max_sequence_length=32, guidance_scale=4.0),
    "wan": WAN,
    "wan22": WAN | dict(guidance_scale_2=3.0),
    # image-to-video: the first frame rides with each branch (Wan2.1 I2V: its CLIP tokens and latent channels)
    "wan_i2v": dict(lora_targets=None, max_sequence_length=512, resolution=32, num_frames=9, guidance_scale=5.0),
    "wan22_ti2v": dict(lora_targets=None, max_sequence_length=16, resolution=32, num_frames=9, guidance_scale=5.0),
    # image editing with true CFG: the source's tokens in both branches
    "qwen_image_edit": dict(lora_targets=None, negative_prompt=" ", resolution=64, guidance_scale=4.0),
    # HunyuanVideo 1.5: (embeds, mask, ByT5 embeds, mask) per branch; image-to-video's condition latent and SigLIP
    # tokens in both
    "hunyuan_video15": dict(lora_targets=None, max_sequence_length=16, resolution=32, num_frames=5, guidance_scale=6.0),
    "hunyuan_video15_i2v": dict(lora_targets=None, max_sequence_length=16, resolution=32, num_frames=5,
                                guidance_scale=6.0),
    # LTX-2: (video embeds, audio embeds, mask) per branch, both streams guided
    "ltx2": dict(lora_targets=None, max_sequence_length=16, resolution=32, num_frames=9, guidance_scale=3.0),
    "ltx2_i2v": dict(lora_targets=None, max_sequence_length=16, resolution=32, num_frames=9, guidance_scale=3.0),
}
CONDITIONED = {"wan_i2v", "wan22_ti2v", "qwen_image_edit", "hunyuan_video15_i2v", "ltx2_i2v"}  # a source image each


class TransformerCalls:
    """(network name, rows) of every call of the policy's trained networks."""

    def __init__(self, policy):
        self.calls, self.handles = [], []
        for name, network in policy.trained_networks().items():
            self.handles.append(network.register_forward_pre_hook(
                # Z-Image's transformer takes a list of samples as its first argument
                lambda m, args, kwargs, name=name: self.calls.append((name, len(kwargs.get("hidden_states", args[0] if args else None)))),
                with_kwargs=True))

    def remove(self):
        for handle in self.handles:
            handle.remove()


def branches(family, cond):
    """(the conditional, the unconditional) unguided conditions: the negative entries are the second half of
    ``cond``; an image-to-video condition is (text, negative text, *the image's entries), both branches with the image."""
    if family == "qwen_image_edit":  # (embeds, mask, negative embeds, negative mask, source tokens)
        return (*cond[:2], *cond[4:]), (*cond[2:4], *cond[4:])
    if family.startswith("hunyuan_video15"):  # four text entries per branch, then the image's
        return (*cond[:4], *cond[8:]), (*cond[4:8], *cond[8:])
    if family == "ltx2_i2v":  # three text entries per branch, then the first frame's tokens
        return (*cond[:3], *cond[6:]), (*cond[3:6], *cond[6:])
    if family in CONDITIONED:
        return (cond[0], *cond[2:]), (cond[1], *cond[2:])
    return cond[: len(cond) // 2], cond[len(cond) // 2:]


def two_call_reference(policy, family, z, t, cond, guidance):
    """v_u + w (v_c - v_u) from two unguided calls, one per branch; Wan2.2: each sample's expert's scale;
    Qwen-Image: the pipeline's norm rescale after it."""
    off, (positive, negative) = Guidance(1.0), branches(family, cond)
    v_c = policy.velocity(z, t, positive, off).to(torch.float64)
    v_u = policy.velocity(z, t, negative, off).to(torch.float64)
    w = torch.full((z.shape[0],), guidance.scale, dtype=torch.float64)
    if family == "wan22":
        w = torch.where(policy.high_noise(t), w, torch.full_like(w, guidance.scale_2))
    v = v_u + w.view(-1, *[1] * (z.dim() - 1)) * (v_c - v_u)
    if family in ("qwen_image", "qwen_image_edit"):
        norm = torch.linalg.vector_norm
        v = v * (norm(v_c, dim=-1, keepdim=True) / norm(v, dim=-1, keepdim=True))
    return v


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cfg_is_one_batched_forward_equal_to_two_calls(family, rng_seed, monkeypatch):
    seed = rng_seed % 10_000
    if family == "qwen_image_edit":  # its sources at 128 x 128 instead of ~1024 x 1024 (test_family_qwen_image_edit)
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit

        original = edit.calculate_dimensions
        monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: original(128 * 128, ratio))
    policy = build_policy(tiny_policy_config(family=family, dtype="float64", seed=seed, **FAMILIES[family]))
    for i, network in enumerate(policy.trained_networks().values()):  # both LoRA factors nonzero
        randomize_lora_b(network, torch.Generator().manual_seed(seed + i))
    guidance = policy.guidance()
    assert policy.cfg(guidance) and policy.guided
    cond = policy.encode_prompts(CONDITIONED_PROMPTS if family in CONDITIONED else PROMPTS, guidance)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(2, *policy.latent_shape, generator=gen, dtype=torch.float64)
    t = torch.rand(2, generator=gen, dtype=torch.float64)
    cases = [t]
    if family == "wan22":  # one expert for the whole batch, and a batch split between the experts
        high = float(policy.boundary_ratio) + (1 - float(policy.boundary_ratio)) * torch.rand(2, generator=gen,
                                                                                               dtype=torch.float64)
        cases = [high, torch.stack([high[0], float(policy.boundary_ratio) * t[1]])]
    for times in cases:
        counter = TransformerCalls(policy)
        with torch.no_grad():
            v = policy.velocity(z, times, cond, guidance)
        counter.remove()
        experts = ["transformer" if h else "transformer_2" for h in policy.high_noise(times).tolist()] \
            if family == "wan22" else ["transformer"] * 2
        # one call per network that runs, each with both branches of its samples: 2 x its rows
        assert counter.calls == [(name, 2 * experts.count(name)) for name in dict.fromkeys(experts)], counter.calls
        with torch.no_grad():
            reference = two_call_reference(policy, family, z, times, cond, guidance)
        assert v.shape == z.shape and reference.abs().sum() > 0
        assert rel_error([v.to(torch.float64)], [reference]) < 1e-12
        # and the guidance matters: the conditional branch alone is another velocity
        with torch.no_grad():
            v_c = policy.velocity(z, times, branches(family, cond)[0], Guidance(1.0))
        assert rel_error([v_c.to(torch.float64)], [reference]) > 1e-6


def test_flux_embedded_guidance_is_one_forward_of_b_rows(rng_seed):
    """FLUX.1's distilled guidance has no negative branch: one forward of the batch's own rows."""
    seed = rng_seed % 10_000
    policy = build_policy(tiny_policy_config(family="flux", lora_targets=None, guidance_scale=3.5, seed=seed))
    assert not policy.cfg(policy.guidance())
    counter = TransformerCalls(policy)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        policy.velocity(torch.randn(2, *policy.latent_shape, generator=gen), torch.rand(2, generator=gen),
                        policy.encode_prompts(PROMPTS))
    counter.remove()
    assert counter.calls == [("transformer", 2)]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("train_guidance", [3.0, 1.0], ids=["train_cfg", "train_cfg_free"])
def test_every_velocity_call_of_a_run_is_one_transformer_call(fused, train_guidance, tmp_path, rng_seed):
    """A training step with the KL reference (rollout, reference forwards, update passes or the fused mode's kept
    graphs, JAGG anchors and exact steps), then an evaluation at another guidance: every ``policy.velocity`` call
    makes ONE transformer call, of twice its rows under CFG (``sampling.train_guidance_scale`` > 1 in training,
    ``evaluation.guidance_scale`` in evaluation) and of its rows without."""
    seed = rng_seed % 10_000
    module = JAGGModule(
        tiny_policy_config(guidance_scale=4.0),
        SamplingConfig(num_steps=6, group_size=2, rollout_batch_size=4, train_guidance_scale=train_guidance),
        GRPOConfig(train_batch_size=2, kl_beta=0.1, adv_std="group", skip_zero_advantage=False),
        JAGGConfig(window_size=3, jagg_frac=0.5, fused_rollout=fused),
        evaluation=EvalConfig(num_steps=3, guidance_scale=5.0, samples_per_prompt=2),
        seed=seed,
    )
    module.configure_model()
    policy = module.policy
    counter, velocity_rows, guided = TransformerCalls(policy), [], []
    velocity = policy.velocity

    def counted(z, t, cond, guidance=None):
        velocity_rows.append(z.shape[0])
        guided.append(policy.cfg(guidance or policy.guidance()))
        return velocity(z, t, cond, guidance)

    policy.velocity = counted
    def trainer():
        return L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)

    fit = trainer()
    fit.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False))  # no validation inside
    training_calls = len(velocity_rows)
    assert fit.callback_metrics["train/passes/reference_forward"] > 0  # the KL reference ran
    trainer().validate(module, PromptDataModule(val_prompts=PROMPTS, eval_batch_size=2), verbose=False)
    counter.remove()
    assert training_calls > module.sampling.num_steps and len(velocity_rows) > training_calls  # both ran
    assert guided == [train_guidance > 1] * training_calls + [True] * (len(velocity_rows) - training_calls)
    assert counter.calls == [("transformer", r * (2 if g else 1)) for r, g in zip(velocity_rows, guided)]
