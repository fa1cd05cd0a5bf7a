#!/usr/bin/env bash
# Token frequency files for the `freq` and `hybrid` draft vocabularies of both real models:
#   models/gemma-3-270m-q4_k_m.freq.bin, models/smollm2-135m-instruct-q4_1.freq.bin
# written by `microspec vocab-freq` (format: src/vocab/freq_file.h), plus models/freq-corpus.sha256,
# the list of corpus files and their checksums.
#
# The corpus is text that Debian ships, so it is the same on every machine set up by setup.sh and
# needs no network, and it has nothing to do with the benchmark prompts (SpecBench):
#   - the fortune cookie databases of the Debian packages fortunes, fortunes-de, fortunes-es and
#     fortunes-zh (/usr/share/games/fortunes: quotations, literature, jokes, computing lore in
#     English, German, Spanish and Chinese; about 4.9 MB);
#   - the Python standard library's top-level modules of Debian's python3
#     (/usr/lib/python3.X/*.py: code, comments and docstrings; about 4.7 MB).
# Before counting, the script checks that no SpecBench prompt (first 60 characters of any turn)
# occurs in the corpus. Takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-build/microspec}"
[ -x "$BIN" ] || { echo "make_freq.sh: $BIN not found (build first)" >&2; exit 1; }

FORTUNES=/usr/share/games/fortunes
PYLIB=$(ls -d /usr/lib/python3.[0-9]* 2>/dev/null | sort -V | tail -1)
[ -d "$FORTUNES" ] || { echo "make_freq.sh: $FORTUNES missing (apt-get install fortunes fortunes-de fortunes-es fortunes-zh)" >&2; exit 1; }
[ -n "$PYLIB" ] || { echo "make_freq.sh: no /usr/lib/python3.X (apt-get install python3)" >&2; exit 1; }

# Regular files only (the .u8 names are symlinks to the same text), no .dat indexes.
mapfile -t CORPUS < <( (find "$FORTUNES" -type f ! -name '*.dat'; ls "$PYLIB"/*.py) | LC_ALL=C sort)
[ ${#CORPUS[@]} -gt 100 ] || { echo "make_freq.sh: corpus too small (${#CORPUS[@]} files)" >&2; exit 1; }

SPEC_BENCH=../shared/data/spec_bench/question.jsonl
if [ -f "$SPEC_BENCH" ]; then
  python3 - "$SPEC_BENCH" "${CORPUS[@]}" <<'PY'
import json, sys
bench, files = sys.argv[1], sys.argv[2:]
text = "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in files)
turns = [t for line in open(bench, encoding="utf-8") if line.strip() for t in json.loads(line)["turns"]]
hits = [t[:60] for t in turns if len(t) >= 60 and t[:60] in text]
if hits:
    sys.exit(f"make_freq.sh: the corpus contains SpecBench prompts: {hits[:3]}")
PY
fi

sha256sum "${CORPUS[@]}" > models/freq-corpus.sha256
for model in gemma-3-270m-q4_k_m smollm2-135m-instruct-q4_1; do
  "$BIN" vocab-freq -q -m "models/$model.gguf" --corpus "${CORPUS[@]}" -o "models/$model.freq.bin"
  echo "make_freq.sh: models/$model.freq.bin"
done
