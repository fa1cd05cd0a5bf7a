#!/usr/bin/env bash
# Builds the peer, llama.cpp, from the source that PyPI's llama-cpp-python sdist carries.
# AMX is switched off: on the Xeons this project targets, llama.cpp's AMX path dies with SIGILL.
# Re-running is a no-op when the pinned version is already installed.
set -euo pipefail
VERSION=0.3.36
if python3 -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null; then
  echo "llama-cpp-python $VERSION already installed"; exit 0
fi
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
 -DCMAKE_C_FLAGS='-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
 -DCMAKE_CXX_FLAGS='-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
 -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
python3 -m pip install --quiet --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
python3 -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
