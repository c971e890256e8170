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
