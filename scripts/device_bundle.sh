#!/usr/bin/env bash
# Packs what scripts/device_check.sh needs on a GPU machine that has no build packages and nothing
# staged: the CUDA build's three binaries (microspec, microspec_tests, bench_cuda), the shared
# libraries they load beyond the C library, and (unless --no-model) SmolLM2 with its .freq.bin.
# The pack is cut into parts that each fit one device call beside the working tree (the tree and a
# call's carried paths travel together, at most 64 MiB), and the calls that stage and run it are
# printed: every call but the last copies its part to /tmp/device-parts on the machine (warm for
# 30 s between calls, so make them back to back); the last unpacks all of them and runs the check.
#
#   scripts/device_bundle.sh [--no-model] [--parts DIR] [BIN_DIR]    (BIN_DIR default: build, built with CUDA)
#
# Output: DIR/part-NN (default build-device/, ignored by git as every build*/ folder; a carried
# path must lie inside the checkout) and the calls on stdout. Unpacked on the machine, the
# binaries are always under build-device/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
with_model=1
PARTS_DIR=build-device
while [ $# -gt 0 ]; do
  case "$1" in
    --no-model) with_model=0; shift ;;
    --parts) PARTS_DIR=${2:?--parts needs a folder}; shift 2 ;;
    -*) echo "usage: scripts/device_bundle.sh [--no-model] [--parts DIR] [BIN_DIR]" >&2; exit 2 ;;
    *) break ;;
  esac
done
BIN=${1:-build}
OUT_DIR=build-device  # where the binaries land on the machine
CALL_LIMIT=$((64 * 1024 * 1024))
MARGIN=$((2 * 1024 * 1024))  # the tree may grow a little before the calls are made
MODEL=models/smollm2-135m-instruct-q4_1.gguf
EXES=(microspec microspec_tests bench_cuda)

for exe in "${EXES[@]}"; do
  if [ ! -x "$BIN/$exe" ]; then
    echo "device_bundle: $BIN/$exe is missing (build with nvcc on the PATH: bench_cuda exists only in a CUDA build)" >&2
    exit 1
  fi
done
if [ "$with_model" = 1 ] && [ ! -f "$MODEL" ]; then
  echo "device_bundle: $MODEL is missing (scripts/fetch_models.sh), or pass --no-model" >&2
  exit 1
fi

# What travels anyway: tracked files and untracked ones git does not ignore.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null |
  awk '{s += $1} END {print s + 0}')
part_bytes=$((CALL_LIMIT - tree_bytes - MARGIN))
if [ "$part_bytes" -lt $((1024 * 1024)) ]; then
  echo "device_bundle: the working tree alone is $tree_bytes bytes: no room left in a 64 MiB call" >&2
  exit 1
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/$OUT_DIR/bin/lib"
for exe in "${EXES[@]}"; do
  strip -o "$stage/$OUT_DIR/bin/$exe" "$BIN/$exe"
done
# Every shared library the binaries load but the C library's own (libc, libm, the loader...): the
# GPU machine's image lacks this build's Debian packages (pcre2) and may carry an older libstdc++.
for exe in "${EXES[@]}"; do
  ldd "$BIN/$exe" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | libresolv.so* | ld-linux*) ;;
    libcuda.so*) ;;  # the driver's, never a copy
    *) cp -L "$lib" "$stage/$OUT_DIR/bin/lib/" ;;
  esac
done
files=("$OUT_DIR/bin")
if [ "$with_model" = 1 ]; then
  mkdir -p "$stage/models"
  ln -s "$PWD/$MODEL" "$stage/$MODEL"
  files+=("$MODEL")
  freq="${MODEL%.gguf}.freq.bin"
  if [ -f "$freq" ]; then ln -s "$PWD/$freq" "$stage/$freq"; files+=("$freq"); fi
fi

rm -f "$PARTS_DIR"/part-*
mkdir -p "$PARTS_DIR"
tar -C "$stage" -chzf - "${files[@]}" | split -b "$part_bytes" -d -a 2 - "$PARTS_DIR/part-"
parts=("$PARTS_DIR"/part-*)
n=${#parts[@]}
total=$(cat "${parts[@]}" | wc -c)
echo "device_bundle: ${files[*]} packed in $total bytes, $n part(s) of at most $part_bytes bytes (the tree is $tree_bytes)"
echo "device calls (carry the one part each names; the last runs the check, about 5 minutes):"
for ((i = 0; i < n; ++i)); do
  p=${parts[$i]}
  cmd="mkdir -p /tmp/device-parts && cp $p /tmp/device-parts/"
  if ((i == 0)); then cmd="rm -rf /tmp/device-parts && $cmd"; fi
  if ((i == n - 1)); then
    cmd="$cmd && cat /tmp/device-parts/part-* | tar -xzf - && bash scripts/device_check.sh $OUT_DIR/bin"
  fi
  echo "  carry [\"$p\"]: $cmd"
done
