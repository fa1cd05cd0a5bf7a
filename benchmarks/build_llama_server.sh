#!/usr/bin/env bash
# Builds llama.cpp's HTTP server (tools/server: continuous batching with -np) from the llama.cpp
# sources the setup already fetched (the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp), with
# AMX off as scripts/install_llama_cpp.sh builds the library (llama.cpp's AMX path dies with SIGILL
# on this project's Xeons), into a cache directory. No web UI (nothing is downloaded).
# Prints the path of the binary; a second run finds it and builds nothing. Not part of CI.
#   benchmarks/build_llama_server.sh [SOURCE_DIR] [CACHE_DIR]
set -euo pipefail
CACHE=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/microspec/llama-server-0.3.36}
BIN="$CACHE/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
# The sources: the sdist pip builds from, fetched once (scripts/fetch_llama_cpp_sdist.sh).
SRC=${1:-${LLAMA_CPP_SRC:-$(bash "$(dirname "$0")/../scripts/fetch_llama_cpp_sdist.sh")}}
[ -f "$SRC/tools/server/CMakeLists.txt" ] || { echo "no llama.cpp server sources under $SRC" >&2; exit 1; }
mkdir -p "$CACHE"
cmake -S "$SRC" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DCMAKE_C_FLAGS='-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
  -DCMAKE_CXX_FLAGS='-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$CACHE/build" --target llama-server -j "$(nproc)" >&2
echo "$BIN"
