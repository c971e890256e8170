"""Every shipped GPU preset fits the hardware its header names (issue 44): ``jagg plan --config configs/<preset>.yaml``,
offline, with the preset's own ``trainer.devices x trainer.num_nodes`` and the plan's default 80 GiB per device, exits
0 and says FITS; and the GPU count the header names ("a GPU", "8 GPUs") is that device count. A preset that does not
fit (as ``sd35_medium.yaml`` did: 92.19 GiB on one 80 GiB GPU, its anchor pass batched) fails here, not at the first
out-of-memory error on a rented GPU; so does a preset whose family ``jagg plan`` has no plan for (nothing is skipped:
every family is planned, issue 56).

Each plan traces the preset's transformer on the meta device (5-15 s of CPU each), in this process (the entry point
itself: ``tests/support/in_process.py``), so Lightning is imported once for all of them."""

import re
from pathlib import Path

import pytest
import yaml

from in_process import jagg_in_process

ROOT = Path(__file__).resolve().parents[2]
NUMBERS = {"a": 1, "one": 1, "two": 2, "four": 4, "eight": 8}


def gpu_presets() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")
                  if (yaml.safe_load(p.read_text()).get("trainer") or {}).get("accelerator") == "gpu")


def header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines)


def gpus_named(text: str) -> int | None:
    """The GPU count the header names first ("and a GPU", "8 GPUs"), or None."""
    found = re.search(r"\b(a|one|two|four|eight|\d+) GPUs?\b", text)
    return None if found is None else int(NUMBERS.get(found.group(1), found.group(1)))


def test_the_gpu_presets_are_the_ones_planned():
    presets = gpu_presets()
    assert {"sd35_medium", "flux_dev", "wan22_t2v_a14b"} <= set(presets), presets
    assert gpus_named("Needs the model and a GPU.") == 1 and gpus_named("needs 8 GPUs: the 24B") == 8
    assert gpus_named("GPUs with bf16") is None


@pytest.mark.slow
@pytest.mark.parametrize("preset", gpu_presets())
def test_preset_fits_the_gpus_its_header_names(preset, capfd, monkeypatch):
    path = ROOT / "configs" / f"{preset}.yaml"
    trainer = yaml.safe_load(path.read_text())["trainer"]
    devices = int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))
    named = gpus_named(header(path))
    assert named in (None, devices), f"{path.name}: the header names {named} GPU(s), trainer.devices says {devices}"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = jagg_in_process("plan", "--config", f"configs/{preset}.yaml", cwd=ROOT, capfd=capfd,
                           monkeypatch=monkeypatch)
    assert f"{devices} device(s) of 80 GiB" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0 and "FITS" in proc.stdout.splitlines()[-1], (
        f"{path.name} does not fit the {devices} GPU(s) it names:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
