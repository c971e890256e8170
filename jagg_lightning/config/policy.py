"""``model.policy``: what to load and how to adapt it (`PolicyConfig`), and the image size it names."""

from __future__ import annotations

from dataclasses import dataclass

from jagg_lightning.models.compiling import COMPILE_MODES
from jagg_lightning.models.full_finetune import check_trainable
from jagg_lightning.utils.checks import check, one_of
from jagg_lightning.utils.dtypes import DTYPES


@dataclass
class PolicyConfig:
    """The model to train: what to load and how to adapt it.

    The checks here read nothing but the fields. The family name, the local paths (`pretrained`, `adapter`: found
    from any directory, `jagg_lightning.utils.assets`; `pretrained: digits` is the shipped test bed) and what a pipeline
    folder's files say are checked by `jagg_lightning.policies.checks.check_policy`, which `JAGGModule` calls with its
    other checks, before any model is built.

    Attributes:
        pretrained: The pipeline to fine-tune: `digits` (the shipped test bed), a local folder or a hub id
            (`org/name`) of a supported family (docs/model_families.md); null builds the family's tiny random model
            offline.
        family: The model family (`sd3`, `flux`, `qwen_image`, `wan`, ...: the registry of
            `jagg_lightning.policies`); null = detected from the pipeline's `model_index.json` (`_class_name`), or
            `sd3` when `pretrained` is null.
        lora_rank: The peft LoRA rank, an integer >= 1.
        lora_alpha: The LoRA alpha, > 0 (the LoRA scale is alpha / rank).
        lora_targets: The peft `target_modules`, a non-empty list of module names; null = the family's default
            (Flow-GRPO's targets for that family).
        guidance_scale: The family's guidance, >= 1: classifier-free guidance for SD3 (1.0 = off: a forward of n
            rows, not one of 2n), the embedded distilled guidance for FLUX.1-dev, the pipeline's `true_cfg_scale` for
            Qwen-Image.
        negative_prompt: The unconditional prompt of classifier-free guidance.
        max_sequence_length: Prompt tokens, an integer >= 1 (SD3: T5 tokens; Qwen-Image: Qwen2.5-VL tokens after
            the template's system prefix).
        resolution: The image (a video's frame) size in pixels: `[height, width]`, or one integer for a square;
            null = the family's native size. Each side must be a multiple of the VAE factor times the patch side.
        dtype: The dtype of the frozen weights (float32, bfloat16, float16 or float64); LoRA weights and the SDE
            math stay float32 (float64 with float64).
        load_t5: SD3: false drops the T5 text encoder when loading (its prompt tokens are then zeros).
        seed: A policy built on its own (`build_policy`): the tiny model's init (seed) and the LoRA init (seed + 1,
            + 2 for Wan2.2's `transformer_2`). Deprecated in a `JAGGModule`: use `model.seed` (0 here means that
            root seed).
        gradient_checkpointing: Recompute each transformer block's activations in backward (diffusers'
            non-reentrant checkpointing): the same gradients, less activation memory, about one extra block forward
            per backward.
        trainable: `lora` (a peft LoRA on the frozen transformer) or `full` (every transformer weight trained,
            Wan2.2's two experts' both; float32 master weights, `dtype` is then the compute dtype;
            docs/full_finetuning.md).
        trainable_modules: With `trainable: full`, module-name patterns (a name, a dotted suffix of one, or an
            fnmatch pattern) to train only those modules in full; each must match some module; null = every weight.
        reference_offload: With `trainable: full` and `grpo.kl_beta` > 0: keep the frozen KL reference copy on
            the CPU between uses.
        num_frames: Video families only (Wan): frames per video, 4 k + 1; null = the family's default (81; the
            tiny twin 9). An image family refuses any value but null or 1.
        guidance_scale_2: Two-expert video families only (Wan2.2): the low-noise expert's CFG scale, >= 1; null =
            `guidance_scale`.
        adapter: An exported LoRA to start from (`LoRAExport`'s folder, its `peft/` or `diffusers/` part): its
            rank, alpha and targets replace `lora_rank` / `lora_alpha` / `lora_targets` (evaluate, sample or train
            on). Wan2.2: `transformer_2` loads the `peft_transformer_2/` or `diffusers_transformer_2/` part beside it.
        compile: null (eager) or `repeated_blocks`: each trained network's repeated block compiled once by
            `torch.compile` after the LoRA is injected (`jagg_lightning.models.compiling`; a policy built on its own:
            `compiling.compile_policy`).
    """

    pretrained: str | None = None
    family: str | None = None
    lora_rank: int = 32
    lora_alpha: float = 64.0
    lora_targets: list[str] | None = None
    guidance_scale: float = 4.5
    negative_prompt: str = ""
    max_sequence_length: int = 128
    resolution: int | list[int] | None = None
    dtype: str = "float32"
    load_t5: bool = True
    seed: int = 0  # deprecated in a JAGGModule: model.seed
    gradient_checkpointing: bool = False
    trainable: str = "lora"
    trainable_modules: list[str] | None = None
    reference_offload: bool = False
    num_frames: int | None = None
    guidance_scale_2: float | None = None
    adapter: str | None = None
    compile: str | None = None

    def __post_init__(self):
        def integer(name, value, allowed, ok):
            if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
                raise ValueError(f"policy.{name} must be {allowed}, got {value!r}")

        integer("lora_rank", self.lora_rank, "an integer >= 1", lambda v: v >= 1)
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or not self.lora_alpha > 0:
            raise ValueError(f"policy.lora_alpha must be a number > 0, got {self.lora_alpha!r}")
        if not isinstance(self.guidance_scale, (int, float)) or self.guidance_scale < 1.0:
            raise ValueError(f"policy.guidance_scale must be >= 1.0 (1.0 = off), got {self.guidance_scale!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"policy.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        integer("max_sequence_length", self.max_sequence_length, "an integer >= 1", lambda v: v >= 1)
        if self.resolution is not None:  # the multiple of VAE factor x patch size is checked against the model
            check_resolution_field(self.resolution)
        integer("seed", self.seed, "an integer", lambda v: True)
        if self.num_frames is not None:  # the 4 k + 1 rule is the VAE's, checked by the family
            integer("num_frames", self.num_frames, "an integer >= 1 or null", lambda v: v >= 1)
        if self.guidance_scale_2 is not None and (isinstance(self.guidance_scale_2, bool) or not isinstance(
                self.guidance_scale_2, (int, float)) or self.guidance_scale_2 < 1.0):
            raise ValueError(f"policy.guidance_scale_2 must be >= 1.0 or null, got {self.guidance_scale_2!r}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(f"policy.gradient_checkpointing must be true or false, got {self.gradient_checkpointing!r}")
        if self.lora_targets is not None and (isinstance(self.lora_targets, str) or not self.lora_targets or not all(
                isinstance(t, str) and t for t in self.lora_targets)):
            raise ValueError("policy.lora_targets must be a non-empty list of module names or null (the family's "
                             f"default), got {self.lora_targets!r}")
        check(self.compile is None or self.compile in COMPILE_MODES, "policy.compile",
              f"null (eager) or {one_of(COMPILE_MODES)} (torch.compile of each repeated block)", self.compile)
        check_trainable(self, PolicyConfig)


def check_resolution_field(resolution) -> None:
    """``policy.resolution``: an integer >= 1 or a ``[height, width]`` pair of them (pixels)."""
    pair = isinstance(resolution, (list, tuple)) and len(resolution) == 2
    sides = list(resolution) if pair else [resolution]
    if not (pair or isinstance(resolution, int)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sides):
        raise ValueError("policy.resolution must be [height, width] (integers >= 1, pixels), one integer (a square) "
                         f"or null, got {resolution!r}")


def image_size(resolution, native) -> tuple[int, int]:
    """(height, width) in pixels of ``policy.resolution`` -- ``[H, W]``, one side of a square, or None for ``native``
    (itself an integer side or an ``(H, W)`` pair: the family pipeline's default size)."""
    size = native if resolution is None else resolution
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
