"""`jagg` run in the test's own process: the console entry point itself (``jagg_lightning.cli.main``), its exit
status and everything written to the stdout / stderr file descriptors.

A `jagg` subprocess spends ~9 s of CPU importing Lightning before it does anything; a test that only reads what a
command wrote, printed or exited with runs it here. What stays a real `jagg` process: exit statuses on signals,
what a process imports, and a run's stderr read as a whole for warnings (pytest's own warning filters and log
capture stand between a warning or a logger and the file descriptor here).

What a process would have kept to itself is put back afterwards: the working directory, ``sys.argv``, the
environment (``seed_everything`` writes ``PL_GLOBAL_SEED``, which processes launched later would inherit), the
global random streams, a W&B run, torch's threads, the Ctrl-C handler and the levels of the loggers the entry point quiets."""

import logging
import os
import random
import signal
import subprocess
import sys

import numpy as np
import torch


def jagg_in_process(*args, cwd, capfd, monkeypatch) -> subprocess.CompletedProcess:
    """``jagg args...`` from ``cwd``: a CompletedProcess with its exit status, stdout and stderr (``capfd``'s)."""
    from jagg_lightning.cli import main
    from jagg_lightning.cli.quiet import QUIET_LOGGERS

    args = list(map(str, args))
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["jagg", *args])
    environment, levels = dict(os.environ), {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    streams = torch.get_rng_state(), random.getstate(), np.random.get_state()
    threads, on_sigint = torch.get_num_threads(), signal.getsignal(signal.SIGINT)
    capfd.readouterr()
    try:
        main(args)
        code = 0
    except SystemExit as exit:  # as a process exits: None is 0, a message 1
        code = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
    finally:
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:  # a process's W&B run ends with it; a later fit here would
            wandb.finish()                                # otherwise reuse it (and write into its folder)
        torch.set_num_threads(threads)  # the entry point sets its own threads and Ctrl-C handler
        signal.signal(signal.SIGINT, on_sigint)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        torch.set_rng_state(streams[0])
        random.setstate(streams[1])
        np.random.set_state(streams[2])
        for key in set(os.environ) - set(environment):
            del os.environ[key]
        for key, value in environment.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["jagg", *args], code, out, err)


def tiny_fit_with_reward(reward: dict | str, tmp_path, capfd, monkeypatch,
                         data: dict | None = None) -> tuple[subprocess.CompletedProcess, object]:
    """``jagg fit`` of the tiny SD3 for 2 steps with ``reward`` (its ``class_path`` / ``init_args``, or a registered
    name), CSV logs and the adapter under ``tmp_path/run``: the run's CompletedProcess and that root. ``data``: the
    data section's fields instead of two inline prompts."""
    import yaml

    root = tmp_path / "run"
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False, "enable_checkpointing": False,
                    "enable_model_summary": False, "default_root_dir": str(root), "num_sanity_val_steps": 0,
                    "log_every_n_steps": 1,
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root)}}},
        "model": {"policy": {"lora_rank": 4, "lora_alpha": 8, "guidance_scale": 1.0, "max_sequence_length": 4},
                  "sampling": {"num_steps": 3, "group_size": 2, "rollout_batch_size": 2},
                  "grpo": {"train_batch_size": 2}, "jagg": {"window_size": 2}, "reward": reward},
        "data": data or {"prompts": ["a cat", "a dog"], "batch_size": 1},
        "lora_export": {"dirpath": str(root / "lora")},
    }
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    return jagg_in_process("fit", "--config", tmp_path / "fit.yaml", cwd=tmp_path, capfd=capfd,
                           monkeypatch=monkeypatch), root
