"""Every YAML preset parses and prints as a complete config (``jagg fit --config P --print_config``, the way a
user starts from one) without building a model; in-process (a subprocess per preset cost ~6 s of imports).
Ranges and the build of everything but the weights: tests/cli/test_presets.py."""

from pathlib import Path

import pytest
import yaml

import jagg_lightning.module as module_lib
from jagg_lightning.cli import cli_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_preset_parses(preset, capsys, monkeypatch):
    monkeypatch.setattr(module_lib, "build_policy", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.chdir(ROOT)  # the presets name files relative to the repository root, as the README runs them
    with pytest.raises(SystemExit) as info:
        cli_main(["fit", "--config", f"configs/{preset}", "--print_config"])
    out = capsys.readouterr()
    assert info.value.code in (0, None), out.err[-2000:]
    printed = yaml.safe_load(out.out)
    assert {"window_size", "jagg_frac"} <= set(printed["model"]["jagg"]), printed["model"]["jagg"]
