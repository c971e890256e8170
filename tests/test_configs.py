"""Every YAML preset parses and validates (dataclass ranges included) without building a model."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_preset_parses(preset):
    proc = subprocess.run([sys.executable, "-m", "jagg_lightning", "fit", "--config", f"configs/{preset}", "--print_config"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "window_size" in proc.stdout and "jagg_frac" in proc.stdout
