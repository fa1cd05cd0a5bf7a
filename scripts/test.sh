#!/usr/bin/env bash
# The whole test suite: bounded fuzzing runs of the GGUF parser and the server's HTTP request reader
# (libFuzzer, ASan/UBSan), the C++ unit and model tests (ctest), then the Python conformance tests
# against llama.cpp and the gguf package (pytest). Any failure stops it with a non-zero status.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
bash scripts/fuzz.sh 60 gguf
bash scripts/fuzz.sh 30 http
ctest --test-dir build --output-on-failure -j1
MICROSPEC_BIN="$PWD/build/microspec" python3 -m pytest -q --durations=12 tests/python
