"""Config keys renamed by the second shape pass keep working, through the CLI parse as in Python: each old key given a
value moves it to its new key with ONE deprecation line naming that key; an old key at its old default (what a
checkpoint's hyper-parameters hold for every key) says nothing; old and new key given differently are refused; and
the run's root seed (``model.seed``) feeds every stream unless a deprecated stream seed is given."""

import warnings

import pytest
import torch

from jagg_lightning import JAGGConfig, JAGGModule, MemoryConfig, SamplingConfig
from jagg_lightning.cli import cli_main
from jagg_lightning.config.old_keys import OLD_KEYS, JAGGDeprecationWarning
from jagg_lightning.training.rollout import sample_generators

from helpers import tiny_policy_config

TINY = ["--config", "configs/tiny.yaml", "--trainer.logger", "false", "--trainer.accelerator", "cpu"]
# old key -> (the value given on the command line, where the module holds it then, the value it holds)
MOVES = {
    "sampling.window_fraction": ("0.5", lambda m: m.jagg.window_fraction, 0.5),
    "jagg.low_memory": ("true", lambda m: m.memory.anchors, "split"),
    "jagg.memory_budget_mb": ("256", lambda m: m.memory.budget_mb, 256.0),
    "jagg.fused_samples": ("3", lambda m: m.memory.fused_samples, 3),
    "jagg.fused_exact_interior": ("false", lambda m: m.memory.fused_interior_graphs, False),
    "sampling.seed": ("7", lambda m: (m.sampling.seed, m.policy_config.seed), (7, 0)),
    "policy.seed": ("5", lambda m: (m.policy_config.seed, m.sampling.seed), (5, 0)),
}


def parse(*args, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", JAGGDeprecationWarning)
        cli = cli_main([*TINY, *args], run=False)
    return cli.model, [str(w.message) for w in caught if issubclass(w.category, JAGGDeprecationWarning)]


def test_every_old_key_is_listed_here():
    assert set(MOVES) == {f"{k.section}.{k.field}" for k in OLD_KEYS}


@pytest.mark.parametrize("old", sorted(MOVES))
def test_an_old_key_moves_to_its_new_key_with_one_line_naming_it(old, monkeypatch):
    value, where, expected = MOVES[old]
    module, lines = parse(f"--model.{old}", value, monkeypatch=monkeypatch)
    new = next(k.new for k in OLD_KEYS if f"{k.section}.{k.field}" == old)
    assert len(lines) == 1 and lines[0].startswith(f"model.{old} is deprecated: use model.{new} "), lines
    assert where(module) == expected


def test_the_shipped_tiny_config_and_the_old_defaults_say_nothing(monkeypatch):
    """A checkpoint's hyper-parameters hold every old key at its old default: no line, nothing moved."""
    _, lines = parse(monkeypatch=monkeypatch)
    assert lines == []
    defaults = [f"--model.{k.section}.{k.field}={str(k.default).lower() if k.default is not None else 'null'}"
                for k in OLD_KEYS]
    module, lines = parse(*defaults, monkeypatch=monkeypatch)
    assert lines == [] and module.memory == MemoryConfig() and module.jagg.window_fraction == 1.0


def test_an_old_key_and_its_new_key_given_differently_are_refused(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        parse("--model.jagg.memory_budget_mb", "256", "--model.memory.budget_mb", "128", monkeypatch=monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert "model.memory.budget_mb must be left unset when the deprecated model.jagg.memory_budget_mb is given" in err[0]
    module, _ = parse("--model.jagg.memory_budget_mb", "256", "--model.memory.budget_mb", "256", monkeypatch=monkeypatch)
    assert module.memory.budget_mb == 256  # the same value twice: no conflict


def test_the_root_seed_feeds_every_stream(rng_seed):
    """model.seed seeds the policy (tiny weights, LoRA init), the rollout and the evaluation; a deprecated stream seed
    or evaluation.seed replaces it for its stream only. The rollout noise is the old sampling.seed's, bit for bit."""
    root = rng_seed % 10_000 + 1
    module = JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=4, group_size=2), jagg=JAGGConfig(window_size=2),
                        seed=root)
    assert (module.policy_config.seed, module.sampling.seed, module.evaluation.seed) == (root, root, root)
    with pytest.warns(JAGGDeprecationWarning, match="model.sampling.seed is deprecated: use model.seed"):
        old = JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=4, group_size=2, seed=root),
                         jagg=JAGGConfig(window_size=2))
    assert (old.policy_config.seed, old.sampling.seed, old.evaluation.seed) == (0, root, 0)
    noise = [g.initial_seed() for g in sample_generators(module.sampling.seed, 3, [0, 1], 2)]
    assert noise == [g.initial_seed() for g in sample_generators(old.sampling.seed, 3, [0, 1], 2)]
    from jagg_lightning.config import EvalConfig

    fixed = JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=4, group_size=2), jagg=JAGGConfig(window_size=2),
                       evaluation=EvalConfig(seed=0), seed=root)
    assert (fixed.sampling.seed, fixed.evaluation.seed) == (root, 0)


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_jagg_command_prints_a_renamed_key_as_one_line(tmp_path):
    """Through the real command: the deprecation is one ``jagg:`` line on stderr (not Python's two)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "jagg_lightning", "fit", "--config", str(root / "configs/tiny.yaml"),
                           "--model.sampling.window_fraction", "0.5", "--trainer.max_steps", "0",
                           "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path),
                           "--lora_export.dirpath", str(tmp_path / "lora")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1"))
    lines = [line for line in proc.stderr.splitlines() if "deprecated" in line]
    assert lines == ["jagg: model.sampling.window_fraction is deprecated: use model.jagg.window_fraction (set to 0.5)"], \
        proc.stderr[-2000:]


def test_seed_everything_changes_nothing_of_the_run(rng_seed):
    """Nothing of the algorithm draws from the global RNGs: two runs that differ only in Lightning's
    ``seed_everything`` train the same weights (model.seed is what seeds them)."""
    import lightning as L

    from modules import fit

    def trained(global_seed):
        L.seed_everything(global_seed)
        module = JAGGModule(tiny_policy_config(dtype="float64"), SamplingConfig(num_steps=4, group_size=2,
                            rollout_batch_size=4), jagg=JAGGConfig(window_size=2), seed=rng_seed % 10_000)
        module.configure_model()
        initial = [p.detach().clone() for p in module.policy.lora_parameters()]
        fit(module, 2)
        return initial, [p.detach().clone() for p in module.policy.lora_parameters()]

    (initial, first), (_, second) = trained(rng_seed), trained(rng_seed + 1)
    assert any(not torch.equal(a, b) for a, b in zip(initial, first))  # it trained
    assert all(torch.equal(a, b) for a, b in zip(first, second))
