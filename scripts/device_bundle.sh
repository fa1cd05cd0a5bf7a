#!/usr/bin/env bash
# Packs what scripts/device_check.sh needs on a GPU machine that has no build packages and nothing
# staged: the CUDA build's three binaries (microspec, microspec_tests, bench_cuda), the shared
# libraries they load beyond the C library, and (unless --no-model) SmolLM2 with its .freq.bin.
# Each device call carries the working tree and its carried paths, at most 64 MiB together, so the
# pack is cut into parts that each fit one call, and the calls that stage and run it are printed.
# The machine stays warm only 30 s between calls, and a call that finds it cold starts a bare one:
# so the binaries travel in the last call itself, with the model's last part, and the model's other
# parts go first, each copied to the staging folder (/tmp/device-parts) by a call of its own. The
# last call unpacks the binaries, then the model only if every part of it arrived intact (its
# checksum); otherwise it says how many did, and the check runs without it (its phases skip).
#
#   scripts/device_bundle.sh [--no-model] [--parts DIR] [--staging DIR] [BIN_DIR]
#       BIN_DIR (default: build) built with CUDA. Writes DIR (default build-device/, ignored by git as
#       every build*/ folder; a carried path must lie inside the checkout): model-NN, each carried by
#       one call, and last/ (bin.tar.gz, the model's last part, model.sha256), carried by the last.
#   scripts/device_bundle.sh --unpack DIR [--staging DIR]
#       On the machine, in the last call: unpacks DIR/bin.tar.gz to build-device/bin and, when
#       every part is there, the model to models/.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/device_bundle.sh [--no-model] [--parts DIR] [--staging DIR] [BIN_DIR] | --unpack DIR [--staging DIR]"
with_model=1
PARTS_DIR=build-device
STAGING=/tmp/device-parts  # where the model's parts wait on the machine between calls
UNPACK=
while [ $# -gt 0 ]; do
  case "$1" in
    --no-model) with_model=0; shift ;;
    --parts) PARTS_DIR=${2:?--parts needs a folder}; shift 2 ;;
    --staging) STAGING=${2:?--staging needs a folder}; shift 2 ;;
    --unpack) UNPACK=${2:?--unpack needs a folder}; shift 2 ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) break ;;
  esac
done
BIN=${1:-build}
OUT_DIR=build-device  # where the binaries land on the machine
CALL_LIMIT=$((64 * 1024 * 1024))
MARGIN=$((2 * 1024 * 1024))  # the tree may grow a little before the calls are made
MODEL=models/smollm2-135m-instruct-q4_1.gguf
EXES=(microspec microspec_tests bench_cuda)

# --- On the machine: unpack what the last call carries, and the model's staged parts.
if [ -n "$UNPACK" ]; then
  tar -xzf "$UNPACK/bin.tar.gz"
  echo "device_bundle: binaries unpacked to $OUT_DIR/bin"
  if [ ! -f "$UNPACK/model.sha256" ]; then
    echo "device_bundle: no model packed (--no-model)"
    exit 0
  fi
  read -r want_sum want_parts <"$UNPACK/model.sha256"
  mkdir -p "$STAGING"
  for part in "$UNPACK"/model-*; do
    if [ -f "$part" ]; then cp "$part" "$STAGING/"; fi
  done
  staged=()  # model-00 .. model-(N-1) in order; a stale file of another name is not read
  for ((i = 0; i < want_parts; ++i)); do
    part=$(printf '%s/model-%02d' "$STAGING" "$i")
    if [ -f "$part" ]; then staged+=("$part"); fi
  done
  got_sum=$(cat /dev/null "${staged[@]}" | sha256sum | cut -d' ' -f1)
  if [ "${#staged[@]}" -eq "$want_parts" ] && [ "$got_sum" = "$want_sum" ]; then
    cat "${staged[@]}" | tar -xzf -
    echo "device_bundle: model unpacked to models/ ($want_parts parts)"
  else
    echo "device_bundle: the model is NOT staged: ${#staged[@]} of $want_parts parts in $STAGING, checksum" \
      "$([ "$got_sum" = "$want_sum" ] && echo equal || echo differs) (a call that found the machine cold loses" \
      "the parts before it); the check runs without it"
  fi
  exit 0
fi

# --- Here: pack.
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

LAST="$PARTS_DIR/last"
rm -rf "$LAST" "$PARTS_DIR"/model-* "$PARTS_DIR"/part-*  # an earlier pack's (part-NN: its older layout)
mkdir -p "$LAST"
tar -C "$stage" -czf "$LAST/bin.tar.gz" "$OUT_DIR/bin"
bin_bytes=$(stat -c %s "$LAST/bin.tar.gz")
if [ "$bin_bytes" -gt "$part_bytes" ]; then
  echo "device_bundle: the binaries pack to $bin_bytes bytes, more than one call carries beside the tree ($part_bytes)" >&2
  exit 1
fi
early=()  # the model's parts that go before the last call
if [ "$with_model" = 1 ]; then
  mkdir -p "$stage/models"
  ln -s "$PWD/$MODEL" "$stage/$MODEL"
  model_files=("$MODEL")
  freq="${MODEL%.gguf}.freq.bin"
  if [ -f "$freq" ]; then ln -s "$PWD/$freq" "$stage/$freq"; model_files+=("$freq"); fi
  tar -C "$stage" -chzf "$stage/model.tar.gz" "${model_files[@]}"
  split -b "$part_bytes" -d -a 2 "$stage/model.tar.gz" "$PARTS_DIR/model-"
  model_parts=("$PARTS_DIR"/model-*)
  echo "$(sha256sum <"$stage/model.tar.gz" | cut -d' ' -f1) ${#model_parts[@]}" >"$LAST/model.sha256"
  # The model's last part rides with the binaries when both fit one call.
  tail_part=${model_parts[-1]}
  if [ $(($(stat -c %s "$tail_part") + bin_bytes + 4096)) -le "$part_bytes" ]; then
    mv "$tail_part" "$LAST/"
    unset 'model_parts[-1]'
  fi
  early=("${model_parts[@]}")
fi

total=$(find "$PARTS_DIR" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
n=$((${#early[@]} + 1))
echo "device_bundle: ${#early[@]} model part(s) before the last call, then $LAST (binaries: $bin_bytes bytes); $total bytes in $n call(s) of at most $part_bytes bytes (the tree is $tree_bytes)"
echo "device calls, back to back while the machine stays warm (carry the one path each names; the last runs the check, at most 9 minutes):"
for ((i = 0; i < ${#early[@]}; ++i)); do
  p=${early[$i]}
  cmd="mkdir -p $STAGING && cp $p $STAGING/"
  if ((i == 0)); then cmd="rm -rf $STAGING && $cmd"; fi
  echo "  carry [\"$p\"]: $cmd"
done
echo "  carry [\"$LAST\"]: bash scripts/device_bundle.sh --unpack $LAST --staging $STAGING && bash scripts/device_check.sh $OUT_DIR/bin"
