"""Shared test setup: offline hubs, the CPU threads, ``tests/support`` on the import path, and the random seed.

Tests are in folders by topic (``unit/``, ``families/``, ``training/``, ``rewards/``, ``cli/``, ``distributed/``);
their shared builders are in ``support/``. Markers (setup.cfg): ``slow`` (more than a few seconds),
``subprocess`` (launches Python or ``jagg`` processes), ``distributed`` (several ranks). The developer loop is
``python -m pytest -m "not slow"``; the README's command runs everything.

``rng_seed`` gives a fresh random seed per test; a failing test prints it (or the seeds it drew from
``helpers.fresh_seed``), and ``JAGG_TEST_SEED=<seed>`` replays it (every test that takes ``rng_seed`` then gets that
seed). ``tests/support/seed_sweep.py`` runs chosen tests at many fresh seeds.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# the README's command runs two pytest-xdist workers: each gets its share of the (at most 2) threads
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from helpers import DRAWN_SEEDS, SEED_VARIABLE, fresh_seed  # noqa: E402 (tests/support is on the path from here on)

FIRST_DRAWN = pytest.StashKey[int]()  # where in DRAWN_SEEDS a test's own seeds begin


@pytest.fixture
def rng_seed(request):
    """A fresh random seed per test (or ``JAGG_TEST_SEED``'s); a failure report says how to replay it."""
    seed = fresh_seed()
    request.node.user_properties.append(("rng_seed", seed))
    print(f"seed={seed}")
    return seed


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[FIRST_DRAWN] = len(DRAWN_SEEDS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure names the seeds the test drew (``rng_seed``'s, or ``fresh_seed``'s inside the test) and how to replay
    them (a module's fixture seeds are named by the first test of the module)."""
    report = yield
    seeds = list(dict.fromkeys(DRAWN_SEEDS[item.stash.get(FIRST_DRAWN, len(DRAWN_SEEDS)):]))
    seed = dict(item.user_properties).get("rng_seed", seeds[0] if len(seeds) == 1 else None)
    if report.failed and seed is not None:
        report.sections.append(("replay", f"{SEED_VARIABLE}={seed} python -m pytest '{item.nodeid}'"))
    elif report.failed and seeds:
        report.sections.append(("replay", f"seeds drawn: {', '.join(map(str, seeds))}; {SEED_VARIABLE}=<seed> gives "
                                          f"every draw that value: python -m pytest '{item.nodeid}'"))
    return report


def pytest_collection_modifyitems(session, config, items):
    """Files that launch processes first, then files with slow tests, then the quick ones, each group in folder order.
    The README's two xdist workers (``--dist loadfile --no-loadscope-reorder``) take whole files in this order, so the
    long files start early and the quick ones fill the end. (xdist's default order, the most tests first, left the
    distributed files -- a few long tests each -- to run last on one worker.)"""
    launches, slow = set(), set()
    for item in items:
        if any(item.get_closest_marker(m) for m in ("subprocess", "distributed")):
            launches.add(item.path)
        if item.get_closest_marker("slow"):
            slow.add(item.path)
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (item.path not in launches, item.path not in slow, first_seen[item.path]))
