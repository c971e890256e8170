"""Launch a test script on several CPU processes the way ``torchrun`` does (its environment variables),
without pytest in the ranks: plain ``ddp`` inside pytest would re-run the whole test session in every rank."""

import os
import socket
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def search_path() -> str:
    """PYTHONPATH for a script the tests launch: the project root, tests/support and every test folder (rank
    scripts import their own test module's constants)."""
    folders = [TESTS.parent, TESTS / "support", *sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name not in
                                                           ("support", "fixtures", "__pycache__"))]
    return os.pathsep.join([*map(str, folders), os.environ.get("PYTHONPATH", "")])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lightning_ddp_weights(tmp_path: Path, script_text: str, seed: int, timeout: float = 600) -> list[dict]:
    """Run ``script_text`` (it launches its own ranks with Lightning's DDP and saves each rank's trainable weights to
    ``rank<r>.safetensors`` in ``argv[1]``) with ``argv = [tmp_path, seed]``; returns [rank 0's, rank 1's]."""
    from safetensors.torch import load_file

    script = tmp_path / "ddp_run.py"
    script.write_text(script_text)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(seed)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=timeout, env=dict(os.environ, PYTHONPATH=search_path()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [load_file(tmp_path / f"rank{r}.safetensors") for r in (0, 1)]


def run_ranks(script: Path | list[str], *args: str, world: int = 2, timeout: float = 120,
              cwd: Path | None = None, stderr: list[str] | None = None) -> list[str]:
    """Run ``python script args...`` as ``world`` ranks of one job; returns each rank's stdout (``stderr``, a list:
    each rank's stderr appended to it). ``script`` may be a list of interpreter arguments instead
    (``["-m", "jagg_lightning", "fit"]``).

    Every rank gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
    MASTER_ADDR, MASTER_PORT), so Lightning uses its TorchElasticEnvironment and launches nothing itself.
    """
    procs = start_ranks(script, *args, world=world, cwd=cwd)
    outputs, failed = [], []
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            outputs.append(out)
            if stderr is not None:
                stderr.append(err)
            if p.returncode != 0:
                failed.append(f"rank {r} exited {p.returncode}:\n{err[-4000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert not failed, "\n".join(failed)
    return outputs


def start_ranks(script: Path | list[str], *args: str, world: int = 2, cwd: Path | None = None,
                **popen) -> list[subprocess.Popen]:
    """The ``world`` rank processes of :func:`run_ranks`, started (text pipes for stdout and stderr)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", OMP_NUM_THREADS="1", PYTHONPATH=search_path())
    return [subprocess.Popen([sys.executable, *(script if isinstance(script, list) else [str(script)]), *args],
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=cwd, **popen)
            for r in range(world)]
