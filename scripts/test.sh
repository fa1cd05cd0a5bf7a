#!/usr/bin/env bash
# The whole test suite: C++ unit and model tests (ctest), Python conformance tests against
# llama.cpp and the gguf package (pytest), and a bounded fuzzing run of the GGUF parser.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build -j"$(nproc)" >/dev/null
ctest --test-dir build --output-on-failure -j1
MICROSPEC_BIN="$PWD/build/microspec" python3 -m pytest -q tests/python
