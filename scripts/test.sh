#!/usr/bin/env bash
# The test suite, in two tiers.
#   scripts/test.sh          the whole suite (what CI runs): a bounded fuzzing run of the GGUF
#                            parser, the server's HTTP request reader, the checkpoint readers
#                            (safetensors, the restricted unpickler) and the JSON Schema compiler
#                            and Jinja chat templates (libFuzzer, ASan/UBSan),
#                            the C++ unit and model tests (ctest),
#                            then every Python test against llama.cpp and the gguf package (pytest).
#   scripts/test.sh --quick  the fast tier for development: the C++ tests and the Python tests not
#                            marked `slow` (the real-model sweeps: conformance against llama.cpp,
#                            speculative greedy over SpecBench, the server load and leak tests, bench runs); no fuzzing.
# Any failure stops it with a non-zero status.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
case "${1:-}" in
  --quick) quick=1 ;;
  "") ;;
  *) echo "usage: scripts/test.sh [--quick]" >&2; exit 2 ;;
esac
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
if [ "$quick" = 0 ]; then
  bash scripts/fuzz.sh 45 gguf
  bash scripts/fuzz.sh 25 http
  bash scripts/fuzz.sh 20 checkpoint
  bash scripts/fuzz.sh 20 structured
fi
ctest --test-dir build --output-on-failure -j1
if [ "$quick" = 1 ]; then
  MICROSPEC_BIN="$PWD/build/microspec" python3 -m pytest -q -rs --durations=12 -m "not slow" tests/python
else
  MICROSPEC_BIN="$PWD/build/microspec" python3 -m pytest -q -rs --durations=12 tests/python
fi
