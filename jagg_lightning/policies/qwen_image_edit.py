"""Qwen-Image-Edit: image editing with ``QwenImageEditPipeline`` -- Qwen-Image's transformer, true CFG, schedule and
decode (:mod:`jagg_lightning.policies.qwen_image`), with the source image seen twice, as the pipeline does.

Each prompt carries one condition image (:class:`jagg_lightning.models.conditions.ConditionedPrompt`), fitted to the sampled
size (:func:`jagg_lightning.models.conditions.condition_pixels`: centre-cropped to the aspect ratio, then bicubic) -- the
source a user would hand the pipeline at that size. From there every step is the pipeline's own ``__call__`` with
that source as ``image=`` (one PIL image) and ``height`` / ``width`` the sampled size:

* the source (as 8-bit RGB) is resized (Lanczos) to ``calculate_dimensions(1024 * 1024, W / H)``: about one
  megapixel at its aspect ratio, each side a multiple of 32, whatever size is sampled;
* **prompt**: Qwen2.5-VL over the edit chat template with the resized source in it (``<|vision_start|>``, one
  ``<|image_pad|>`` per merged vision patch, ``<|vision_end|>``) through the pipeline's ``Qwen2VLProcessor``; the last
  hidden state with the template's 64-token system prefix dropped -- the image's tokens and the instruction's stay.
  The negative prompt is encoded with the same source. The edit pipeline does not truncate, so
  ``policy.max_sequence_length`` is unused;
* **source latents**: the resized source through the VAE (the distribution's mode, normalised by ``latents_mean`` /
  ``latents_std``), packed into 2x2 patches like the latent: ``[n, S_src, 4 C]``, frozen;
* **velocity**: the transformer over the latent's tokens followed by the source's, ``img_shapes`` listing both grids
  for the RoPE, the output on the latent's tokens only; with ``guidance_scale`` > 1 Qwen-Image's true CFG with its
  per-token norm rescale (both branches one batched forward);
* **schedule**: Qwen-Image's (sigmas ``linspace(1, 1/N, N)``, ``mu`` from the latent's own token count).

Condition (batch-first): ``(embeds, mask[, neg_embeds, neg_mask], source_tokens)``: the source's tokens travel with
the text through the rollout, the anchors, the fused mode and the KL reference like any condition.

One quirk of the pipeline is not copied: given a *list* of images, its ``image_processor.resize`` passes the list
through unresized, so Qwen2.5-VL then sees the sources at their own size (the VAE still gets the megapixel ones);
the policy always does what ``__call__`` does with one image.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

from jagg_lightning.models.conditions import condition_pixels
from jagg_lightning.policies.base import Guidance
from jagg_lightning.policies.qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG, QwenImagePolicy, tiny_qwen_image_parts
from jagg_lightning.policies.tiny import tiny_qwen_vl_processor

# QwenImageEditPipeline.__call__: calculate_dimensions(1024 * 1024, width / height) of the source image
SOURCE_AREA = 1024 * 1024


def build_tiny_qwen_image_edit_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random ``QwenImageEditPipeline``: the Qwen-Image twin's networks with a 16x VAE (so a one-megapixel source
    is 32 x 32 packed tokens; 64 px images are 2 x 2), and a real ``Qwen2VLProcessor`` whose tokenizer spells the
    edit template's system prefix in 64 tokens and whose image processor feeds the one-block vision tower."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline

    template = QwenImageEditPipeline(None, None, None, None, None, None).prompt_template_encode
    processor = tiny_qwen_vl_processor(template)
    vae = dict(base_dim=4, dim_mult=[1, 2, 2, 2, 2], temperal_downsample=[False] * 4)
    pipe = QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG), tokenizer=processor.tokenizer,
        processor=processor, **tiny_qwen_image_parts(seed, processor.tokenizer, vae),
    )
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


@contextmanager
def float32_default():
    """torch's default dtype float32 inside, as in a plain pipeline call: the image processor's normalisation and the
    pipeline's ``latents_mean`` / ``latents_std`` are built in the default dtype, which a float64 training step
    makes float64 (the same source would then give another condition in the module than outside it)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


class QwenImageEditPolicy(QwenImagePolicy):
    """Frozen Qwen-Image-Edit parts plus a trainable LoRA on the transformer (see the module docstring).

    ``policy.guidance_scale`` is the pipeline's ``true_cfg_scale`` (1.0 = off: one forward, no negative)."""

    family = "qwen_image_edit"
    pipeline_class_name = "QwenImageEditPipeline"
    condition_images = (1, 1)
    tiny_size = 64  # the twin's 16x VAE and 2x2 packing: sides are multiples of 32

    @classmethod
    def build_tiny_pipeline(cls, seed: int = 0, dtype: torch.dtype = torch.float32):
        return build_tiny_qwen_image_edit_pipeline(seed, dtype)

    # ------------------------------------------------------------------ the source
    @property
    def source_size(self) -> tuple[int, int]:
        """(height, width) of the source as the encoders see it: the pipeline's ``calculate_dimensions`` of a
        source of the sampled size (rounded to multiples of 32)."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

        width, height, _ = pipeline_qwenimage_edit.calculate_dimensions(SOURCE_AREA, self.width / self.height)
        return height, width

    @property
    def source_grid(self) -> tuple[int, int]:
        """(rows, cols) of the source's packed tokens."""
        pack = self.vae_scale_factor * 2
        height, width = self.source_size
        return height // pack, width // pack

    def source_images(self, prompts: list[str]) -> list:
        """Each prompt's source fitted to the sampled size, as the 8-bit RGB image handed to the pipeline, resized
        (the pipeline's ``image_processor``: Lanczos) to :attr:`source_size`."""
        processor = self._pipeline.image_processor
        pixels = condition_pixels(prompts, self.height, self.width)
        return [processor.resize(image, *self.source_size)
                for image in processor.numpy_to_pil(processor.pt_to_numpy(pixels))]

    # ------------------------------------------------------------------ condition, velocity
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance: Guidance | None = None) -> tuple[Tensor, ...]:
        """(Qwen2.5-VL embeddings and mask of each prompt with its source [and the negative's with the same source],
        the source's packed VAE latent tokens)."""
        with float32_default():
            pipe, height, width = self._pipeline, *self.source_size
            images = self.source_images(prompts)
            text = self.encode_text(list(prompts), self.cfg(guidance or self.guidance()), image=images)
            pixels = pipe.image_processor.preprocess(images, height, width).unsqueeze(2)  # [n, 3, 1, h, w] in [-1, 1]
            latents = pipe._encode_vae_image(pixels.to(self.device, self.text_encoders[0].dtype), generator=None)
        n, channels, _, rows, cols = latents.shape
        return (*text, pipe._pack_latents(latents, n, channels, rows, cols))

    def transformer_input(self, z: Tensor, extra: tuple[Tensor, ...]) -> tuple[Tensor, list]:
        """The latent's packed tokens followed by the source's, and both grids for the RoPE."""
        (source,) = extra
        tokens = torch.cat([z.to(self.transformer.dtype), source.to(self.transformer.dtype)], dim=1)
        return tokens, [[(1, *self.grid), (1, *self.source_grid)]] * z.shape[0]
