"""The league's method table (benchmarks/league.py, issues 41 and 57) without running a model: every method is a
config the module accepts on the league's job, the cost model counts every method, a method that makes two optimizer
steps per rollout is run for as many ROLLOUTS as the others, and the phase table's shares are each phase's part of the
step time without the held-out evaluations."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import yaml

from jagg_lightning import JAGGModule

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # league.py imports its siblings by name
spec = importlib.util.spec_from_file_location("league", ROOT / "benchmarks" / "league.py")
league = importlib.util.module_from_spec(spec)
spec.loader.exec_module(league)
import league_report  # noqa: E402  (after league.py put benchmarks/ on the path)

BASE = yaml.safe_load((ROOT / "configs" / "digits_all_steps.yaml").read_text())


@pytest.mark.parametrize("name", ["dgpo", "flow_dppo", "jagg_w4_flow_dppo", "jagg_w4_flash_tail_2m1", "nft_k3",
                                  "awm_k5", "exact", "jagg_w4_flash_tail"])
def test_a_league_method_is_a_config_the_module_accepts(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    model = league.run_config(BASE, name)["model"]
    module = JAGGModule(**{k: v for k, v in model.items() if k not in ("optimizer", "reward")})  # no weights built
    objective = league.METHODS[name].get("objective", {}).get("name", "grpo")
    assert module.objective.name == objective
    jagg = league.METHODS[name]["jagg"]
    assert (module.jagg.jagg_frac, module.jagg.fused_rollout) == (jagg["jagg_frac"], jagg["fused_rollout"])


def test_every_method_has_its_passes_in_the_cost_model():
    assert set(league.METHODS) == set(league.COST), set(league.METHODS) ^ set(league.COST)
    for name, (rollout, grad, nograd, backward) in league.COST.items():
        assert 1 <= rollout <= 10 and 0 <= grad and 0 <= nograd and 1 <= backward <= 10, name


def test_two_updates_per_rollout_run_as_many_rollouts(monkeypatch):
    """Flow-DPPO takes two optimizer steps per rollout: --steps and --eval-every count rollouts for every method."""
    steps, every = random.randint(2, 80), random.randint(1, 20)
    calls = []

    class Rec:
        train_reward, cpu, evals, passes = [], [], [], []

    monkeypatch.setattr(league, "fit_recorded", lambda cfg, seed, p, h, s, e, callbacks=(): calls.append((s, e)) or Rec)
    args = type("Args", (), {"steps": steps, "eval_every": every})
    for name in ("flow_dppo", "jagg_w4_flow_dppo", "exact", "dgpo"):
        league.one_run(args, league.run_config(BASE, name), name, name, 0, None, None)
    assert calls == [(2 * steps, 2 * every)] * 2 + [(steps, every)] * 2


def test_the_phase_table_shares_leave_out_the_evaluations():
    rng = random.Random()
    phases = ("rollout", "decode", "reward", "update/forward", "update/backward", "optimizer", "other")
    runs = []
    for _ in range(3):
        seconds = {f"time/{k}": rng.uniform(0.1, 5.0) for k in phases} | {"time/evaluation": rng.uniform(1, 9)}
        runs.append({"setting": "m", "phases": seconds | {"time/step": sum(seconds.values())}})
    row = league_report.phase_table({"runs": runs + [{"setting": "old run", "cpu": [1.0]}]}).splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    total = sum(r["phases"]["time/step"] - r["phases"]["time/evaluation"] for r in runs) / 3
    assert cells[:3] == ["m", "3", f"{total:.1f}"]
    expect = [100 * sum(r["phases"][f"time/{k}"] for r in runs) / 3 / total for k in phases]
    assert [int(c) for c in cells[3:]] == [round(e) for e in expect]
    assert abs(sum(expect) - 100) < 1e-9
