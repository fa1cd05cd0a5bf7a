#!/usr/bin/env bash
# One-time setup on a fresh Debian machine: system packages, Python packages, the two real models,
# the peer (llama.cpp via llama-cpp-python, for conformance tests and benchmarks) and the build.
# Every step is skipped when already done, so re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(build-essential cmake pkg-config libcli11-dev nlohmann-json3-dev libpcre2-dev
              libgtest-dev libgmock-dev clang libclang-rt-14-dev python3-pip
              fortunes fortunes-de fortunes-es fortunes-zh
              libboost-dev chromium qemu-user)  # qemu-user: test_front_door.py runs the binary on a CPU without AVX2
missing=()
for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing system packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements.txt
bash scripts/fetch_models.sh
bash scripts/install_llama_cpp.sh
bash scripts/fetch_llama_cpp_sdist.sh >/dev/null  # llama.cpp's chat templates, for test_chat_templates.py

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
# Token frequency files for --draft-vocab freq/hybrid (a few seconds; corpus: see the script).
bash scripts/make_freq.sh build/microspec
echo "setup done: build/microspec"
