"""A reduced benchmarks/fidelity.py: the pipeline runs end to end and every number is finite."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fidelity_benchmark_smoke(tmp_path):
    # the benchmark pins one thread itself (--threads 1) and so changes the process setting: restore it
    import torch

    threads = torch.get_num_threads()
    try:
        _run_smoke(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _run_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("fidelity", ROOT / "benchmarks" / "fidelity.py")
    fidelity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fidelity)
    result = fidelity.main(["--seeds", "0", "--steps", "2", "--configs", "exact", "W=4 frac=1", "--windows", "3",
                            "--fidelity-prompts", "1", "--eval-every", "2", "--eval-samples", "1", "--eval-prompts", "10",
                            "--out", str(tmp_path)])
    assert (tmp_path / "fidelity.png").stat().st_size > 0
    saved = json.loads((tmp_path / "fidelity.json").read_text())
    assert set(saved["summary"]["curves"]) == {"exact", "W=4 frac=1"}
    for run in result["runs"]:
        assert len(run["reward"]) == 2 and all(math.isfinite(v) for v in run["reward"] + run["wall"] + run["cpu"])
        assert all(0 <= e["accuracy"] <= 1 for e in run["evals"])
    rows = result["runs"][0]["fidelity"]
    assert rows, "the exact run must record gradient-fidelity windows"
    for row in rows:
        for key in ("cosine", "rel_error", "residual", "cosine_rule"):
            assert math.isfinite(row[key]), (key, row)
        assert -1 - 1e-9 <= row["cosine"] <= 1 + 1e-9 and row["rel_error"] >= 0
    for name, f in saved["summary"]["fidelity"].items():
        assert f["windows"] > 0, name
    by_window = saved["summary"]["fidelity_by_window"]  # per window: its steps in its name, every row counted once
    assert sum(f["windows"] for f in by_window.values()) == len(rows)
    assert all(0 <= f["rel_error_mean"] and -1 - 1e-9 <= f["cosine_min"] <= 1 + 1e-9 for f in by_window.values())
