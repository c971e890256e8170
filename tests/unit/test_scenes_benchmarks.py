"""The scenes test bed's benchmark plumbing without running a model (issue 54): the league's held-out evaluator gives
every GenEval task at least the images asked for, its per-task table is the mean of the runs' per-task scores, and
the window-exactness summary counts every window once per grouping."""

import collections
import importlib.util
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import their siblings by name


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def test_scenes_heldout_gives_every_task_its_images():
    from jagg_lightning.models.conditions import metadata_of

    heldout = _load("heldout")
    images = random.randint(3, 70)
    evaluator = heldout.heldout_for({"model": {"reward": "geneval"}, "data": {}}, samples=5, images_per_task=images)
    counts = collections.Counter(metadata_of(p)["tag"] for p in evaluator.prompts)
    assert evaluator.samples == 1 and set(counts) == set(TASKS)
    assert all(images <= n < images + max(counts.values()) for n in counts.values()), (images, counts)
    plain = heldout.heldout_for({"model": {"reward": "geneval"}, "data": {}}, samples=5)
    assert plain.samples == 5 and list(dict.fromkeys(evaluator.prompts)) == plain.prompts  # the same rows, repeated


def _run(setting, seed, rng):
    def evaluation():
        return {"accuracy": rng.random(), "judge_accuracy": rng.random(),
                "per_task": {t: rng.random() for t in TASKS}, "judge_per_task": {t: rng.random() for t in TASKS}}

    return {"setting": setting, "seed": seed, "evals": [evaluation() for _ in range(rng.randint(2, 4))]}


def test_league_task_table_is_the_mean_over_seeds():
    report = _load("league_report")
    rng = random.Random()
    runs = [_run(name, seed, rng) for seed in range(rng.randint(1, 4)) for name in ("exact", "nft")]
    table = report.task_table({"runs": runs}).splitlines()
    assert len(table) == 2 + 2
    row = table[3].split(" | ")
    assert row[0] == "| nft" and int(row[1]) == len(runs) // 2
    nft = [r for r in runs if r["setting"] == "nft"]
    task = rng.randrange(len(TASKS))
    cell = row[2 + task].rstrip(" |")
    first, final = (sum(r["evals"][i]["per_task"][TASKS[task]] for r in nft) / len(nft) for i in (0, -1))
    judge_final = sum(r["evals"][-1]["judge_per_task"][TASKS[task]] for r in nft) / len(nft)
    assert cell == f"{first:.2f} → {final:.2f} / " + cell.split(" / ")[1] and cell.endswith(f"{judge_final:.2f}")
    for r in runs:  # a digits league carries no per-task scores: no table
        for e in r["evals"]:
            e.pop("per_task")
    assert report.task_table({"runs": runs}) == ""


@pytest.mark.parametrize("chained_too", [False, True])
def test_window_summary_counts_every_window(chained_too):
    windows = _load("scenes_windows")
    rng = random.Random()
    rows = []
    for _ in range(rng.randint(5, 40)):
        W = rng.choice([2, 3, 4])
        start = rng.randint(0, 4)
        rows.append({"regime": rng.choice(["shipped", "all"]), "W": W, "chained": chained_too and rng.random() < 0.5,
                     "steps": list(range(start, start + W)), "task": rng.choice(TASKS), "cosine": rng.uniform(-1, 1),
                     "rel_error": rng.uniform(0, 2), "residual": rng.random(), "cosine_rule": rng.random()})
    summary = windows.summarise({"rows": rows})
    overall = {k: s for k, s in summary.items() if "steps" not in k and "task" not in k}
    by_window = {k: s for k, s in summary.items() if "steps" in k}
    by_task = {k: s for k, s in summary.items() if "task" in k}
    assert sum(s["windows"] for s in overall.values()) == len(rows)
    assert sum(s["windows"] for s in by_window.values()) == len(rows)
    assert sum(s["windows"] for s in by_task.values()) == sum(not r["chained"] for r in rows)
    for s in summary.values():
        assert -1 <= s["cosine_q10"] <= 1 and s["rel_error_median"] >= 0
    assert windows.table(summary).count("\n") == len(summary) + 1


@pytest.mark.parametrize("share", [0.0, 0.1, 0.5])
def test_gradient_snr_estimates_the_signal_share_without_bias(share):
    """g_k = s + n_k with ||s||^2 = share x E||g||^2: ``signal_share`` of K = 6 estimates averages to ``share``
    over many draws (it is unbiased, where the mean pairwise cosine is not for small K), and the pure-noise case
    is near 0 rather than near the 1 / sqrt(dim) of one cosine."""
    import torch

    snr = _load("gradient_snr")
    dim, k, draws = 400, 6, 300
    generator = torch.Generator().manual_seed(random.randrange(2**31))
    signal = torch.randn(dim, generator=generator, dtype=torch.float64)
    signal *= (share * dim / (1 - share)) ** 0.5 / signal.norm()  # ||s||^2 / (||s||^2 + dim) = share
    estimates = [snr.signal_share([signal + torch.randn(dim, generator=generator, dtype=torch.float64)
                                   for _ in range(k)]) for _ in range(draws)]
    mean = sum(estimates) / draws
    spread = (sum((e - mean) ** 2 for e in estimates) / (draws - 1) / draws) ** 0.5
    assert abs(mean - share) < 5 * spread + 1e-3, (mean, share, spread)
