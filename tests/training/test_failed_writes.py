"""A failed write loses nothing (issue 31, item 4): a checkpoint, adapter or full export whose write fails part-way
(a real EFBIG past a file size limit, as a full disk gives ENOSPC; or the writer killed) leaves the previous one
byte for byte and loadable, leaves no temporary file, and raises one error naming the path; ``ModelCheckpoint``'s
retention (``save_top_k``, ``save_last``, ``save_last="link"``) deletes nothing when the new checkpoint's write
fails; ``jagg fit`` shows it as one ``jagg: error:`` line and resumes from the previous checkpoint."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from helpers import TINY_TARGETS
from in_process import jagg_in_process
from launch import search_path
from write_faults import build, checkpoint_of, digests, write

from jagg_lightning.models.adapters import lora_state_dict, read_adapter, save_adapter

pytestmark = pytest.mark.subprocess

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "write_faults.py"
ROOT = Path(__file__).resolve().parents[2]


def temps(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if ".tmp-" in p.name or p.name.endswith(".old") or ".old-" in p.name]


def run_child(*args, script=None):
    command = [sys.executable, str(SCRIPT) if script is None else "-c", *([] if script is None else [script]), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=search_path(), OMP_NUM_THREADS="1"))


def check_previous_loads(kind, target, previous):
    if kind == "checkpoint":
        loaded = torch.load(target, weights_only=True)
        assert loaded["global_step"] == previous["global_step"]
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in previous["state_dict"].items())
    elif kind == "adapter":
        _, weights = read_adapter(target)
        assert all(torch.equal(weights[k], v) for k, v in lora_state_dict(previous.transformer).items())
    else:
        from diffusers import SD3Transformer2DModel

        loaded = SD3Transformer2DModel.from_pretrained(target).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in previous.transformer.state_dict().items())


@pytest.mark.parametrize("kind", ["checkpoint", "adapter", "full_export"])
def test_write_past_a_file_size_limit_keeps_the_previous_one(kind, tmp_path, rng_seed):
    seed = rng_seed % 10_000
    folder = tmp_path / "out"
    target = folder / ("last.ckpt" if kind == "checkpoint" else "last")
    previous = build(kind, seed)
    write(kind, previous, target, seed)
    before = digests(folder)
    sizes = sorted(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    limit = sizes[-1] * 3 // 4  # the largest file fails part-way; the smaller ones before it are written whole
    proc = run_child(kind, str(target), str(seed + 1), str(limit))
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    assert digests(folder) == before  # byte for byte, and nothing beside it (no temporary file or folder)
    assert not temps(tmp_path)
    check_previous_loads(kind, target, previous)
    error = json.loads(proc.stdout.strip().splitlines()[-1])
    assert error["type"] == "WriteError", error
    assert repr(str(target)) in error["message"] and "File too large" in error["message"], error


KILLED = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path
    import jagg_lightning.faults.io as io
    from write_faults import build, write
    kind, target, seed, moment = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    what = build(kind, seed)
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if moment == "between_renames":  # no RENAME_EXCHANGE (NFS, Lustre); killed once target went to .old
        io.exchange = lambda a, b: False
        kills = lambda src, dst: Path(dst) == target
    else:  # killed when the new one is written whole, as it is about to replace the previous one
        io.exchange = die
        kills = lambda src, dst: target in (Path(src), Path(dst))
    def killing(real):
        return lambda src, dst, *a, **k: die() if kills(src, dst) else real(src, dst, *a, **k)
    os.rename, os.replace = killing(os.rename), killing(os.replace)
    write(kind, what, target, seed)
''')


@pytest.mark.parametrize("moment", ["before_the_swap", "between_renames"])
def test_killed_adapter_write_leaves_the_previous_findable_and_the_next_write_cleans_up(moment, tmp_path, rng_seed):
    seed = rng_seed % 10_000
    target = tmp_path / "lora" / "last"
    previous = build("adapter", seed)
    save_adapter(previous, target, step=1)
    proc = run_child("adapter", str(target), str(seed + 1), moment, script=KILLED)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert temps(tmp_path)  # the killed write left its folder behind
    if moment == "between_renames":
        assert not target.exists()  # the window itself: the previous adapter is at .last.old
    check_previous_loads("adapter", target, previous)  # the project's readers find it meanwhile
    new = build("adapter", seed + 2)
    save_adapter(new, target, step=3)  # recovers, replaces, removes what the killed write left
    check_previous_loads("adapter", target, new)
    assert not temps(tmp_path) and sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["last"]


def fit_config(root: Path, checkpoint: dict, fail: str | None, steps: int) -> dict:
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(root / "ckpt"), "every_n_train_steps": 1, **checkpoint}}]
    if fail is None:
        callbacks.append({"class_path": "write_faults.RecordStart", "init_args": {"record": str(root.parent / "start")}})
    else:
        callbacks.append({"class_path": "write_faults.LimitFileSizeAt",
                          "init_args": {"step": 3, "watch": str(root), "record": str(root.parent / "record.json"),
                                        "fail": fail}})
    return {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": steps, "enable_progress_bar": False, "logger": False,
                    "enable_model_summary": False, "default_root_dir": str(root), "callbacks": callbacks},
        "model": {"policy": {"lora_rank": 4, "lora_alpha": 8, "lora_targets": TINY_TARGETS, "guidance_scale": 1.0,
                             "max_sequence_length": 4},
                  "sampling": {"num_steps": 4, "group_size": 2, "rollout_batch_size": 4},
                  "grpo": {"train_batch_size": 4}, "jagg": {"window_size": 2}},
        "data": {"prompts": ["a red cat", "a blue dog", "a green tree", "a yellow sun"], "batch_size": 2},
        "lora_export": {"dirpath": str(root / "lora")},
    }


def jagg_fit(config: dict, path: Path, *args: str):
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "jagg_lightning", "fit", "--config", str(path), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=search_path(), OMP_NUM_THREADS="1"))


RETENTION = {"top1_and_last": {"save_top_k": 1, "save_last": True},
             "top2_by_step_and_last": {"save_top_k": 2, "monitor": "step", "mode": "max", "save_last": True},
             "last_as_link": {"save_top_k": 1, "save_last": "link"}}


@pytest.mark.slow
@pytest.mark.parametrize("retention, fail", [("top1_and_last", "checkpoint"), ("top2_by_step_and_last", "checkpoint"),
                                             ("last_as_link", "checkpoint"), ("top1_and_last", "adapter")])
def test_jagg_fit_whose_third_checkpoint_write_fails_keeps_every_kept_checkpoint_and_resumes(retention, fail,
                                                                                           tmp_path, capfd,
                                                                                           monkeypatch):
    """The failing fit is a real `jagg` process (its file size limit is the process's); the resume, read only for
    its exit status and what it wrote, runs the console entry point in this process."""
    root = tmp_path / "run"
    proc = jagg_fit(fit_config(root, RETENTION[retention], fail, steps=4), tmp_path / "fit.yaml")
    assert proc.returncode == 1, proc.stderr[-4000:]
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and lines[-1].startswith("jagg: error: could not write "), proc.stderr[-4000:]
    assert sum(line.startswith("jagg: error:") for line in lines) == 1
    failed = Path(lines[-1].split("'")[1])
    assert "File too large" in lines[-1]
    if fail == "checkpoint":
        assert failed.parent == root / "ckpt" and failed.suffix == ".ckpt" and not failed.exists()
    else:
        assert failed == root / "lora" / "last"
    recorded = json.loads((tmp_path / "record.json").read_text())["digests"]  # before step 3's checkpoint
    now = digests(root)
    kept = {k: v for k, v in recorded.items() if k.startswith("ckpt/")}
    assert kept and {k: v for k, v in now.items() if k.startswith("ckpt/")} == kept  # nothing deleted or changed
    assert not temps(root)
    for name in kept:  # every kept checkpoint loads (last.ckpt: the file or what the link points to)
        assert torch.load(root / name, weights_only=True)["global_step"] in (1, 2)
    assert torch.load(root / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 2
    adapter = json.loads((root / "lora" / "last" / "adapter.json").read_text())
    assert adapter["global_step"] == (3 if fail == "checkpoint" else 2)  # written whole before the checkpoint failed
    read_adapter(root / "lora" / "last")
    if fail == "adapter":
        assert now["lora/last/peft/adapter_model.safetensors"] == recorded["lora/last/peft/adapter_model.safetensors"]
    if retention != "top1_and_last" or fail != "checkpoint":
        return
    (tmp_path / "resume.yaml").write_text(yaml.safe_dump(fit_config(root, RETENTION[retention], None, steps=4)))
    resumed = jagg_in_process("fit", "--config", tmp_path / "resume.yaml", "--ckpt_path", root / "ckpt" / "last.ckpt",
                              cwd=ROOT, capfd=capfd, monkeypatch=monkeypatch)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    last = torch.load(root / "ckpt" / "last.ckpt", weights_only=True)
    assert (tmp_path / "start").read_text() == "2"  # from the last good checkpoint
    assert last["global_step"] == 4 and (root / "lora" / "final" / "adapter.json").is_file()
    assert json.loads((root / "lora" / "final" / "adapter.json").read_text())["global_step"] == 4
