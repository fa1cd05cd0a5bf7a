"""result_cache.py's golden rules, on scratch directories: a committed golden is read instead of
computing; a golden whose key changed is never read, is computed and named (with the stale file)
for the summary; writing goldens replaces the kind's older files; non-golden entries never touch
the golden directory."""
import numpy as np

from result_cache import ResultCache


def counting(value):
    calls = []

    def compute():
        calls.append(1)
        return {"x": np.array(value)}
    return compute, calls


def test_a_committed_golden_is_read_and_a_changed_key_is_recomputed_and_named(tmp_path):
    golden = tmp_path / "golden"
    golden.mkdir()
    writer = ResultCache(tmp_path / "w", golden_dir=golden, write_goldens=True)
    compute, calls = counting([1, 2, 3])
    assert writer.get("peer-x", {"model": "a", "peer": "1"}, compute, golden=True)["x"].tolist() == [1, 2, 3]
    assert len(calls) == 1 and len(writer.written_goldens) == 1
    (name,) = [p.name for p in golden.glob("*.npz")]
    with np.load(golden / name) as z:
        assert '"model": "a"' in str(z["key"])  # the key travels with the file

    # A fresh run (empty pytest cache) reads the golden without computing.
    reader = ResultCache(tmp_path / "r1", golden_dir=golden)
    compute, calls = counting([9])
    assert reader.get("peer-x", {"model": "a", "peer": "1"}, compute, golden=True)["x"].tolist() == [1, 2, 3]
    assert calls == [] and reader.golden_hits == 1 and reader.recomputed_goldens == []
    assert set(reader.get("peer-x", {"model": "a", "peer": "1"}, compute, golden=True)) == {"x"}

    # Another peer version: the golden is not read; the value is computed and the stale file named.
    reader = ResultCache(tmp_path / "r2", golden_dir=golden)
    compute, calls = counting([4])
    assert reader.get("peer-x", {"model": "a", "peer": "2"}, compute, golden=True)["x"].tolist() == [4]
    assert len(calls) == 1 and reader.golden_hits == 0
    assert reader.recomputed_goldens == [f"peer-x (key changed; stale: {name})"]
    # ... and then comes from pytest's cache, still named as a recomputed golden.
    compute, calls = counting([5])
    assert reader.get("peer-x", {"model": "a", "peer": "2"}, compute, golden=True)["x"].tolist() == [4]
    assert calls == [] and reader.hits == 1 and len(reader.recomputed_goldens) == 2

    # A kind without any committed file is named as such.
    reader.get("reference-y", {"model": "a"}, counting([0])[0], golden=True)
    assert reader.recomputed_goldens[-1] == "reference-y (no committed file)"

    # A file whose stored key is not its name's key (renamed, edited) is not read either.
    (golden / name).rename(golden / ResultCache._name("peer-x", {"model": "b", "peer": "1"}))
    reader = ResultCache(tmp_path / "r3", golden_dir=golden)
    assert reader.get("peer-x", {"model": "b", "peer": "1"}, counting([8])[0], golden=True)["x"].tolist() == [8]
    assert reader.golden_hits == 0 and len(reader.recomputed_goldens) == 1

    # Writing again replaces the kind's older file.
    writer = ResultCache(tmp_path / "w", golden_dir=golden, write_goldens=True)
    compute, calls = counting([6])
    writer.get("peer-x", {"model": "a", "peer": "2"}, compute, golden=True)
    assert len(calls) == 1  # computed afresh even though pytest's cache had the entry
    assert [p.name for p in golden.glob("*.npz")] == writer.written_goldens and name not in writer.written_goldens


def test_writing_only_stale_goldens_keeps_current_files(tmp_path):
    golden = tmp_path / "golden"
    golden.mkdir()
    ResultCache(tmp_path / "w", golden_dir=golden, write_goldens="all").get(
        "peer-x", {"model": "a"}, counting([1])[0], golden=True)
    (current,) = [p.name for p in golden.glob("*.npz")]
    ResultCache(tmp_path / "w", golden_dir=golden, write_goldens="all").get(
        "reference-x", {"model": "a", "source": "old"}, counting([2])[0], golden=True)
    writer = ResultCache(tmp_path / "s", golden_dir=golden, write_goldens="stale")
    compute, calls = counting([9])
    assert writer.get("peer-x", {"model": "a"}, compute, golden=True)["x"].tolist() == [1]  # current: read
    assert calls == [] and writer.golden_hits == 1
    compute, calls = counting([3])
    assert writer.get("reference-x", {"model": "a", "source": "new"}, compute, golden=True)["x"].tolist() == [3]
    assert len(calls) == 1 and writer.recomputed_goldens == []  # stale: computed and written
    assert sorted(p.name for p in golden.glob("*.npz")) == sorted([current, *writer.written_goldens])
    reader = ResultCache(tmp_path / "r", golden_dir=golden)
    assert reader.get("reference-x", {"model": "a", "source": "new"}, counting([0])[0], golden=True)["x"].tolist() == [3]
    assert reader.golden_hits == 1


def test_entries_that_are_not_goldens_stay_in_the_pytest_cache(tmp_path):
    golden = tmp_path / "golden"
    golden.mkdir()
    cache = ResultCache(tmp_path / "c", golden_dir=golden, write_goldens=True)
    compute, calls = counting([7])
    cache.get("live-z", {"k": 1}, compute)
    cache.get("live-z", {"k": 1}, compute)
    assert len(calls) == 1 and cache.hits == 1 and list(golden.iterdir()) == []
    assert cache.recomputed_goldens == [] and cache.written_goldens == []
