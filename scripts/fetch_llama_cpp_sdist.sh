#!/usr/bin/env bash
# Prints the path of llama.cpp's source tree as the llama-cpp-python 0.3.36 sdist ships it
# (vendor/llama.cpp), fetching the sdist once with pip (download only, no build) and unpacking it
# under ${XDG_CACHE_HOME:-$HOME/.cache}/microspec/llama-cpp-python-0.3.36-sdist. Tests read files
# from it (models/templates/*.jinja: the chat templates llama.cpp tests against);
# benchmarks/build_llama_server.sh builds llama-server from it.
#   scripts/fetch_llama_cpp_sdist.sh            # prints .../llama_cpp_python-0.3.36/vendor/llama.cpp
set -euo pipefail

VERSION=0.3.36
CACHE_ROOT=${XDG_CACHE_HOME:-$HOME/.cache}/microspec
CACHE=$CACHE_ROOT/llama-cpp-python-$VERSION-sdist
TREE=$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp
TARBALL=llama_cpp_python-$VERSION.tar.gz

if [ ! -d "$TREE/models/templates" ]; then
  mkdir -p "$CACHE"
  tmp=$(mktemp -d "$CACHE/unpack.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$tmp" >&2
  tar -xzf "$tmp/$TARBALL" -C "$tmp"
  rm -rf "$CACHE/llama_cpp_python-$VERSION"
  mv "$tmp/llama_cpp_python-$VERSION" "$CACHE/"
fi
echo "$TREE"
