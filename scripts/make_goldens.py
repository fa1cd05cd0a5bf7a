#!/usr/bin/env python3
"""Regenerates the committed goldens under tests/golden/: llama.cpp's (llama-cpp-python's) and the
float64 reference's (tests/python/reference_forward.py) results on the two real models, which
tests/python/test_model_conformance.py compares microspec against.

Neither result depends on microspec, so CI reads them instead of computing them for minutes
(tests/python/result_cache.py). Each file is named by the digest of its key (the model's sha256,
the peer's version or the reference's source, the gguf package's version, the prompts, the code
version) and carries the key as JSON; when any input changes the suite stops reading the file,
computes the result itself and names it in the summary ("golden RECOMPUTED"): then run this.

It runs the conformance module with --write-goldens (every golden entry computed afresh and
written, replacing its kind's older files), so microspec is built and checked against the new
files in the same run: scripts/make_goldens.py [extra pytest arguments]
"""
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"


def main():
    args = sys.argv[1:]
    mode = "stale" if "--stale" in args else "all"
    args = [a for a in args if a != "--stale"]
    cmd = [sys.executable, "-m", "pytest", "-q", str(REPO / "tests" / "python" /
           "test_model_conformance.py"), f"--write-goldens={mode}", *args]
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=REPO).returncode
    files = sorted(GOLDEN.glob("*.npz"))
    for f in files:
        print(f"{f.stat().st_size / 1e6:8.2f} MB  {f.relative_to(REPO)}")
    print(f"{sum(f.stat().st_size for f in files) / 1e6:8.2f} MB  in all")
    return rc


if __name__ == "__main__":
    sys.exit(main())
