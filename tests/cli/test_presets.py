"""Every model preset builds everything but the weights (no download), and holds the reference numbers."""

import warnings
from pathlib import Path

import pytest
import torch
import yaml

from jagg_lightning import JAGGModule
from jagg_lightning.cli import cli_main
from jagg_lightning.config.old_keys import JAGGDeprecationWarning
from jagg_lightning.policies import FAMILIES, detect_family
from jagg_lightning.utils.assets import find_local, looks_local

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))

# where the numbers come from is written in each preset's header
REFERENCE = {
    "sd35_medium.yaml": {"family": "sd3", "num_steps": 10, "noise_level": 0.7, "lora_rank": 32, "lora_alpha": 64,
                         "guidance_scale": 4.5, "adv_std": "global", "kl_beta": 0.04},
    "flux_dev.yaml": {"family": "flux", "num_steps": 6, "noise_level": 0.9, "lora_rank": 64, "lora_alpha": 128,
                      "guidance_scale": 3.5, "kl_beta": 0.0, "dtype": "bfloat16", "precision": "bf16-true"},
    "qwen_image.yaml": {"family": "qwen_image", "num_steps": 10, "noise_level": 1.2, "lora_rank": 64, "lora_alpha": 128,
                        "guidance_scale": 4.0, "kl_beta": 0.0, "dtype": "bfloat16", "precision": "bf16-true",
                        "window_size": 5},
    # Flow-GRPO's pickscore_sd3_fast_nocfg
    "sd35_medium_fast.yaml": {"family": "sd3", "num_steps": 10, "noise_level": 0.8, "lora_rank": 32, "lora_alpha": 64,
                              "guidance_scale": 1.0, "train_guidance_scale": 1.0, "eval_guidance_scale": 1.0,
                              "step_kind": "cps", "sde_window_size": 3, "sde_window_range": [0, 5],
                              "clip_range": 1e-5, "kl_beta": 0.0, "adv_std": "global", "group_size": 18},
    # Flow-Factory's flux2_klein_base / z_image / z_image_turbo LoRA recipes (Z-Image's guidance is the pipeline's + 1)
    "flux2_klein.yaml": {"family": "flux2", "num_steps": 8, "noise_level": 0.7, "lora_rank": 64, "lora_alpha": 128,
                         "guidance_scale": 4.0, "kl_beta": 0.0, "clip_range": 1e-4, "adv_std": "group", "group_size": 16,
                         "dtype": "bfloat16", "precision": "bf16-true", "sde_window_size": 3,
                         "sde_window_range": [1, 4], "window_size": 3},
    # Flow-Factory's FLUX.2 [dev] LoRA recipe (examples/grpo/lora/flux2/t2i.yaml): embedded guidance 4
    "flux2_dev.yaml": {"family": "flux2_dev", "num_steps": 8, "noise_level": 1.0, "lora_rank": 64, "lora_alpha": 128,
                       "guidance_scale": 4.0, "eval_guidance_scale": 4.0, "kl_beta": 0.0, "clip_range": 1e-4,
                       "adv_std": "group", "group_size": 16, "dtype": "bfloat16", "precision": "bf16-true",
                       "sde_window_size": 3, "sde_window_range": [1, 4], "window_size": 3},
    "z_image.yaml": {"family": "z_image", "num_steps": 10, "noise_level": 0.7, "lora_rank": 64, "lora_alpha": 128,
                     "guidance_scale": 5.0, "eval_guidance_scale": 5.0, "kl_beta": 0.0, "clip_range": 1e-4,
                     "adv_std": "group", "group_size": 16, "dtype": "float32", "precision": "bf16-mixed",
                     "sde_window_size": 3, "sde_window_range": [1, 4], "window_size": 3},
    # Flow-GRPO's counting_flux_kontext
    "flux_kontext_dev.yaml": {"family": "flux_kontext", "num_steps": 6, "noise_level": 0.9, "lora_rank": 64,
                              "lora_alpha": 128, "guidance_scale": 2.5, "kl_beta": 0.0, "adv_std": "global",
                              "group_size": 21, "dtype": "bfloat16", "precision": "bf16-true"},
    # Flow-GRPO's counting_qwenimage_edit (true CFG 4 with the negative " ")
    "qwen_image_edit.yaml": {"family": "qwen_image_edit", "num_steps": 10, "noise_level": 1.0, "lora_rank": 64,
                             "lora_alpha": 128, "guidance_scale": 4.0, "kl_beta": 0.0, "adv_std": "global",
                             "group_size": 16, "clip_range": 1e-4, "dtype": "bfloat16", "precision": "bf16-true"},
    # Wan's own image-to-video sampling (Wan2.1 generate.py i2v at 480P; Wan2.2 wan_ti2v_5B.py) with DanceGRPO's GRPO
    "wan21_i2v_14b.yaml": {"family": "wan_i2v", "num_steps": 40, "noise_level": 0.7, "lora_rank": 64, "lora_alpha": 128,
                           "guidance_scale": 5.0, "kl_beta": 0.04, "adv_std": "group", "group_size": 8,
                           "dtype": "bfloat16", "precision": "bf16-true", "window_size": 4},
    "wan22_ti2v_5b.yaml": {"family": "wan22_ti2v", "num_steps": 50, "noise_level": 0.7, "lora_rank": 64,
                           "lora_alpha": 128, "guidance_scale": 5.0, "kl_beta": 0.04, "adv_std": "group",
                           "group_size": 8, "dtype": "bfloat16", "precision": "bf16-true", "window_size": 4},
    # the paper's regime (issue 29): every step trained, W = 5 ("5 -> 2 backward per group")
    "digits_all_steps.yaml": {"family": "sd3", "num_steps": 10, "noise_level": 0.7, "lora_rank": 8, "lora_alpha": 16,
                              "guidance_scale": 1.0, "kl_beta": 0.0, "window_size": 5},
    # the scenes test bed (issue 42): GenEval in miniature in configs/digits.yaml's regime (the first 4 steps
    # trained, one window), Flow-GRPO's geneval_sd3 noise level and clip range, CFG-free (the test bed is trained
    # with 10 % prompt dropout but scored without guidance)
    "scenes.yaml": {"family": "sd3", "num_steps": 10, "noise_level": 0.7, "lora_rank": 8, "lora_alpha": 16,
                    "guidance_scale": 1.0, "kl_beta": 0.0, "window_size": 4, "group_size": 8, "clip_range": 1e-4},
    # issue 54: DiffusionNFT on the scenes test bed, digits_nft's objective over scenes.yaml's job
    "scenes_nft.yaml": {"family": "sd3", "num_steps": 10, "guidance_scale": 1.0, "group_size": 8, "objective": "nft",
                        "num_levels": 9, "nft_beta": 1.0, "objective_kl_beta": 0.0, "ode_solver": "dpmpp_2m"},
    # Flash-GRPO (the authors' wan2_1_flash recipe's method numbers) and GRPO-Guard (Flow-GRPO's run + its two switches)
    "digits_flash_grpo.yaml": {"num_steps": 10, "sde_window_size": 1, "sde_window_range": [0, 5], "clip_range": 1e-3,
                               "kl_beta": 0.0, "adv_std": "global", "temporal_rectification": True},
    "sd35_medium_flash_grpo.yaml": {"family": "sd3", "num_steps": 20, "sde_window_size": 1, "sde_window_range": [0, 10],
                                    "clip_range": 1e-3, "kl_beta": 0.0, "adv_std": "global", "group_size": 4,
                                    "guidance_scale": 4.5, "temporal_rectification": True},
    "digits_grpo_guard.yaml": {"window_size": 5, "ratio_norm": True, "ratio_reweight": True},
    # flow_grpo's config/grpo_guard.py, pickscore_hps_sd3_ratio_norm (issue 55): no KL, clip 4e-6, per-prompt std
    "sd35_medium_grpo_guard.yaml": {"family": "sd3", "num_steps": 10, "noise_level": 0.7, "kl_beta": 0.0,
                                    "clip_range": 4e-6, "ratio_norm": True, "ratio_reweight": True},
    # the forward-process objectives (issue 41): the NFT code's config/nft.py and Flow-Factory's AWM SD3.5 recipe
    "sd35_medium_nft.yaml": {"family": "sd3", "num_steps": 10, "lora_rank": 32, "lora_alpha": 64, "guidance_scale": 1.0,
                             "group_size": 24, "objective": "nft", "num_levels": 9, "nft_beta": 1.0, "nft_decay_type": 1,
                             "nft_adv_clip": 5.0, "objective_kl_beta": 1e-4, "ode_solver": "dpmpp_2m"},
    "sd35_medium_awm.yaml": {"family": "sd3", "num_steps": 14, "lora_rank": 32, "lora_alpha": 64, "guidance_scale": 1.0,
                             "group_size": 16, "objective": "awm", "num_levels": 6, "awm_weighting": "ghuber",
                             "objective_kl_beta": 1e-4, "ode_solver": "euler"},
    "digits_nft.yaml": {"family": "sd3", "num_steps": 10, "objective": "nft", "num_levels": 9, "nft_beta": 1.0,
                        "objective_kl_beta": 0.0, "ode_solver": "dpmpp_2m"},
    "digits_awm.yaml": {"family": "sd3", "num_steps": 10, "objective": "awm", "num_levels": 9,
                        "awm_weighting": "uniform", "objective_kl_beta": 0.0},
    # issue 57: DGPO's config/dgpo.py geneval_sd3_4gpu; Flow-DPPO's verl-omni / UniRL defaults with JAGG (unfused)
    "digits_dgpo.yaml": {"family": "sd3", "num_steps": 10, "objective": "dgpo", "num_levels": 4, "dgpo_beta": 100.0,
                         "dgpo_clip_range": 0.01, "dgpo_trunc_steps": 4, "objective_kl_beta": 0.02,
                         "ode_solver": "dpmpp_2m", "adv_std": "group"},
    "digits_flow_dppo.yaml": {"family": "sd3", "num_steps": 10, "objective": "flow_dppo", "dppo_threshold": 1e-5,
                              "kl_beta": 0.0, "window_size": 5, "fused_rollout": False, "micro_batches_per_update": 2},
    # Flow-Factory's LTX-2 recipes (examples/grpo/lora/ltx2/t2av.yaml, t2av_pickscore.yaml): CPS on 3 of steps 0..9
    "ltx2.yaml": {"family": "ltx2", "num_steps": 24, "noise_level": 0.8, "lora_rank": 64, "lora_alpha": 128,
                  "guidance_scale": 1.0, "eval_guidance_scale": 4.0, "kl_beta": 0.0, "clip_range": 1e-4,
                  "adv_std": "global", "group_size": 16, "dtype": "bfloat16", "precision": "bf16-true",
                  "step_kind": "cps", "sde_window_size": 3, "sde_window_range": [0, 10], "window_size": 3},
    # Flow-Factory's LTX-2 image-to-audio+video recipe (examples/grpo/lora/ltx2/i2av.yaml): Flow-SDE on steps 1..3
    "ltx2_i2v.yaml": {"family": "ltx2_i2v", "num_steps": 30, "noise_level": 0.7, "lora_rank": 64, "lora_alpha": 128,
                      "guidance_scale": 1.0, "eval_guidance_scale": 4.0, "kl_beta": 0.0, "clip_range": 1e-4,
                      "adv_std": "global", "group_size": 16, "dtype": "bfloat16", "precision": "bf16-true",
                      "step_kind": "sde", "sde_window_size": 3, "sde_window_range": [1, 4], "window_size": 3},
    "z_image_turbo.yaml": {"family": "z_image", "num_steps": 6, "guidance_scale": 1.0, "eval_guidance_scale": 1.0,
                           "noise_level": 0.7, "sde_window_size": 3, "sde_window_range": [1, 4], "window_size": 3},
}


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_builds_everything_but_the_weights(preset, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    # the reward's weights and the GPU are what this machine lacks; everything else is built as configured
    args = ["--config", f"configs/{preset}", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
            "--model.reward", "jpeg_compressibility"]
    policy = yaml.safe_load((ROOT / "configs" / preset).read_text())["model"]["policy"]
    if policy.get("pretrained") and looks_local(policy["pretrained"]) and find_local(policy["pretrained"]) is None:
        # a twin the preset's header says to save first (a missing local folder is refused at once): save one
        FAMILIES[policy["family"]].policy_class().build_tiny_pipeline(0, torch.float32).save_pretrained(tmp_path / "twin")
        args += ["--model.policy.pretrained", str(tmp_path / "twin")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", JAGGDeprecationWarning)
        cli = cli_main(args, run=False)
    renamed = [str(w.message) for w in caught if issubclass(w.category, JAGGDeprecationWarning)]
    assert not renamed, f"{preset} uses a renamed key: {renamed}"  # the shipped presets speak today's vocabulary
    module = cli.model
    assert isinstance(module, JAGGModule) and not hasattr(module, "policy")  # __init__ built no model
    config = module.policy_config
    if config.pretrained is not None and find_local(config.pretrained) is None:
        # a hub model's preset names its family, so detection downloads nothing (a local one is read)
        assert config.family is not None, f"{preset}: set model.policy.family"
    family = detect_family(config)
    policy_class = family.policy_class()
    # the LoRA targets exist in the family's architecture (its tiny twin has the same module names)
    twin = policy_class.build_tiny_pipeline(0, torch.float32).transformer
    names = [name for name, _ in twin.named_modules()]
    for target in config.lora_targets or policy_class.default_lora_targets:
        assert any(name == target or name.endswith("." + target) for name in names), f"{preset}: {target}"
    expected = REFERENCE.get(preset, {})
    found = {"family": family.name, "num_steps": module.sampling.num_steps, "noise_level": module.sampling.noise_level,
             "lora_rank": config.lora_rank, "lora_alpha": config.lora_alpha, "guidance_scale": config.guidance_scale,
             "kl_beta": module.grpo.kl_beta, "dtype": config.dtype, "precision": cli.trainer.precision,
             "window_size": module.jagg.window_size, "train_guidance_scale": module.sampling.train_guidance_scale,
             "eval_guidance_scale": module.evaluation.guidance_scale, "step_kind": module.sampling.step_kind,
             "sde_window_size": module.sampling.sde_window_size, "sde_window_range": module.sampling.sde_window_range,
             "clip_range": module.grpo.clip_range, "adv_std": module.grpo.adv_std, "group_size": module.sampling.group_size,
             "ratio_norm": module.grpo.ratio_norm, "ratio_reweight": module.grpo.ratio_reweight,
             "temporal_rectification": module.grpo.temporal_rectification,

"objective": module.objective.config.name, "num_levels": module.objective.config.num_levels,
             "nft_beta": module.objective.config.nft_beta, "nft_decay_type": module.objective.config.nft_decay_type,
             "nft_adv_clip": module.objective.config.nft_adv_clip, "awm_weighting": module.objective.config.awm_weighting,
             "objective_kl_beta": module.objective.config.kl_beta, "ode_solver": module.sampling.ode_solver,
             "dgpo_beta": module.objective.config.dgpo_beta, "dgpo_clip_range": module.objective.config.dgpo_clip_range,
             "dgpo_trunc_steps": module.objective.config.dgpo_trunc_steps,
             "dppo_threshold": module.objective.config.dppo_threshold, "fused_rollout": module.jagg.fused_rollout,
             "micro_batches_per_update": module.grpo.micro_batches_per_update}
    assert {k: found[k] for k in expected} == expected


@pytest.mark.parametrize("preset", PRESETS)
def test_no_preset_warns_about_its_own_jagg_frac(preset):
    """A shipped preset says what it means: no `jagg: model.jagg.jagg_frac ... routes every full-size window` line on
    every run of it (issue 58: the main job printed one) -- a fraction that rounds to every window is written as 1.
    The step-0 rollout's windows of the preset's own sampling and jagg sections (one network's schedule)."""
    from jagg_lightning.config import JAGGConfig, SamplingConfig
    from jagg_lightning.method.routing import rounding_note
    from jagg_lightning.training.rollout import plan_rollout

    model = yaml.safe_load((ROOT / "configs" / preset).read_text())["model"]
    sampling, jagg = SamplingConfig(**model.get("sampling", {})), JAGGConfig(**model.get("jagg", {}))
    windows = plan_rollout(sampling, jagg, 0).windows
    assert windows and rounding_note(jagg.jagg_frac, windows, jagg.window_size) is None
