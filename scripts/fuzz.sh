#!/usr/bin/env bash
# Fuzzes parsers with libFuzzer + ASan + UBSan for a bounded time each:
#   gguf: the GGUF reader (fuzz/fuzz_gguf.cpp)
#   http: the server's HTTP request reader, head and body, with its limits (fuzz/fuzz_http.cpp)
#   checkpoint: the safetensors reader, the restricted unpickler and torch.save's zip archives
#         (fuzz/fuzz_checkpoint.cpp)
#   structured: JSON Schemas to grammars and their recognizer, and chat templates (the Jinja
#         interpreter) rendered with a conversation and tools (fuzz/fuzz_structured.cpp)
#   scripts/fuzz.sh [SECONDS=60] [gguf|http|checkpoint|structured ...] [extra libFuzzer flags...]   (default: all)
# Builds in build-fuzz/ with clang++ (the library is instrumented too), writes seed corpora (the
# GGUF writer plus truncated headers of the real models; a few requests for http), and keeps the
# evolving corpora in build-fuzz/corpus/<target> between runs. Exits non-zero on any crash, leak,
# timeout, sanitizer report or broken invariant; the reproducer is left in build-fuzz/artifacts/
# (replay it with build-fuzz/fuzz_<target> FILE).
set -euo pipefail

secs="${1:-60}"
shift || true
case "$secs" in '' | *[!0-9]*) echo "usage: $0 [SECONDS] [gguf|http|checkpoint|structured ...] [libFuzzer flags...]" >&2; exit 2 ;; esac
targets=()
while [ $# -gt 0 ] && { [ "$1" = gguf ] || [ "$1" = http ] || [ "$1" = checkpoint ] || [ "$1" = structured ]; }; do targets+=("$1"); shift; done
[ ${#targets[@]} -gt 0 ] || targets=(gguf http checkpoint structured)

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MICROSPEC_FUZZ_BUILD_DIR:-$root/build-fuzz}"
jobs="${MICROSPEC_FUZZ_BUILD_JOBS:-2}"
sanitizers="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DMICROSPEC_FUZZ=ON -DMICROSPEC_TESTS=OFF -DMICROSPEC_CUDA=OFF -DCMAKE_CXX_FLAGS="$sanitizers" >/dev/null
cmake --build "$build" -j"$jobs" --target fuzz_gguf make_gguf_seeds fuzz_http fuzz_checkpoint fuzz_structured

artifacts="$build/artifacts"
mkdir -p "$artifacts"

fuzz_gguf() {
  local seeds="$build/seeds/gguf" corpus="$build/corpus/gguf"
  rm -rf "$seeds"
  mkdir -p "$seeds" "$corpus"
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
  echo "fuzz.sh: gguf: no crash in ${secs}s; corpus: $(ls "$corpus" | wc -l) files in $corpus"
}

fuzz_http() {
  local seeds="$build/seeds/http" corpus="$build/corpus/http"
  rm -rf "$seeds"
  mkdir -p "$seeds" "$corpus"
  # The first byte of an input picks the read size; the rest is what a connection sends.
  printf '\x07GET /health HTTP/1.1\r\nHost: x\r\n\r\n' >"$seeds/get"
  printf '\x01POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"prompt":"x"}GET / HTTP/1.0\r\n\r\n' >"$seeds/pipelined"
  printf '\x10POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n' >"$seeds/chunked"
  printf '\x3fPOST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 300\r\n\r\n' >"$seeds/continue"
  "$build/fuzz_http" "$corpus" "$seeds" \
    -max_total_time="$secs" -max_len=4096 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=64 \
    -dict="$root/fuzz/http.dict" -artifact_prefix="$artifacts/" -print_final_stats=1 "$@"
  echo "fuzz.sh: http: no crash in ${secs}s; corpus: $(ls "$corpus" | wc -l) files in $corpus"
}

fuzz_checkpoint() {
  local seeds="$build/seeds/checkpoint" corpus="$build/corpus/checkpoint"
  rm -rf "$seeds"
  mkdir -p "$seeds" "$corpus"
  # The first byte picks the reader (0 safetensors, 1 bare pickle, 2 torch.save zip): the committed
  # fixtures (a real torch.save archive, hostile pickles, a non-contiguous view), their data.pkl,
  # and a small safetensors file.
  python3 - "$root/tests/data/checkpoint" "$seeds" <<'PY'
import json, pathlib, struct, sys, zipfile
src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for f in sorted(src.glob("*.bin")):
    data = f.read_bytes()
    (out / (f.stem + ".zip")).write_bytes(b"\x02" + data)
    try:
        with zipfile.ZipFile(f) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl")]
            if pkl:
                (out / (f.stem + ".pkl")).write_bytes(b"\x01" + z.read(pkl[0]))
    except zipfile.BadZipFile:
        pass
header = json.dumps({"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                     "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}}).encode()
(out / "tiny.safetensors").write_bytes(b"\x00" + struct.pack("<Q", len(header)) + header + bytes(range(22)))
PY
  "$build/fuzz_checkpoint" "$corpus" "$seeds" \
    -max_total_time="$secs" -max_len=16384 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256 \
    -artifact_prefix="$artifacts/" -print_final_stats=1 "$@"
  echo "fuzz.sh: checkpoint: no crash in ${secs}s; corpus: $(ls "$corpus" | wc -l) files in $corpus"
}

fuzz_structured() {
  local seeds="$build/seeds/structured" corpus="$build/corpus/structured"
  rm -rf "$seeds"
  mkdir -p "$seeds" "$corpus"
  # Byte 0 even: a schema, then NUL and text for its recognizer; odd: a chat template. Seeds: the
  # schemas of the structured-output tests and the built-in templates' constructs.
  printf '\x00{"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}}, "required": ["name"]}\x00{"name": "ab\\u00e9", "n": -12}' >"$seeds/object"
  printf '\x02{"$defs": {"t": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 3}]}}, "$ref": "#/$defs/t"}\x00[[null], []]' >"$seeds/recursive"
  printf '\x04{"enum": ["a", 1, null, {"b": [true]}], "type": ["string", "object"]}\x00{"b":[true]}' >"$seeds/enum"
  printf '\x01{%%- for m in messages -%%}<|im_start|>{{ m.role }}\n{{ m.content | trim }}{%% if m.tool_calls %%}{{ m.tool_calls | tojson }}{%% endif %%}<|im_end|>\n{%%- endfor %%}{%% if tools %%}{%% for t in tools %%}{{ t.function.name | upper }}{%% endfor %%}{%% endif %%}{{ raise_exception("x") if not messages }}' >"$seeds/template"
  printf '\x03{%% set ns = namespace(n=0) %%}{%% macro f(x) %%}{{ x ~ caller() }}{%% endmacro %%}{%% call f(1) %%}{{ loop }}{%% endcall %%}{{ messages | selectattr("role", "equalto", "user") | map(attribute="content") | join(", ") }}{{ "%%s" | format(1) }}{{ messages[1:][::-1] | length }}' >"$seeds/template2"
  "$build/fuzz_structured" "$corpus" "$seeds" \
    -max_total_time="$secs" -max_len=4096 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256 \
    -artifact_prefix="$artifacts/" -print_final_stats=1 "$@"
  echo "fuzz.sh: structured: no crash in ${secs}s; corpus: $(ls "$corpus" | wc -l) files in $corpus"
}

for target in "${targets[@]}"; do "fuzz_$target" "$@"; done
