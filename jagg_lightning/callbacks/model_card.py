"""The model card beside every export (``<export>/README.md``), as diffusers' training scripts write one: the hub's YAML
metadata (``base_model``, ``library_name: diffusers``, ``tags``), what trained it (the reward, the method and its key
settings, the steps), its held-out and judge metrics first -> last, the latest sample grid (copied beside the card) and
how to load it in diffusers and peft. Rendered with ``huggingface_hub``'s ``ModelCard``, offline; valid for an upload
(``ModelCard.load`` reads it back)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from jagg_lightning.faults.io import atomic_write
from jagg_lightning.utils.assets import looks_local

CARD_FILE, GRID_FILE = "README.md", "samples.png"
# the metrics the card leads with (the test beds' held-out and judge readings), then every other val/* metric
LEAD = ("digit_accuracy", "judge_accuracy", "geneval/overall", "judge_geneval/overall")


@dataclass
class CardFacts:
    """What a card says, as plain data (``card_facts`` reads it off a run)."""

    pipeline: str  # the diffusers pipeline class (``StableDiffusion3Pipeline``)
    base_model: str | None  # ``policy.pretrained`` as given (a hub id, a shipped name, a folder); None: a tiny twin
    method: str  # ``grpo``, ``jagg``, ``nft``, ``awm``
    reward: str
    steps: int
    settings: dict[str, object] = field(default_factory=dict)
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)  # {name: {step: value}}
    video: bool = False
    lora: bool = True  # False: a full fine-tune's ``transformer/`` folder
    grid: Path | None = None  # the latest sample grid


def method_name(objective: str, jagg_frac: float) -> str:
    """The method a card names: the forward-process objective, else JAGG when any window is routed, else GRPO."""
    return objective if objective != "grpo" else ("jagg" if jagg_frac > 0 else "grpo")


def metric_lines(metrics: dict[str, dict[int, float]]) -> list[str]:
    """One markdown table row per metric, the lead ones first: first -> last with their steps."""
    def order(name: str):
        short = name.split("/", 1)[-1]
        return (LEAD.index(short) if short in LEAD else len(LEAD), name)

    rows = []
    for name in sorted(metrics, key=order):
        steps = sorted(metrics[name])
        first, last = metrics[name][steps[0]], metrics[name][steps[-1]]
        rows.append(f"| `{name}` | {first:.3f} (step {steps[0]}) | {last:.3f} (step {steps[-1]}) |")
    return rows


def render_card(facts: CardFacts):
    """The card as a ``huggingface_hub.ModelCard`` (its metadata in ``card.data``)."""
    from huggingface_hub import ModelCard, ModelCardData

    hub_base = facts.base_model if facts.base_model and not looks_local(facts.base_model) else None
    tags = ["lora" if facts.lora else "full-fine-tune", "text-to-video" if facts.video else "text-to-image",
            "diffusers", facts.method, "jagg_lightning", "reinforcement-learning"]
    data = ModelCardData(base_model=hub_base, library_name="diffusers", tags=tags,
                         pipeline_tag="text-to-video" if facts.video else "text-to-image")
    base = facts.base_model or "a tiny random model built offline (no base weights)"
    kind = "LoRA adapter" if facts.lora else "fine-tuned transformer"
    lines = [f"# {facts.method.upper()} {kind} for {facts.pipeline}", "",
             f"Fine-tuned from `{base}` with jagg_lightning by **{facts.method}** on the "
             f"reward **{facts.reward}** for **{facts.steps} steps**.", "", "## Training", "",
             "| setting | value |", "|---|---|"]
    lines += [f"| `{name}` | `{value}` |" for name, value in facts.settings.items()]
    if facts.metrics:
        lines += ["", "## Metrics (first → last)", "", "| metric | first | last |", "|---|---|---|",
                  *metric_lines(facts.metrics)]
    if facts.grid is not None:
        lines += ["", "## Samples", "", f"![sample grid: base model | fine-tuned, the same seeds]({GRID_FILE})"]
    lines += ["", "## Use it", "", *load_snippet(facts, hub_base)]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def load_snippet(facts: CardFacts, hub_base: str | None) -> list[str]:
    """How to load the export in diffusers and in peft (this folder is ``EXPORT``)."""
    base = hub_base or "BASE_MODEL_FOLDER"
    if not facts.lora:
        return ["```python", "import diffusers", "", "EXPORT = '.'  # this folder", f"pipe = diffusers.{facts.pipeline}"
                f".from_pretrained({base!r}, transformer=diffusers.AutoModel.from_pretrained(EXPORT + '/transformer'))",
                "```"]
    return ["```python", "import diffusers", "from peft import PeftModel", "", "EXPORT = '.'  # this folder",
            f"pipe = diffusers.{facts.pipeline}.from_pretrained({base!r})",
            "pipe.transformer.load_lora_adapter(EXPORT + '/diffusers', use_safetensors=True)  # diffusers",
            "pipe.fuse_lora()", "",
            f"transformer = diffusers.AutoModel.from_pretrained({base!r}, subfolder='transformer')",
            "transformer = PeftModel.from_pretrained(transformer, EXPORT + '/peft').merge_and_unload()  # peft",
            "```"]


def write_card(folder: Path, facts: CardFacts) -> Path:
    """``folder/README.md`` (and the grid as ``folder/samples.png``), each written crash-safely."""
    folder = Path(folder)
    if facts.grid is not None and Path(facts.grid).is_file():
        atomic_write(folder / GRID_FILE, lambda tmp: shutil.copyfile(facts.grid, tmp))
    elif facts.grid is not None:
        facts.grid = None
    text = str(render_card(facts))
    atomic_write(folder / CARD_FILE, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return folder / CARD_FILE


def card_facts(trainer, pl_module, metrics: dict[str, dict[int, float]]) -> CardFacts:
    """A run's card: the module's sections, the trainer's step and optimizer, the callbacks' latest grid."""
    policy, sampling, grpo, jagg = pl_module.policy_config, pl_module.sampling, pl_module.grpo, pl_module.jagg
    objective = pl_module.objective.config
    settings: dict[str, object] = {"policy.trainable": policy.trainable}
    if policy.trainable != "full":
        settings |= {"policy.lora_rank": policy.lora_rank, "policy.lora_alpha": policy.lora_alpha}
    settings |= {"objective.name": objective.name, "sampling.num_steps": sampling.num_steps,
                 "sampling.group_size": sampling.group_size, "sampling.noise_level": sampling.noise_level,
                 "trained steps": len(pl_module.trained_steps), "grpo.clip_range": grpo.clip_range,
                 "grpo.kl_beta": grpo.kl_beta, "jagg.window_size": jagg.window_size, "jagg.jagg_frac": jagg.jagg_frac,
                 "jagg.fused_rollout": jagg.fused_rollout}
    if trainer.optimizers:
        group = trainer.optimizers[0].param_groups[0]
        settings["optimizer"] = f"{type(trainer.optimizers[0]).__name__}, lr {group['lr']:g}"
    grids = [Path(p) for c in trainer.callbacks for p in getattr(c, "written", None) or []
             if Path(p).suffix == ".png" and Path(p).name.startswith("step_")]
    return CardFacts(pipeline=pl_module.policy.pipeline_class_name, base_model=policy.pretrained,
                     method=method_name(objective.name, jagg.jagg_frac), reward=pl_module.reward_fn.name,
                     steps=trainer.global_step, settings=settings, metrics=metrics, video=pl_module.policy.video,
                     lora=policy.trainable != "full", grid=grids[-1] if grids else None)
