"""jagg_lightning: GRPO fine-tuning of flow-matching DiTs where JAGG replaces most per-step backward passes.

The public names are imported on first use (PEP 562): ``import jagg_lightning`` and ``__version__`` import no torch,
so ``jagg --help`` answers at once; ``from jagg_lightning import JAGGModule`` imports what it names.

What a user hands the Trainer is at the top: ``module.py`` (``JAGGModule``) and ``data.py`` (``PromptDataModule``).
The rest is in folders by concern, each ``__init__`` saying what lives there and what it may import
(docs/architecture.md maps them): ``utils/`` (leaves), ``faults/``, ``method/`` (the math; ``method/estimators/``),
``models/``, ``config/``, ``policies/`` (families), ``rewards/``, ``distributed/`` (strategies), ``training/``
(the step), ``objectives/``, ``memory_plan/``, ``testbed/``, ``callbacks/`` and ``cli/`` (subcommands).
``strategies.py`` is a re-export kept for the path configs name.
"""

__version__ = "0.2.0"
# what ``jagg --help`` says the tool is
DESCRIPTION = ("jagg: GRPO fine-tuning of flow-matching text-to-image transformers (SD3, FLUX, Qwen-Image, ...) "
               "with a LoRA, where JAGG replaces most per-step backward passes. Start with: jagg fit --config "
               "configs/digits.yaml")

# public name -> the module defining it
_PUBLIC = {
    "EvalConfig": "jagg_lightning.config",
    "GRPOConfig": "jagg_lightning.config",
    "JAGGConfig": "jagg_lightning.config",
    "MemoryConfig": "jagg_lightning.config",
    "ObjectiveConfig": "jagg_lightning.config",
    "PolicyConfig": "jagg_lightning.config",
    "SamplingConfig": "jagg_lightning.config",
    "PromptDataModule": "jagg_lightning.data",
    "JAGGModule": "jagg_lightning.module",
    "SD3Policy": "jagg_lightning.policies.sd3",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jagg_lightning' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
