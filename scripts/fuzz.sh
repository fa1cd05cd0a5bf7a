#!/usr/bin/env bash
# Fuzzes the GGUF reader with libFuzzer + ASan + UBSan for a bounded time.
#   scripts/fuzz.sh [SECONDS=60] [extra libFuzzer flags...]
# Builds in build-fuzz/ with clang++ (the library is instrumented too), writes a seed corpus from
# the GGUF writer plus truncated headers of the real models, and keeps the evolving corpus in
# build-fuzz/corpus/gguf between runs. Exits non-zero on any crash, leak, timeout, sanitizer report
# or broken invariant; the reproducer is left in build-fuzz/artifacts/ (replay it with
# build-fuzz/fuzz_gguf FILE).
set -euo pipefail

secs="${1:-60}"
shift || true
case "$secs" in '' | *[!0-9]*) echo "usage: $0 [SECONDS] [libFuzzer flags...]" >&2; exit 2 ;; esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MICROSPEC_FUZZ_BUILD_DIR:-$root/build-fuzz}"
jobs="${MICROSPEC_FUZZ_BUILD_JOBS:-2}"
sanitizers="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DMICROSPEC_FUZZ=ON -DMICROSPEC_TESTS=OFF -DMICROSPEC_CUDA=OFF -DCMAKE_CXX_FLAGS="$sanitizers" >/dev/null
cmake --build "$build" -j"$jobs" --target fuzz_gguf make_gguf_seeds

seeds="$build/seeds/gguf"
corpus="$build/corpus/gguf"
artifacts="$build/artifacts"
rm -rf "$seeds"
mkdir -p "$seeds" "$corpus" "$artifacts"
"$build/make_gguf_seeds" "$seeds"
# Truncated real headers: realistic metadata layouts (they fail late, at the tensor data checks).
for model in "$root"/models/*.gguf; do
  [ -f "$model" ] || continue
  head -c 65536 "$model" >"$seeds/$(basename "$model" .gguf)-64k.gguf"
done

# -max_len: the seeds are small; 64 KiB leaves room for the truncated real headers.
# -malloc_limit_mb: a corrupt count must never turn into a large allocation.
"$build/fuzz_gguf" "$corpus" "$seeds" \
  -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256 \
  -dict="$root/fuzz/gguf.dict" -artifact_prefix="$artifacts/" -print_final_stats=1 "$@"
echo "fuzz.sh: no crash in ${secs}s; corpus: $(ls "$corpus" | wc -l) files in $corpus"
