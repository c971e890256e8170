"""The Wan image-to-video twins (Wan2.1 I2V with its CLIP image encoder; Wan2.2 TI2V-5B's expand_timesteps mode),
the modules the I2V tests build on them, the pipeline's own steps to compare with, and a tiny CLIP for the
first-frame reward."""

import torch

from jagg_lightning.models.conditions import condition_pixels
from jagg_lightning.policies.wan_i2v import build_tiny_wan_i2v_pipeline

from family_cases import CONDITIONED_PROMPTS
import wan_twins
from helpers import tiny_policy_config

TWINS = {"wan_i2v": False, "wan22_ti2v": True}  # family -> TI2V (expand_timesteps)
PROMPTS = CONDITIONED_PROMPTS  # random non-square 40 x 56 sources: fitting them to the sampled size crops


def build(twin, dtype=torch.float32):
    return build_tiny_wan_i2v_pipeline(0, dtype, ti2v=TWINS[twin])


def config(**kw):
    # 512 text tokens: a Wan I2V transformer with an image embedder reads the last 512 context tokens as the text
    return tiny_policy_config(**({"lora_targets": None, "max_sequence_length": 512, "guidance_scale": 5.0,
                                  "resolution": 32, "num_frames": 9} | kw))


def module_for(twin, path, seed, **kw):
    """The text-to-video twins' module (wan_twins.module_for: FrameReward, every expert's LoRA randomised) on these
    twins' config."""
    return wan_twins.module_for(twin, path, seed, make_config=config, **kw)


def pipeline_latents(pipe, policy, z, prompt, num_steps, guidance_scale, **call):
    """``WanImageToVideoPipeline.__call__`` on one prompt and its first frame (the pipeline takes one image per call)
    from the policy's sampled latent ``z`` [1, ...] (TI2V: behind a random first frame, which the pipeline
    overwrites): the latents after each step, on the sampled frames, and the final output latent."""
    height, width = policy.resolution
    full = z if not TWINS[policy.family] else torch.cat([torch.randn_like(z[:, :, :1]), z], dim=2)
    sampled = (lambda x: x[:, :, 1:]) if TWINS[policy.family] else (lambda x: x)
    seen = [z]
    out = pipe(prompt=[str(prompt)], image=condition_pixels([prompt], height, width), num_inference_steps=num_steps,
               latents=full.clone(), height=height, width=width, num_frames=policy.num_frames,
               guidance_scale=guidance_scale, output_type="latent",
               max_sequence_length=policy.config.max_sequence_length, **call,
               callback_on_step_end=lambda p, i, t, kw: seen.append(sampled(kw["latents"]).clone()) or {}).frames
    return seen, out


def save_tiny_clip(root):
    """A tiny CLIPModel + processor saved like a downloaded checkpoint (the first-frame reward's model)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from jagg_lightning.policies.tiny import tiny_clip_tokenizer

    tokenizer = tiny_clip_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        CLIPModel(CLIPConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1,
                             pad_token_id=1),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               image_size=32, patch_size=8),
            projection_dim=8)).save_pretrained(root)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                  tokenizer=tokenizer).save_pretrained(root)
    return root
