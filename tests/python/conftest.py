"""Fixtures shared by every test module: the on-disk cache of peer / reference results
(result_cache.py) and plain greedy decoding baselines, computed once per session; and a per-module
account of wall time and CPU time (this process and its children), printed at the end of the run
so that timings taken on a shared machine can be compared by CPU-seconds."""
import collections
import pathlib
import resource
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from result_cache import ResultCache  # noqa: E402


@pytest.fixture(scope="session")
def result_cache(request):
    cache = ResultCache(request.config.cache.mkdir("microspec-results"))
    yield cache
    print(f"\nresult cache {cache.dir}: {cache.hits} hits, {cache.misses} computed")


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
    if not _module_times:
        return
    tr = terminalreporter
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
