"""Run chosen tests at many fresh seeds in one pytest process and report the failures per seed.

    OMP_NUM_THREADS=1 nice -n 5 python tests/support/seed_sweep.py --seeds 200 \\
        "tests/unit/test_fused.py::test_fused_gradient_equals_unfused[exact]" -k "not slow"

Every test that draws its inputs from ``JAGG_TEST_SEED`` (the ``rng_seed`` fixture, ``helpers.fresh_seed``) is run
once per seed: the seed is set in the environment, the test's whole protocol (setup, call, teardown) runs again, and
module-scoped fixtures (saved tiny models) are built once for all the seeds. A failing seed replays alone with the
line the report prints. Arguments after the node ids go to pytest as they are (``-k``, ``-m``). Not collected by CI
(its name does not start with ``test_``): a sweep of 200 seeds is minutes to hours of CPU.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest
from _pytest.runner import runtestprotocol

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import SEED_VARIABLE  # noqa: E402 (this folder is on the path from here on)


class SeedSweep:
    """A pytest plugin: each collected test runs once per seed in ``seeds`` (for at most ``minutes`` per test)."""

    def __init__(self, seeds, minutes=None):
        self.seeds, self.minutes = list(seeds), minutes
        self.results = {}  # node id -> [(seed, "passed" / "failed" / "skipped", one line, seconds)]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        runs = self.results.setdefault(item.nodeid, [])
        deadline = None if self.minutes is None else time.time() + 60 * self.minutes
        for i, seed in enumerate(self.seeds):
            last = i == len(self.seeds) - 1 or (deadline is not None and time.time() > deadline)
            os.environ[SEED_VARIABLE] = str(seed)
            start = time.perf_counter()
            # before another seed only the test's own fixtures are torn down (the module's stay); after the last
            # one everything pytest would tear down before ``nextitem``
            reports = runtestprotocol(item, log=False, nextitem=nextitem if last else ParentChain(item))
            runs.append((seed, *outcome(reports), time.perf_counter() - start))
            status = runs[-1][1]
            print(f"{item.nodeid} seed={seed} {status} ({runs[-1][3]:.1f} s)"
                  + (f": {runs[-1][2]}" if status != "passed" else ""), flush=True)
            if last:
                break
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True


class ParentChain:
    """Stands for the next test in pytest's teardown (``SetupState.teardown_exact`` reads its ``listchain``): a
    sibling of ``item``, so the teardown ends the test's function-scoped fixtures and keeps its module's."""

    def __init__(self, item):
        self.chain = item.listchain()[:-1]

    def listchain(self):
        return self.chain


def outcome(reports) -> tuple[str, str]:
    """(passed / failed / skipped, the first failure's last line) of one protocol's reports."""
    for report in reports:
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            line = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
            return "failed", f"{report.when}: " + " ".join(line.split())[:300]
    if any(report.skipped for report in reports):
        return "skipped", ""
    return "passed", ""


def fresh_seeds(count: int) -> list[int]:
    return [int.from_bytes(os.urandom(4), "little") for _ in range(count)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=200, help="how many fresh seeds (default 200)")
    parser.add_argument("--seed-list", type=int, nargs="+", help="these seeds instead of fresh ones")
    parser.add_argument("--minutes", type=float, help="stop a test's seeds after this many minutes (each test)")
    parser.add_argument("--json", type=Path, help="also write the results here (node id -> runs)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    seeds = args.seed_list or fresh_seeds(args.seeds)
    sweep = SeedSweep(seeds, args.minutes)
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:warnings", *pytest_args], plugins=[sweep])
    os.environ.pop(SEED_VARIABLE, None)
    failed = 0
    print(f"\nseed sweep: {len(seeds)} seeds per test")
    for node, runs in sweep.results.items():
        bad = [r for r in runs if r[1] == "failed"]
        failed += len(bad)
        print(f"{node}: {len(runs)} seeds, {len(bad)} failed, {sum(r[1] == 'skipped' for r in runs)} skipped, "
              f"{sum(r[3] for r in runs) / max(1, len(runs)):.1f} s each")
        for seed, _, line, _ in bad:
            print(f"    {SEED_VARIABLE}={seed} python -m pytest '{node}'   # {line}")
    if args.json:
        args.json.write_text(json.dumps({node: [dict(zip(("seed", "outcome", "message", "seconds"), r)) for r in runs]
                                         for node, runs in sweep.results.items()}, indent=1))
    return 1 if failed or code not in (0, pytest.ExitCode.NO_TESTS_COLLECTED) else 0


if __name__ == "__main__":
    sys.exit(main())
