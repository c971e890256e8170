"""Shared test setup: offline hubs, the CPU threads, ``tests/support`` on the import path, and the random seed.

Tests are in folders by topic (``unit/``, ``families/``, ``training/``, ``rewards/``, ``cli/``, ``distributed/``);
their shared builders are in ``support/``. Markers (setup.cfg): ``slow`` (more than a few seconds),
``subprocess`` (launches Python or ``jagg`` processes), ``distributed`` (several ranks). The developer loop is
``python -m pytest -m "not slow"``; the README's command runs everything.

``rng_seed`` gives a fresh random seed per test; a failing test prints it, and ``JAGG_TEST_SEED=<seed>`` replays
it (every test that takes ``rng_seed`` then gets that seed).
"""

import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# the README's command runs two pytest-xdist workers: each gets its share of the (at most 2) threads
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from helpers import SEED_VARIABLE, fresh_seed  # noqa: E402 (tests/support is on the path from here on)


@pytest.fixture
def rng_seed(request):
    """A fresh random seed per test (or ``JAGG_TEST_SEED``'s); a failure report says how to replay it."""
    seed = fresh_seed()
    request.node.user_properties.append(("rng_seed", seed))
    print(f"seed={seed}")
    return seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = dict(item.user_properties).get("rng_seed")
    if report.failed and seed is not None:
        report.sections.append(("replay", f"{SEED_VARIABLE}={seed} python -m pytest '{item.nodeid}'"))
    return report


def pytest_collection_modifyitems(session, config, items):
    """Heaviest files first: those with the most tests that launch processes, then the most slow ones. The README's
    two xdist workers (``--dist loadfile``) take whole files in this order, so the long files start early and the
    short ones fill the end (collected in folder order, the long files came last and one worker ran them alone)."""
    weight = defaultdict(int)
    for item in items:
        launches = any(item.get_closest_marker(m) for m in ("subprocess", "distributed"))
        weight[item.path] += 4 * launches + (item.get_closest_marker("slow") is not None)
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    # every file with a slow test before every file without one (those are quick: they fill the end)
    items.sort(key=lambda item: (weight[item.path] == 0, -weight[item.path], first_seen[item.path]))
