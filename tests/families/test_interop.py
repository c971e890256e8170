"""The exported adapter in every client people load it with, each against the trained module's velocity;
checkpoints that carry the adapter's identity; plain-data hyper-parameters; the reward description."""

import json
import warnings

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.callbacks import AtomicCheckpointIO, LoRAExport
from jagg_lightning.data import PromptDataModule
from jagg_lightning.models.adapters import PEFT_KEY_PREFIX
from jagg_lightning.policies.sd3 import build_tiny_sd3_pipeline
from jagg_lightning.rewards import JpegCompressibility, JpegIncompressibility, Reward, WeightedReward

from helpers import fresh_seed, randomize_lora_b, tiny_policy_config

PROMPTS = [f"prompt number {i}" for i in range(4)]


def small_module(seed, reward="jpeg_compressibility", ema_decay=0.5, **policy):
    module = JAGGModule(
        tiny_policy_config(**policy),  # rank 4, alpha 8: scale 2, so a lost alpha shows
        SamplingConfig(num_steps=4, group_size=2),
        GRPOConfig(train_batch_size=4),
        JAGGConfig(window_size=2, jagg_frac=0.5),
        reward=reward,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        ema_decay=ema_decay,
        seed=seed,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two optimizer steps with EMA on, a checkpoint per step and the LoRA export: shared by this file."""
    seed = fresh_seed(16)  # module-scoped: JAGG_TEST_SEED replays it too
    print(f"trained seed={seed}")
    root = tmp_path_factory.mktemp("trained")
    module = small_module(seed)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root, plugins=[AtomicCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_last=True),
                                   LoRAExport(str(root / "lora"))])
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=2, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(2, *module.policy.latent_shape, generator=gen)
    t = torch.rand(2, generator=gen)
    cond = module.policy.encode_prompts(["a red cat", "a dog"])
    with torch.no_grad(), module.inference_weights():  # the export holds the EMA weights
        expected = module.policy.velocity(z, t, cond)
    return dict(seed=seed, root=root, module=module, z=z, t=t, cond=cond, expected=expected)


def velocity_of(transformer, case):
    pe, pooled = case["cond"]
    with torch.no_grad():
        return transformer(hidden_states=case["z"], timestep=case["t"] * 1000, encoder_hidden_states=pe,
                           pooled_projections=pooled, return_dict=False)[0]


def assert_matches_trained(transformer, case):
    torch.testing.assert_close(velocity_of(transformer, case), case["expected"], rtol=1e-5, atol=1e-6)


def test_peft_from_pretrained_and_merge_and_unload(trained):
    from peft import PeftModel

    transformer = build_tiny_sd3_pipeline(trained["seed"]).transformer
    base = velocity_of(transformer, trained)
    assert not torch.allclose(base, trained["expected"], atol=1e-4)  # the adapter matters
    keys = load_file(str(trained["root"] / "lora" / "final" / "peft" / "adapter_model.safetensors"))
    assert keys and all(k.startswith(PEFT_KEY_PREFIX) for k in keys)
    model = PeftModel.from_pretrained(transformer, str(trained["root"] / "lora" / "final" / "peft"))
    assert_matches_trained(model.base_model.model, trained)
    merged = model.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert_matches_trained(merged, trained)


def test_diffusers_transformer_load_lora_adapter_uses_alpha_over_rank(trained):
    transformer = build_tiny_sd3_pipeline(trained["seed"]).transformer
    # diffusers looks for a .bin unless told the file is safetensors
    transformer.load_lora_adapter(str(trained["root"] / "lora" / "final" / "diffusers"), use_safetensors=True)
    assert_matches_trained(transformer, trained)


def test_pipeline_load_lora_weights_and_fuse_lora(trained):
    pipe = build_tiny_sd3_pipeline(trained["seed"])
    pipe.load_lora_weights(str(trained["root"] / "lora" / "final" / "diffusers"))
    assert_matches_trained(pipe.transformer, trained)
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # the fused weights stay in the base layers
    assert not any("lora" in n for n, _ in pipe.transformer.named_parameters())
    assert_matches_trained(pipe.transformer, trained)


def test_last_export_equals_last_checkpoint_and_carries_identity(trained):
    """The export of the run's last step (``final``: it supersedes and removes ``last``, written at the same step's
    checkpoint) equals the last checkpoint and carries the adapter's identity."""
    ckpt = torch.load(trained["root"] / "ckpt" / "last.ckpt", weights_only=True)
    assert not (trained["root"] / "lora" / "last").exists()
    last = trained["root"] / "lora" / "final"
    identity = json.loads((last / "adapter.json").read_text())
    assert identity["global_step"] == ckpt["global_step"] == 2
    assert ckpt["jagg"]["adapter"] == {k: v for k, v in identity.items() if k != "global_step"}
    assert identity["lora_rank"] == 4 and identity["lora_alpha"] == 8 and identity["family"] == "sd3"
    exported = load_file(str(last / "peft" / "adapter_model.safetensors"))
    shadow = ckpt["jagg"]["ema"]  # EMA on: the export is the EMA of the checkpoint's step
    assert len(exported) == len(shadow) > 0
    for name, value in shadow.items():
        key = PEFT_KEY_PREFIX + name.removeprefix("policy.transformer.").replace(".default.", ".")
        assert torch.equal(exported[key], value), name


def test_checkpoint_into_a_different_adapter_stops_naming_the_field(trained):
    ckpt_path = trained["root"] / "ckpt" / "last.ckpt"
    with pytest.raises(ValueError, match=r"lora_rank: checkpoint 4, this module 2"):
        JAGGModule.load_from_checkpoint(ckpt_path, policy=tiny_policy_config(lora_rank=2))  # the root seed: the hparams
    other = small_module(trained["seed"] + 1)  # same shapes, another base model (tiny seed)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, plugins=[AtomicCheckpointIO()])
    with pytest.raises(ValueError, match=r"base_model: checkpoint 'tiny-random\(seed="):
        trainer.fit(other, PromptDataModule(prompts=PROMPTS, batch_size=2), ckpt_path=str(ckpt_path))


def test_hparams_are_plain_data_and_rebuild_the_reward(trained, tmp_path):
    ckpt = torch.load(trained["root"] / "ckpt" / "last.ckpt", weights_only=True)
    hp = ckpt["hyper_parameters"]
    assert yaml.safe_load(yaml.safe_dump(hp)) == hp
    assert hp["policy"]["lora_rank"] == 4 and hp["reward"] == "jpeg_compressibility"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = JAGGModule.load_from_checkpoint(trained["root"] / "ckpt" / "last.ckpt")
    assert not [w for w in caught if "not in the checkpoint" in str(w.message)]  # no list of frozen weights
    for (n, a), b in zip(trained["module"]._trainable_named_parameters(), loaded.policy.lora_parameters()):
        assert torch.equal(a.detach(), b.detach()), n

    reward = WeightedReward([JpegCompressibility(quality=70), JpegIncompressibility()], weights=[1.0, 0.5])
    module = small_module(trained["seed"], reward=reward, ema_decay=None)
    path = tmp_path / "weighted.ckpt"
    L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
              enable_model_summary=False).fit(module, PromptDataModule(prompts=PROMPTS[:2], batch_size=2))
    module.trainer.save_checkpoint(path)
    hp = torch.load(path, weights_only=True)["hyper_parameters"]
    assert hp["reward"]["class_path"] == "jagg_lightning.rewards.weighted.WeightedReward"
    rebuilt = JAGGModule.load_from_checkpoint(path).reward_fn
    assert isinstance(rebuilt, WeightedReward) and rebuilt.weights == reward.weights
    assert rebuilt.rewards[0].quality == 70
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(trained["seed"]))
    torch.testing.assert_close(rebuilt(images, ["a", "b"]), reward(images, ["a", "b"]))


class OpaqueReward(Reward):
    name = "opaque"

    def __init__(self, scorer):
        super().__init__()
        self.scorer = scorer
        self.freeze()

    def score(self, images, prompts):
        return self.scorer(images)


def test_reward_that_cannot_be_rebuilt_is_named_on_load(trained, tmp_path):
    module = small_module(trained["seed"], reward=OpaqueReward(lambda x: x.mean((1, 2, 3))), ema_decay=None)
    path = tmp_path / "opaque.ckpt"
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=PROMPTS[:2], batch_size=2))
    trainer.save_checkpoint(path)
    with pytest.raises(ValueError, match=r"reward: the checkpoint records reward .*OpaqueReward but cannot rebuild"):
        JAGGModule.load_from_checkpoint(path)
    again = JAGGModule.load_from_checkpoint(path, reward="jpeg_compressibility")  # the way out the message names
    assert again.reward_fn.name == "jpeg_compressibility"


def test_saved_tiny_pipeline_loads_with_plain_from_pretrained(trained, tmp_path):
    """No extra arguments: the saved directory has every component the pipeline class expects."""
    from diffusers import StableDiffusion3Pipeline

    build_tiny_sd3_pipeline(trained["seed"]).save_pretrained(tmp_path / "tiny")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "tiny"))
    pe, _, pooled, _ = pipe.encode_prompt(["a red cat", "a dog"], None, None, do_classifier_free_guidance=False,
                                          max_sequence_length=4)
    torch.testing.assert_close((pe, pooled), trained["cond"], rtol=0, atol=0)  # its T5 adds exactly nothing
    pipe.load_lora_weights(str(trained["root"] / "lora" / "final" / "diffusers"))
    assert_matches_trained(pipe.transformer, trained)
