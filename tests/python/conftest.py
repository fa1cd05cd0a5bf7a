"""Fixtures shared by every test module: the on-disk cache of peer / reference results
(result_cache.py: committed goldens first, then pytest's cache; every golden that had to be
recomputed is named in the summary) and plain greedy decoding baselines, computed once per
session; and a per-module
account of wall time and CPU time (this process and its children), printed at the end of the run
so that timings taken on a shared machine can be compared by CPU-seconds."""
import collections
import pathlib
import resource
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from repo_paths import REPO  # noqa: E402
from result_cache import ResultCache  # noqa: E402

GOLDEN_DIR = REPO / "tests" / "golden"


_caches = []  # the session's ResultCache, for the summary


@pytest.fixture(scope="session")
def result_cache(request):
    cache = ResultCache(request.config.cache.mkdir("microspec-results"), golden_dir=GOLDEN_DIR,
                        write_goldens=request.config.getoption("write_goldens"))
    _caches.append(cache)
    return cache


def pytest_addoption(parser):
    parser.addoption("--write-goldens", nargs="?", const="all", default=None, choices=["all", "stale"],
                     help="compute golden entries (llama.cpp's and the float64 reference's results) and write "
                          "them to tests/golden/: all of them afresh (all, the default), or only those whose "
                          "committed file is missing or stale (stale); scripts/make_goldens.py runs this")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a real-model sweep that takes minutes; left out of `scripts/test.sh --quick`")


# module file name -> [tests run, wall seconds, CPU seconds of pytest and the processes it waited for]
_module_times = collections.defaultdict(lambda: [0, 0.0, 0.0])


def _cpu_seconds():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Setup, call and teardown together: a module-scoped fixture's cost lands on the test that
    # first asks for it (or the last one, for its teardown), so the module sums are complete.
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield
    entry = _module_times[pathlib.Path(str(item.fspath)).name]
    entry[0] += 1
    entry[1] += time.monotonic() - wall
    entry[2] += _cpu_seconds() - cpu


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    for cache in _caches:
        tr.section("peer and reference results (result_cache.py)")
        tr.write_line(f"{cache.golden_hits} read from committed goldens ({GOLDEN_DIR}), {cache.hits} from {cache.dir}, "
                      f"{cache.misses} computed")
        for name in cache.written_goldens:
            tr.write_line(f"golden written: {name}")
        for entry in cache.recomputed_goldens:
            tr.write_line(f"golden RECOMPUTED (run scripts/make_goldens.py): {entry}", yellow=True, bold=True)
    if not _module_times:
        return
    tr.section("time per module (wall / CPU seconds incl. child processes)")
    rows = sorted(_module_times.items(), key=lambda kv: -kv[1][1])
    for name, (n, wall, cpu) in rows:
        tr.write_line(f"{name:38s} {n:4d} tests {wall:8.1f} s wall {cpu:8.1f} s CPU")
    tr.write_line(f"{'total':38s} {sum(r[0] for _, r in rows):4d} tests {sum(r[1] for _, r in rows):8.1f} s wall "
                  f"{sum(r[2] for _, r in rows):8.1f} s CPU")


@pytest.fixture(scope="session")
def draft_model(request):
    """draft_model(target_path) -> path of the target requantized by llama.cpp (draft_models.py),
    cached in pytest's cache directory across runs."""
    from draft_models import requantized
    directory = request.config.cache.mkdir("microspec-draft-models")
    return lambda target: requantized(target, directory)
