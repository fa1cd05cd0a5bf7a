"""A genuinely different draft model with the target's vocabulary: the target requantized to
another type by llama.cpp's quantizer (llama-cpp-python's llama_model_quantize, the code behind
`llama-quantize`). Its weights differ from the target's in every layer, so it agrees with the
target often but not always, like a real small draft model, and it runs through microspec's
other kernels (Q4_0 everywhere instead of Q4_K/Q5_0/Q6_K, or Q4_1).

The file takes a few seconds to write and is kept in pytest's cache directory, named by the
source file's sha256, llama.cpp's version and the target type, so it is written again whenever
any of them changes.
"""
import os
import pathlib

import peer as peer_lib
from result_cache import file_sha256

# llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_0: Q4_0 for the layers; the quantizer picks the embedding's type.
DRAFT_FTYPE = 2


def requantized(source, cache_dir):
    """Path of `source` requantized to Q4_0, written into cache_dir when not there yet."""
    L = peer_lib.llama_cpp_module()
    name = f"draft-q4_0-{file_sha256(source)[:16]}-{L.__version__}.gguf"
    path = pathlib.Path(cache_dir) / name
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        params = L.llama_model_quantize_default_params()
        params.ftype = DRAFT_FTYPE
        params.allow_requantize = True
        params.nthread = 2
        rc = L.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
        assert rc == 0, f"llama_model_quantize({source}) failed with {rc}"
        os.replace(tmp, path)
    return path
