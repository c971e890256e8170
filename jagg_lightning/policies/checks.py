"""The checks of a policy config that need more than its own fields -- the family registry and the files it names --
in one place, run when the config is checked (``JAGGModule.__init__``), before any model is built.

:class:`~jagg_lightning.config.PolicyConfig` checks its fields alone (no I/O); :func:`check_policy` adds

* ``policy.family``: a registered family (or null: detected);
* ``policy.pretrained`` / ``policy.adapter``: a local path is found from any directory (:mod:`jagg_lightning.utils.assets`)
  or fails naming the field; an adapter folder must hold an export (``peft/`` or ``diffusers/``);
* what a local pipeline folder's JSON files tell (and, for the built-in tiny twin, its own configs built on the meta
  device): a ``policy.resolution`` its family cannot take (``vae/`` and
  ``transformer/config.json``), a ``policy.adapter`` whose parts are for other networks than the family trains
  (``model_index.json``: a Wan2.1 adapter on Wan2.2, or the reverse). A hub id is checked when the model is built,
  as is a folder that is not a diffusers pipeline (the build names what is missing).
"""

from __future__ import annotations

import json

from jagg_lightning.config import PolicyConfig
from jagg_lightning.models.adapters import adapter_files, adapter_format
from jagg_lightning.policies import check_family, detect_family
from jagg_lightning.utils.assets import find_local, resolve_path


def check_policy(config: PolicyConfig) -> None:
    """Every check of ``config`` that reads the registry or the files it names (see the module docstring)."""
    if config.family is not None:
        check_family(config.family)
    resolve_path(config.pretrained, "policy.pretrained", hub=True)
    if config.adapter is not None:
        adapter_format(find_local(config.adapter) or resolve_path(config.adapter, "policy.adapter", kind="folder or file"))
    check_against_folder(config)


def check_against_folder(config: PolicyConfig) -> None:
    """What a local pipeline folder's files tell before any model is built (the module docstring's last item); for
    the built-in tiny twin (``pretrained`` null) the resolution against the twin's own configs."""
    if config.pretrained is None and config.resolution is not None:
        cls = detect_family(config).policy_class()
        multiple = tiny_pixel_multiple(cls)
        if multiple is not None:
            cls.check_resolution(config.resolution, multiple)
        return
    folder = find_local(config.pretrained) if config.pretrained is not None else None
    if folder is None or not (folder / "model_index.json").is_file() or (config.resolution is None
                                                                         and config.adapter is None):
        return
    cls = detect_family(config).policy_class()
    files = [folder / part / "config.json" for part in ("vae", "transformer")]
    if config.resolution is not None and all(f.is_file() for f in files):
        vae, transformer = (json.loads(f.read_text()) for f in files)
        cls.check_resolution(config.resolution, cls.pixel_multiple(vae, transformer))
    if config.adapter is not None:
        expected = cls.trained_network_names(json.loads((folder / "model_index.json").read_text()))
        _, parts = adapter_files(find_local(config.adapter) or config.adapter)
        if set(parts) != expected:
            raise ValueError(cls.adapter_mismatch(config.adapter, parts, expected))


def tiny_pixel_multiple(cls) -> int | None:
    """What ``policy.resolution`` must be a multiple of on ``cls``'s tiny twin: its VAE and transformer configs, built
    on the meta device (no weights, a fraction of a second). None where a twin cannot be built there (Z-Image's
    calls ``.item()`` while building): its build checks the resolution."""
    import torch

    try:
        with torch.device("meta"):
            pipeline = cls.build_tiny_pipeline(0, torch.float32)
    except (RuntimeError, NotImplementedError):
        return None
    return cls.pixel_multiple(pipeline.vae.config, pipeline.transformer.config)
