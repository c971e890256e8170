"""What a config's model is, without its weights: :class:`ModelSpec` (the family, the transformer's config.json,
the VAE's compression, the native shape, the frozen components' parameter counts), from one of

* the shipped configs (``jagg_lightning/model_configs/<name>``: the published transformer config.json and a
  ``spec.json``), found by the hub id ``policy.pretrained`` names -- offline;
* a local pipeline folder (its ``model_index.json``, ``transformer/config.json``, ``vae/config.json``, the text
  encoders' ``config.json``);
* the family's tiny twin (``policy.pretrained: null``), built on the meta device.

:func:`meta_network` builds the transformer on the meta device (diffusers ``from_config`` under
``torch.device("meta")``) with the config's LoRA or full-training setup, :func:`fake_network` moves it into a
``FakeTensorMode`` (the parameters become fake tensors: shapes and dtypes, no storage), where one forward and
backward can be traced. Plain torch, no Lightning.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

SHIPPED = Path(__file__).resolve().parent.parent / "model_configs"


@dataclass
class ModelSpec:
    family: str
    transformer: dict  # the transformer's config.json (with ``_class_name``)
    source: str  # where it came from, for the table's title
    experts: int = 1  # trained networks of the transformer's config (Wan2.2 A14B: 2)
    vae_spatial: int = 8
    vae_temporal: int = 1
    native_size: tuple[int, int] = (1024, 1024)
    native_frames: int = 1
    clip_tokens: int = 0  # SD3: the CLIP tokens before T5's in the joint condition
    distilled: bool = False  # FLUX.2 [klein] step-distilled: no CFG
    boundary_ratio: float | None = None
    flow_shift: float = 1.0
    components: dict[str, int] = field(default_factory=dict)  # frozen parts (text encoders, VAE): parameter counts
    published: str = ""  # the published transformer size, with its source
    # what a conditioned family's images become (shapes.geometry): Qwen-Image-Edit's source area and Qwen2.5-VL's
    # patching (source_area, vision_patch, vision_merge, vision_min_pixels, vision_max_pixels); Wan2.1 I2V's CLIP
    # image tokens (image_tokens)
    condition: dict = field(default_factory=dict)

    def transformer_class(self) -> type[nn.Module]:
        import diffusers

        return getattr(diffusers, self.transformer["_class_name"])


def _class(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def count_meta(build) -> int:
    """Parameters of the module ``build()`` makes on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def component_count(entry: dict) -> int:
    """A frozen component's parameter count: built on meta from its config class, or its published count."""
    if "published" in entry:
        return int(entry["published"])
    cls = _class(entry["class"])
    if "config_class" in entry:
        config = _class(entry["config_class"])(**entry["config"])
        return count_meta(lambda: cls(config))
    return count_meta(lambda: cls.from_config(entry["config"]))


def shipped_specs() -> dict[str, Path]:
    """hub id -> shipped config folder."""
    found = {}
    for folder in sorted(p for p in SHIPPED.iterdir() if (p / "spec.json").is_file()):
        for hub_id in json.loads((folder / "spec.json").read_text())["hub_ids"]:
            found[hub_id] = folder
    return found


def shipped_spec(folder: Path, hub_id: str | None = None) -> ModelSpec:
    spec = json.loads((folder / "spec.json").read_text())
    return ModelSpec(
        family=spec["family"], transformer=json.loads((folder / "transformer_config.json").read_text()),
        source=f"{hub_id or folder.name} (shipped config: jagg_lightning/model_configs/{folder.name})",
        experts=spec.get("experts", 1), vae_spatial=spec["vae_spatial"], vae_temporal=spec.get("vae_temporal", 1),
        native_size=tuple(spec["native_size"]), native_frames=spec.get("native_frames", 1),
        clip_tokens=spec.get("clip_tokens", 0), distilled=hub_id in spec.get("distilled_ids", ()),
        boundary_ratio=spec.get("boundary_ratio"), flow_shift=spec.get("flow_shift", 1.0),
        components={name: component_count(entry) for name, entry in spec["components"].items()},
        published=spec.get("published_transformer", ""), condition=spec.get("condition", {}))


FAMILY_OF_PIPELINE = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux", "FluxKontextPipeline": "flux_kontext",
                      "Flux2KleinPipeline": "flux2",
                      "Flux2Pipeline": "flux2_dev", "QwenImagePipeline": "qwen_image", "WanPipeline": "wan",
                      "QwenImageEditPipeline": "qwen_image_edit",
                      "ZImagePipeline": "z_image",
                      "WanImageToVideoPipeline": "wan_i2v",
                      "LTX2Pipeline": "ltx2", "LTX2ImageToVideoPipeline": "ltx2_i2v",
                      "HunyuanVideo15Pipeline": "hunyuan_video15",
                      "HunyuanVideo15ImageToVideoPipeline": "hunyuan_video15_i2v"}
# a family whose folder's model_index.json names another family's pipeline: named by policy.family (LTX-2's one
# checkpoint runs as LTX2Pipeline and as LTX2ImageToVideoPipeline)
SAME_FOLDER = {"wan22_ti2v": ("wan", "wan_i2v"), "ltx2_i2v": ("ltx2",)}
VIDEO = {"wan": ((480, 832), 81), "wan_i2v": ((480, 832), 81), "wan22_ti2v": ((704, 1280), 121),
         "ltx2": ((512, 768), 121), "ltx2_i2v": ((512, 768), 121), "hunyuan_video15": ((480, 848), 121),
         "hunyuan_video15_i2v": ((480, 848), 121)}  # native shapes (HunyuanVideo 1.5: from target_size, below)
HUNYUAN_VIDEO15 = ("hunyuan_video15", "hunyuan_video15_i2v")


def local_spec(folder: Path, named: str | None = None) -> ModelSpec:
    """A local diffusers pipeline folder, read from its JSON files only (``named``: ``policy.family``, where the
    folder's pipeline class does not say it)."""
    index = json.loads((folder / "model_index.json").read_text())
    family = FAMILY_OF_PIPELINE.get(index["_class_name"])
    if named in SAME_FOLDER and family in SAME_FOLDER[named]:
        family = named
    elif family == "wan_i2v" and index.get("expand_timesteps"):
        family = "wan22_ti2v"  # Wan2.2 TI2V-5B: its folder says WanPipeline, its image-to-video mode is this family
    if family is None:
        raise ValueError(f"policy.pretrained: jagg plan has no memory plan for {index['_class_name']} yet "
                         f"(planned: {', '.join(FAMILY_OF_PIPELINE)})")
    read = lambda part: json.loads((folder / part / "config.json").read_text())  # noqa: E731
    vae = read("vae")
    if family in ("ltx2", "ltx2_i2v"):  # AutoencoderKLLTX2Video: its patch side x 2 per scaling block, or its ratios
        scaling = sum(map(bool, vae.get("spatio_temporal_scaling", (True,) * 4)))
        spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 4) * 2 ** scaling
        temporal = vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * 2 ** scaling
    elif family in HUNYUAN_VIDEO15:  # AutoencoderKLHunyuanVideo15: 16x in space, 4x in time unless it says
        spatial, temporal = int(vae.get("spatial_compression_ratio", 16)), int(vae.get("temporal_compression_ratio", 4))
    elif vae.get("scale_factor_spatial"):
        spatial, temporal = int(vae["scale_factor_spatial"]), int(vae.get("scale_factor_temporal", 4))
    elif vae.get("temperal_downsample") is not None:
        spatial, temporal = 2 ** len(vae["temperal_downsample"]), 2 ** sum(map(bool, vae["temperal_downsample"]))
    else:
        spatial, temporal = 2 ** (len(vae["block_out_channels"]) - 1), 1
    components = {}
    for name, entry in index.items():
        if not isinstance(entry, list) or entry[0] is None or not (folder / name / "config.json").is_file():
            continue
        if name.startswith("transformer"):
            continue
        library, cls_name = entry  # a pipeline's own module (LTX-2's "ltx2": its connectors) is diffusers'
        module = library if library in ("diffusers", "transformers") else f"diffusers.pipelines.{library}"
        cls = getattr(importlib.import_module(module), cls_name)
        if library == "transformers":
            config = _class("transformers.AutoConfig").from_pretrained(folder / name)
            components[name] = count_meta(lambda: cls(config))
        else:
            components[name] = count_meta(lambda: cls.from_config(read(name)))
    transformer = read("transformer")
    sample = (vae.get("sample_size") or (transformer.get("sample_size", 128) * spatial))
    sample = sample if isinstance(sample, int) else sample[0]
    tokenizer = folder / "tokenizer" / "tokenizer_config.json"
    clip = json.loads(tokenizer.read_text()).get("model_max_length", 77) if family == "sd3" and tokenizer.is_file() else 0
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    native, frames = VIDEO.get(family, ({"qwen_image": (1024, 1024)}.get(family, (sample, sample)), 1))
    if family in HUNYUAN_VIDEO15:
        native = hunyuan_default_size(transformer.get("target_size", 640), spatial)
    return ModelSpec(family, transformer, f"{folder} (local pipeline)", experts=2 if (index.get("transformer_2") or
                     [None])[0] else 1, vae_spatial=spatial, vae_temporal=temporal, native_size=native,
                     native_frames=frames, clip_tokens=clip,
                     distilled=bool(index.get("is_distilled", False)), boundary_ratio=index.get("boundary_ratio"),
                     flow_shift=float(scheduler.get("flow_shift") or scheduler.get("shift") or 1.0),
                     components=components, condition=local_condition(folder, family))


def hunyuan_default_size(target_size: int, spatial: int) -> tuple[int, int]:
    """HunyuanVideo 1.5's default (H, W): its pipelines' 16:9 bucket at the transformer's ``target_size`` (480 x 848
    at 640)."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    return tuple(HunyuanVideo15ImageProcessor(vae_scale_factor=spatial).calculate_default_height_width(9, 16,
                                                                                                       target_size))


def hunyuan_condition(family: str, tokenizer_2_max_length: int, vision: dict | None) -> dict:
    """HunyuanVideo 1.5's condition beside Qwen2.5-VL's tokens: ByT5's glyph tokens (the pipeline's
    ``tokenizer_2_max_length``, 256: the bound, a prompt quoting no text uses one) and, image-to-video, SigLIP's
    patches (``vision``: its vision config; 729 at 384 px, 14 px patches). Text-to-video passes one zero image
    token (HunyuanVideo15Policy.model_inputs), the Geometry's default."""
    condition = {"glyph_tokens": tokenizer_2_max_length}
    if family == "hunyuan_video15_i2v" and vision is not None:
        condition["image_tokens"] = (vision["image_size"] // vision["patch_size"]) ** 2
    return condition


def local_condition(folder: Path, family: str) -> dict:
    """:attr:`ModelSpec.condition` from a local folder: the CLIP image encoder's tokens (Wan2.1 I2V), Qwen2.5-VL's
    patching from the processor's ``preprocessor_config.json`` (Qwen-Image-Edit's published folder) or the
    ``image_processor`` of its ``processor_config.json`` (as transformers 5 saves a processor), HunyuanVideo 1.5's
    glyph and SigLIP tokens."""
    if family == "wan_i2v" and (folder / "image_encoder" / "config.json").is_file():
        vision = json.loads((folder / "image_encoder" / "config.json").read_text())
        return {"image_tokens": (vision["image_size"] // vision["patch_size"]) ** 2 + 1}
    if family in HUNYUAN_VIDEO15:
        encoder = folder / "image_encoder" / "config.json"
        return hunyuan_condition(family, hunyuan_glyph_tokens(), json.loads(encoder.read_text()) if encoder.is_file()
                                 else None)
    if family == "qwen_image_edit":
        legacy, unified = folder / "processor" / "preprocessor_config.json", folder / "processor" / "processor_config.json"
        if legacy.is_file():
            return vision_patching(json.loads(legacy.read_text()))
        return vision_patching(json.loads(unified.read_text())["image_processor"])
    return {}


def vision_patching(processor: dict) -> dict:
    """Qwen-Image-Edit's condition: the source area ``QwenImageEditPipeline`` resizes to and Qwen2.5-VL's patching
    (``Qwen2VLImageProcessor``'s settings: its ``min_pixels`` / ``max_pixels``, or ``size``'s
    ``shortest_edge`` / ``longest_edge``)."""
    from jagg_lightning.policies.qwen_image_edit import SOURCE_AREA

    size = processor.get("size") or {}
    return {"source_area": SOURCE_AREA, "vision_patch": int(processor.get("patch_size", 14)),
            "vision_merge": int(processor.get("merge_size", 2)),
            "vision_min_pixels": int(processor.get("min_pixels") or size.get("shortest_edge", 56 * 56)),
            "vision_max_pixels": int(processor.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280))}


def twin_spec(family: str) -> ModelSpec:
    """The family's tiny twin (``policy.pretrained: null``), its pipeline built on the meta device."""
    from jagg_lightning.policies import FAMILIES

    with torch.device("meta"):
        pipe = FAMILIES[family].policy_class().build_tiny_pipeline(0)
    comps = {n: sum(p.numel() for p in m.parameters()) for n, m in pipe.components.items()
             if isinstance(m, nn.Module) and not n.startswith("transformer")}
    vae = pipe.vae.config
    if family in ("wan", "wan22", "wan_i2v", "wan22_ti2v"):
        spatial, temporal, native, frames = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal, 32, 9
    elif family in ("ltx2", "ltx2_i2v"):
        spatial, temporal, native, frames = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio, 32, 9
    elif family in HUNYUAN_VIDEO15:
        spatial, temporal, frames = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal, 9
        native = hunyuan_default_size(pipe.transformer.config.target_size, spatial)[0]
    else:
        spatial = getattr(pipe, "vae_scale_factor", None) or 2 ** (len(vae.block_out_channels) - 1)
        temporal, frames = 1, 1
        tiny = getattr(FAMILIES[family].policy_class(), "tiny_size", None)  # Qwen-Image's: 32 px, Edit's 64
        native = pipe.transformer.config.sample_size * spatial if family == "sd3" else tiny \
            or vae.get("sample_size") or pipe.default_sample_size * spatial
        native = native if isinstance(native, int) else native[0]
    config = dict(pipe.transformer.config) | {"_class_name": type(pipe.transformer).__name__}
    two = getattr(pipe, "transformer_2", None) is not None
    return ModelSpec("wan" if family == "wan22" else family, config, f"the tiny {family} twin (policy.pretrained: null)",
                     experts=2 if two else 1, vae_spatial=spatial, vae_temporal=temporal, native_size=(native, native),
                     native_frames=frames, clip_tokens=getattr(pipe, "tokenizer_max_length", 0) if family == "sd3" else 0,
                     boundary_ratio=pipe.config.get("boundary_ratio"), flow_shift=float(
                         pipe.scheduler.config.get("shift") or 1.0), components=comps,
                     condition=twin_condition(family, pipe))


def twin_condition(family: str, pipe) -> dict:
    """:attr:`ModelSpec.condition` of a twin's pipeline: its CLIP image encoder's tokens (Wan2.1 I2V), its VL
    processor's patching (Qwen-Image-Edit) -- the same rules as :func:`local_condition`."""
    if family == "wan_i2v" and pipe.image_encoder is not None:
        encoder = pipe.image_encoder.config
        return {"image_tokens": (encoder.image_size // encoder.patch_size) ** 2 + 1}
    if family == "qwen_image_edit":
        return vision_patching(pipe.processor.image_processor.to_dict())
    if family in HUNYUAN_VIDEO15:
        encoder = getattr(pipe, "image_encoder", None)
        return hunyuan_condition(family, pipe.tokenizer_2_max_length, None if encoder is None else
                                 encoder.config.to_dict())
    return {}


def hunyuan_glyph_tokens() -> int:
    """The ByT5 length HunyuanVideo 1.5's pipelines encode to (``tokenizer_2_max_length``, set in ``__init__``)."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    return int(inspect.signature(HunyuanVideo15Pipeline._get_byt5_prompt_embeds).parameters["tokenizer_max_length"]
               .default)


# the families jagg plan sizes (shapes.geometry), one a line; a named other one is refused before anything is read
PLANNED_FAMILIES = (
    "sd3",
    "flux",
    "flux_kontext",
    "flux2",
    "flux2_dev",
    "qwen_image",
    "qwen_image_edit",
    "z_image",
    "wan",
    "wan22",
    "wan_i2v",
    "wan22_ti2v",
    "ltx2",
    "ltx2_i2v",
    "hunyuan_video15",
    "hunyuan_video15_i2v",
)


def model_spec(policy) -> ModelSpec:
    """The :class:`ModelSpec` of a ``PolicyConfig``: the tiny twin, a shipped config (by hub id) or a local folder."""
    from jagg_lightning.utils.assets import find_local

    if policy.family is not None and policy.family not in PLANNED_FAMILIES:
        raise ValueError(f"policy.family: jagg plan has no memory plan for the {policy.family} family yet (planned: "
                         f"{', '.join(PLANNED_FAMILIES)})")
    if policy.pretrained is None:
        return twin_spec(policy.family or "sd3")
    local = find_local(policy.pretrained)
    if local is not None and (Path(local) / "model_index.json").is_file():
        return local_spec(Path(local), policy.family)
    shipped = shipped_specs()
    if policy.pretrained in shipped:
        spec = shipped_spec(shipped[policy.pretrained], policy.pretrained)
        if spec.family in SAME_FOLDER.get(policy.family, ()):  # LTX-2's checkpoint as image-to-video
            spec.family = policy.family
        return spec
    raise ValueError(f"policy.pretrained: {policy.pretrained!r} is neither a local pipeline folder nor a hub id with a "
                     f"shipped config (jagg plan works offline; shipped: {', '.join(sorted(shipped))})")


def meta_network(spec: ModelSpec, policy, default_targets: list[str], sharded: bool = False) -> nn.Module:
    """The transformer on the meta device, as the policy would train it: frozen weights in ``policy.dtype`` with the
    peft LoRA (float32 weights) of ``policy.lora_*``, or (``trainable: full``) float32 masters of the modules
    ``trainable_modules`` names -- computing in float32 on one process, in ``policy.dtype`` under FSDP2
    (``sharded``: its mixed-precision policy all-gathers the parameters in that dtype); ``gradient_checkpointing``
    as configured."""
    from jagg_lightning.models.adapters import add_lora
    from jagg_lightning.models.full_finetune import make_trainable
    from jagg_lightning.utils.dtypes import DTYPES

    dtype = DTYPES[policy.dtype]
    with torch.device("meta"):
        network = spec.transformer_class().from_config(spec.transformer)
    nn.Module.to(network, dtype)
    network.requires_grad_(False)
    if policy.trainable == "full":
        make_trainable(network, policy.trainable_modules, dtype)
        if sharded:
            nn.Module.to(network, dtype)
    else:
        targets = list(policy.lora_targets if policy.lora_targets is not None else default_targets)
        add_lora(SimpleNamespace(family=spec.family), network,
                 {"r": policy.lora_rank, "lora_alpha": policy.lora_alpha, "target_modules": targets}, 0, dtype)
    if policy.gradient_checkpointing:
        network.enable_gradient_checkpointing()
    return network


def fake_network(network: nn.Module, device: str = "cpu") -> nn.Module:
    """Replace every parameter and buffer of a meta ``network`` by a fake tensor of the same shape, dtype and
    ``requires_grad`` (call inside the ``FakeTensorMode`` that will run it: nothing is allocated)."""
    for module in network.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                        requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return network
