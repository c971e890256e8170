"""FLUX.2 [dev]: ``Flux2Pipeline`` -- the FLUX.2 transformer (double- and single-stream blocks, 4-axis RoPE) with a
guidance embedding, the Mistral-3 (Mistral-Small-3.1) prompt encoder behind a ``PixtralProcessor``, and the same
empirical dynamic shift as [klein].

A subclass of :class:`~jagg_lightning.policies.flux2.Flux2Policy`: the latent layout, token packing, position ids,
schedule and decode are [klein]'s, because ``Flux2Pipeline`` does them the same way. What differs stays here:

* **condition** (batch-first): ``(prompt_embeds [n, L, 3 D],)`` -- ``Flux2Pipeline.encode_prompt`` itself: the
  processor's chat template over ``format_input`` (the pipeline's ``SYSTEM_MESSAGE`` as the system turn, the prompt
  as the user turn, no generation prompt), padded and truncated to ``max_sequence_length`` tokens (the pipeline's
  default is 512), Mistral-3's hidden states of layers (10, 20, 30) stacked on the channel axis (3 x 5120 = 15360
  for Mistral-Small-3.1 = the transformer's ``joint_attention_dim``). The transformer sees every padded token (the
  pipeline passes no text mask). Text ids (0, 0, 0, l), image ids (0, row, col, 0), as [klein].
* **guidance**: embedded. FLUX.2 [dev] is guidance-distilled: ``guidance_scale`` goes into the transformer's
  guidance embedding as a float32 tensor ``[n]`` (the pipeline's ``torch.full([1], guidance_scale).expand(n)``),
  ONE forward per velocity, no negative prompt, no negative branch: :meth:`Flux2DevPolicy.cfg` is always False, as
  FLUX.1-dev's. ``guidance_scale`` 1.0 is a valid value (the embedding of 1), not "off"; the pipeline's default
  is 4.0.
* **latent**: the pipeline's ``latents=`` layout ``[128, H / 16, W / 16]`` (2x2 patches of the 32-channel VAE
  latent, batch-normalised with the VAE's running statistics), flattened row-major to tokens, as [klein]. One
  difference of the pipeline's: its ``output_type="latent"`` returns the packed tokens ``[n, h w, 128]`` as they
  are (klein's is denormalised and unpatchified), so :meth:`latents_from_pipeline_output` only unflattens.
* **times**: sigmas ``linspace(1, 1/S, S)`` and ``mu = compute_empirical_mu(image tokens, S)`` of
  ``pipeline_flux2`` into the scheduler's exponential dynamic shift; the transformer gets t = sigma.
* **refused**: a non-empty ``policy.negative_prompt`` (there is no negative branch to take it). **Not covered**:
  reference images (editing: the pipeline's ``image=``) and caption upsampling (``caption_upsample_temperature``)
  -- text-to-image only, the pipeline's call without them.

``build_tiny_flux2_dev_pipeline`` builds a real ``Flux2Pipeline`` offline: a 1 + 1 block transformer with
``guidance_embeds=True``, [klein]'s one-level ``AutoencoderKLFlux2`` with random batch-norm statistics, a
31-layer hidden-16 ``Mistral3ForConditionalGeneration`` (so layer 30 is a layer's output, not the final norm's,
as in the 40-layer Mistral-Small-3.1) with a one-layer Pixtral vision tower no prompt reaches, and a
``PixtralProcessor`` whose byte-level tokenizer spells each word of the system message as one token
(``policies/tiny.py``): the template is 32 tokens, so ``max_sequence_length: 64`` holds it and a short prompt.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from jagg_lightning.policies.base import Guidance, PolicyConfig
from jagg_lightning.policies.flux2 import (
    FLUX2_LORA_TARGETS, FLUX2_SCHEDULER_CONFIG, Flux2Policy, tiny_flux2_transformer_and_vae,
)
from jagg_lightning.policies.tiny import tiny_mistral3_config, tiny_mistral3_processor


def build_tiny_flux2_dev_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random ``Flux2Pipeline`` small enough to train on 2 CPU cores (32 px -> 8 x 8 tokens of 16 channels)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import Mistral3ForConditionalGeneration

    processor = tiny_mistral3_processor(words_of=SYSTEM_MESSAGE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # 31 layers: the pipeline reads hidden states 10, 20 and 30 (Mistral-Small-3.1 has 40)
        text_encoder = Mistral3ForConditionalGeneration(tiny_mistral3_config(processor.tokenizer, 31)).eval()
        transformer, vae = tiny_flux2_transformer_and_vae(guidance_embeds=True)
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG), vae=vae,
                         text_encoder=text_encoder, tokenizer=processor, transformer=transformer)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


class Flux2DevPolicy(Flux2Policy):
    """Frozen FLUX.2 [dev] parts plus a trainable peft LoRA on the transformer (see the module docstring)."""

    family = "flux2_dev"
    pipeline_class_name = "Flux2Pipeline"
    # the same transformer as [klein]: Flow-Factory's FLUX.2 [dev] targets (models/flux/flux2.py) are klein's
    default_lora_targets = FLUX2_LORA_TARGETS
    # the Mistral-3 layers whose hidden states make the condition (Flux2Pipeline's default text_encoder_out_layers)
    text_encoder_out_layers = (10, 20, 30)

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_flux2_dev_pipeline(seed, dtype)

    @classmethod
    def load_pipeline(cls, pretrained: str, dtype: torch.dtype, config: PolicyConfig):
        from diffusers import Flux2Pipeline

        return Flux2Pipeline.from_pretrained(pretrained, torch_dtype=dtype)

    def setup(self, pipeline) -> None:
        if self.config.negative_prompt:
            raise ValueError("policy.negative_prompt: FLUX.2 [dev]'s guidance is embedded (one forward, no negative "
                             f"branch), so a negative prompt would be ignored; leave it empty, got "
                             f"{self.config.negative_prompt!r}")
        super().setup(pipeline)  # components, size; Flux2Pipeline has no is_distilled: never "distilled"

    def scheduler_kwargs(self, num_steps: int) -> dict:
        """As ``Flux2Pipeline.__call__``: sigmas linspace(1, 1/S, S) and BFL's empirical mu for (tokens, S)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        mu = compute_empirical_mu(image_seq_len=self.image_seq_len, num_steps=num_steps)
        if self.scheduler.config.get("use_flow_sigmas", False):
            return {"mu": mu}
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": mu}

    def cfg(self, guidance: Guidance) -> bool:
        """Never: FLUX.2 [dev]'s guidance is embedded (one forward, no negative branch)."""
        return False

    def velocity(self, z: Tensor, t: Tensor, cond: tuple[Tensor, ...], guidance: Guidance | None = None) -> Tensor:
        """v(z, t): one forward with the embedded guidance ``guidance_scale``, float32 [n] as the pipeline passes it;
        ``t`` [n] in [0, 1]."""
        scale = (guidance or self.guidance()).scale
        embedded = torch.full([len(z)], scale, device=z.device, dtype=torch.float32)
        return self._forward(z, t, cond[0], embedded)

    def latents_from_pipeline_output(self, latents: Tensor) -> Tensor:
        """``Flux2Pipeline``'s ``output_type="latent"``: the packed tokens [n, h w, 4C] as sampled (neither
        denormalised nor unpatchified, unlike klein's) -> this policy's layout [n, 4C, h, w]."""
        _, h, w = self.latent_shape
        return self.from_tokens(latents, h, w)


__all__ = ["Flux2DevPolicy", "build_tiny_flux2_dev_pipeline"]
