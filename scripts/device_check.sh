#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine, in one call of a few minutes: the CUDA-vs-CPU tests
# (every device kernel against its CPU oracle; tiny generated models of every weight type: tree
# forwards, KV compaction, packed head gather, the dynamic vocabulary's state against the CPU's,
# greedy tokens equal to the CPU's, the device-resident speculative step with and without its CUDA
# graph equal to plain greedy decoding), the CLI on SmolLM2 when it is staged under models/ (plain and
# self-drafted with the full, the dynamic and the freq vocabulary, drafted by its EAGLE-3 head, and
# drafted as a tree (top-k 4) by the target's first layers with the full and the dynamic vocabulary, by the head and by a
# draft model: the same text; speculative sampling on the
# device (a chain, a tree) beside the CPU decoder's tokens for the same seed; --prompts-jsonl with a stop string, plain and self-drafted: the same tokens; `serve --device cuda`: a
# completion equal to generate's text), then the benchmark on a
# Llama-3-8B-shaped model whose random BF16 weights are made in device memory (its last rows: a
# Llama-3.2-1B-shaped draft model drafting for it).
#
#   scripts/device_check.sh [BIN_DIR]     (default: build-cuda)
#
# The binaries are built beforehand (cmake with MICROSPEC_CUDA=ON; the GPU machine may lack the
# build's dev packages): scripts/device_bundle.sh packs them, their libraries and SmolLM2 for the
# device calls, prints those calls, and (--unpack, in the last) unpacks them there. Full logs go to
# $OUT (or results/device_check/) and a short summary to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-build-cuda}
LOG=${OUT:-results/device_check}
mkdir -p "$LOG"
# Shared libraries a build machine's binaries need and the GPU machine may lack (copied beside them).
if [ -d "$BIN/lib" ]; then export LD_LIBRARY_PATH="$PWD/$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
# Each phase has its own time limit in seconds (status 124: it ran out), so a hang in one still
# leaves the others' results in the one device call; every limit is also cut to what is left of
# CHECK_LIMIT, so the whole check ends inside one device call (at most 600 s) and its logs come back.
TESTS_LIMIT=180
CLI_LIMIT=45
BENCH_LIMIT=240
CHECK_LIMIT=540
# limit N: N seconds, or what is left of CHECK_LIMIT when that is less (at least 1).
limit() {
  local left=$((CHECK_LIMIT - SECONDS))
  if [ "$left" -lt 1 ]; then left=1; fi
  if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

echo "== $(date -u '+%Y-%m-%d %H:%M UTC')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true

echo "== CUDA-vs-CPU tests"
# The real models are looked up under this checkout's models/ (staged there by the caller: they are
# larger than one device call carries); without them those tests skip by name.
export MICROSPEC_SOURCE_DIR="$PWD"
status=0
timeout "$(limit "$TESTS_LIMIT")" "$BIN/microspec_tests" --gtest_filter='Cuda*' >"$LOG/tests.log" 2>&1 || status=$?
grep -E '^\[ +(OK|FAILED|SKIPPED) +\]|^\[  PASSED|^\[ real model|Failure' "$LOG/tests.log" | head -40
if [ "$status" -ne 0 ]; then echo "CUDA tests FAILED (status $status): see tests.log"; fi
# Skipped for want of a device (a driver the runtime cannot use looks the same): not a pass here.
if grep -q "no CUDA device here" "$LOG/tests.log"; then echo "CUDA tests SKIPPED: no usable CUDA device"; status=1; fi

SMOL=models/smollm2-135m-instruct-q4_1.gguf  # with its .freq.bin (scripts/make_freq.sh) beside it
if [ -f "$SMOL" ] && [ -x "$BIN/microspec" ]; then
  echo "== generate --device cuda on SmolLM2 (96 tokens): plain, self-draft with the full, dynamic and freq vocabularies, its EAGLE-3 head (models/heads/) with the dynamic one, self-drafted trees (top-k 4, depth 3, 12 nodes) with the full and the dynamic one, the head's tree and a draft model's (SmolLM2 itself) with the dynamic one"
  P="Write a short story about a lighthouse keeper."
  for vocab in plain full dynamic freq head tree_full tree_dynamic tree_head tree_draft; do
    spec=()
    case "$vocab" in
      plain) ;;
      head) spec=(--spec head --tree-topk 1) ;;
      tree_head) spec=(--spec head --tree-topk 4 --tree-depth 3 --tree-tokens 12) ;;
      tree_draft) spec=(--spec draft --draft-model "$SMOL" --tree-topk 4 --tree-depth 3 --tree-tokens 12) ;;
      tree_*) spec=(--spec self --tree-topk 4 --tree-depth 3 --tree-tokens 12 --draft-vocab "${vocab#tree_}") ;;
      *) spec=(--spec self --tree-topk 1 --draft-vocab "$vocab") ;;
    esac
    timeout "$(limit "$CLI_LIMIT")" "$BIN/microspec" generate -m "$SMOL" -p "$P" --chat -n 96 --ignore-eos --device cuda "${spec[@]}" \
      >"$LOG/cli_$vocab.txt" 2>"$LOG/cli_$vocab.err" || { status=1; tail -3 "$LOG/cli_$vocab.err"; }
    echo "$vocab: $(tail -1 "$LOG/cli_$vocab.err")"
  done
  if [ -s "$LOG/cli_plain.txt" ] && cmp -s "$LOG/cli_plain.txt" "$LOG/cli_full.txt" &&
     cmp -s "$LOG/cli_plain.txt" "$LOG/cli_dynamic.txt" && cmp -s "$LOG/cli_plain.txt" "$LOG/cli_freq.txt" &&
     cmp -s "$LOG/cli_plain.txt" "$LOG/cli_head.txt" && cmp -s "$LOG/cli_plain.txt" "$LOG/cli_tree_full.txt" &&
     cmp -s "$LOG/cli_plain.txt" "$LOG/cli_tree_dynamic.txt" && cmp -s "$LOG/cli_plain.txt" "$LOG/cli_tree_head.txt" &&
     cmp -s "$LOG/cli_plain.txt" "$LOG/cli_tree_draft.txt"; then
    echo "same text from all nine"
  else
    echo "TEXTS DIFFER (see $LOG/cli_*.txt)"; status=1
  fi
  echo "== speculative sampling (self-drafted chain, then a tree of top-k 2, depth 3, 6 nodes; dynamic vocabulary, temperature 0.8, seed 5): the device against the CPU decoder (equal tokens unless float rounding moves a draw across an edge of its distribution)"
  for shape in chain tree; do
    drafts=(--tree-topk 1)
    if [ "$shape" = tree ]; then drafts=(--tree-topk 2 --tree-depth 3 --tree-tokens 6); fi
    for where in cpu cuda; do
      timeout "$(limit "$CLI_LIMIT")" "$BIN/microspec" generate -m "$SMOL" -p "$P" --chat -n 96 --ignore-eos --device "$where" --json \
        --spec self "${drafts[@]}" --temp 0.8 --seed 5 >"$LOG/sampled_${shape}_$where.json" 2>"$LOG/sampled_${shape}_$where.err" ||
        { status=1; tail -3 "$LOG/sampled_${shape}_$where.err"; }
    done
    python3 - "$shape" "$LOG/sampled_${shape}_cpu.json" "$LOG/sampled_${shape}_cuda.json" <<'EOF' || status=1
import json, sys
cpu, dev = (json.loads(open(f, encoding="utf-8").read().splitlines()[-1]) for f in sys.argv[2:4])
a, b = cpu["tokens"], dev["tokens"]
same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
print(f"{sys.argv[1]}: {same} of {len(a)} tokens equal; steps / accepted drafts: cpu {cpu['spec']['steps']} / {cpu['spec']['accepted_draft_tokens']},",
      f"device {dev['spec']['steps']} / {dev['spec']['accepted_draft_tokens']}")
sys.exit(0 if len(b) == len(a) == 96 else 1)
EOF
  done
  echo "== --prompts-jsonl with a stop string on the device (chat template: without it the rows end in a few tokens): plain and self-drafted give the same tokens"
  printf '%s\n' '{"prompt": "Name three rivers in Europe."}' '{"prompt": "def add(a, b):"}' >"$LOG/rows.jsonl"
  for mode in plain spec; do
    extra=()
    if [ "$mode" = spec ]; then extra=(--spec self --tree-topk 1); fi
    timeout "$(limit "$CLI_LIMIT")" "$BIN/microspec" generate -m "$SMOL" --prompts-jsonl "$LOG/rows.jsonl" --chat -n 48 --stop $'\n\n' --device cuda \
      "${extra[@]}" >"$LOG/json_$mode.txt" 2>"$LOG/json_$mode.err" || { status=1; tail -3 "$LOG/json_$mode.err"; }
    grep -o '"tokens":\[[^]]*\]' "$LOG/json_$mode.txt" >"$LOG/json_${mode}_tokens.txt" || true
  done
  head -c 700 "$LOG/json_spec.txt"; echo
  if [ "$(wc -l <"$LOG/json_plain_tokens.txt")" -eq 2 ] &&
     cmp -s "$LOG/json_plain_tokens.txt" "$LOG/json_spec_tokens.txt"; then
    echo "same tokens from both, two rows"
  else
    echo "JSON TOKENS DIFFER (see $LOG/json_*.txt)"; status=1
  fi
  echo "== serve --device cuda (self-drafted chain, dynamic vocabulary): a greedy completion is generate's text, streamed or not; a sampled one (speculative) generate --spec self --tree-topk 1 --temp 0.8 --seed 5's; top_k 0 gets 400"
  # A completion (no chat template) of a text to continue: the instruction above, raw, ends at once.
  P2="Once upon a time, a lighthouse keeper"
  timeout "$(limit "$CLI_LIMIT")" "$BIN/microspec" generate -m "$SMOL" -p "$P2" -n 48 --device cuda --json \
    >"$LOG/serve_expected.json" 2>"$LOG/serve_expected.err" || status=1
  timeout "$(limit "$CLI_LIMIT")" "$BIN/microspec" generate -m "$SMOL" -p "$P2" -n 48 --device cuda --json --temp 0.8 --seed 5 \
    --spec self --tree-topk 1 >"$LOG/serve_sampled.json" 2>"$LOG/serve_sampled.err" || status=1
  # Under a time limit of its own: shutting down waits for generations in flight, which a hang would hold.
  timeout -k 5 "$(limit 120)" "$BIN/microspec" serve -m "$SMOL" --port 0 --device cuda --spec self --tree-topk 1 \
    2>"$LOG/serve.err" &
  pid=$!
  port=""
  for _ in $(seq 1 600); do
    port=$(grep -oE 'listening on http://[^:]+:[0-9]+' "$LOG/serve.err" | grep -oE '[0-9]+$' || true)
    if [ -n "$port" ] || ! kill -0 "$pid" 2>/dev/null; then break; fi
    sleep 0.1
  done
  if [ -n "$port" ]; then
    timeout "$(limit "$CLI_LIMIT")" python3 - "$port" "$P2" "$LOG/serve_expected.json" "$LOG/serve_sampled.json" <<'EOF' || status=1
import json, sys, urllib.error, urllib.request
port, prompt = sys.argv[1], sys.argv[2]
expected = json.load(open(sys.argv[3], encoding="utf-8"))["text"]
sampled = json.load(open(sys.argv[4], encoding="utf-8"))["text"]
if not expected or not sampled:
    print("generate gave an empty text: nothing to compare"); sys.exit(1)
def post(body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=50) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
request = {"prompt": prompt, "max_tokens": 48, "temperature": 0}
status, raw = post(request)
body = json.loads(raw)
same = status == 200 and body["choices"][0]["text"] == expected
print("greedy:", status, "same text as generate" if same else "TEXT DIFFERS", json.dumps(body.get("usage", body))[:400])
status_s, raw_s = post({**request, "stream": True})
chunks = [json.loads(l[6:]) for l in raw_s.splitlines() if l.startswith("data: ") and l != "data: [DONE]"]
same_s = status_s == 200 and "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == expected
print("streamed:", status_s, "same text" if same_s else "TEXT DIFFERS")
status_t, raw_t = post({**request, "temperature": 0.8, "seed": 5})
same_t = status_t == 200 and json.loads(raw_t)["choices"][0]["text"] == sampled
print("temperature 0.8, seed 5:", status_t, "same text as generate --spec self --tree-topk 1 --temp 0.8 --seed 5" if same_t else "TEXT DIFFERS " + raw_t[:300])
status_k, raw_k = post({**request, "temperature": 0.8, "top_k": 0})
print("top_k 0:", status_k, raw_k[:200])
sys.exit(0 if same and same_s and same_t and status_k == 400 else 1)
EOF
  else
    echo "serve did not start: $(tail -3 "$LOG/serve.err")"; status=1
  fi
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" || { echo "serve exited with $?: $(tail -3 "$LOG/serve.err")"; status=1; }
fi

echo "== Llama-3-8B-shaped benchmark (random BF16 weights in device memory)"
timeout "$(limit "$BENCH_LIMIT")" "$BIN/bench_cuda" "${@:2}" 2>&1 | tee "$LOG/bench.log"
exit "$status"
