"""Fixtures shared by every test module: the on-disk cache of peer / reference results
(result_cache.py) and plain greedy decoding baselines, computed once per session."""
import pathlib
import sys

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
