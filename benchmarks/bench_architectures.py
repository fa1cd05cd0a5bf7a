#!/usr/bin/env python3
"""Decode and prefill speed of microspec against llama.cpp on realistic-size files of the newer
architectures, in one run: random weights with the real shapes (Qwen3-0.6B, Llama-3.2-1B with its
rope_freqs, Phi-3-mini), written by the `gguf` package as F16 into a cache directory, then
quantized by llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize) to Q8_0 and
Q4_K_M. The files are made once and kept (--cache).

Per file and thread count: decode tok/s (a 128-token prompt of random ids, -n generated, greedy,
end of generation ignored) and prefill tok/s (a 512-token prompt), median over --repeats runs, and
the ratios microspec / llama.cpp; the timing code is benchmarks/bench_vs_llama_cpp.py's.

    benchmarks/bench_architectures.py [--models qwen3-0.6b,llama3.2-1b] [--types q8_0,q4_k_m]
        [--threads 2] [-n 128] [--repeats 3] [--cache ~/.cache/microspec/arch_bench]

phi3-mini (3.8B, an 7.6 GB F16 source) is left out unless named in --models.
"""
import argparse
import os
import pathlib
import statistics
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_vs_llama_cpp import ours, peer_run  # noqa: E402

# name: arch, n_embd, layers, heads, kv heads, head_dim, n_ff, vocab, rope base, tied, extra
SHAPES = {
    "qwen3-0.6b": dict(arch="qwen3", d=1024, layers=28, heads=16, kv=8, hd=128, ff=3072, vocab=151936,
                       base=1e6, tied=True),
    "llama3.2-1b": dict(arch="llama", d=2048, layers=16, heads=32, kv=8, hd=64, ff=8192, vocab=128256,
                        base=5e5, tied=True),
    "phi3-mini": dict(arch="phi3", d=3072, layers=32, heads=32, kv=32, hd=96, ff=8192, vocab=32064,
                      base=1e4, tied=False),
}
FTYPES = {"q8_0": 7, "q4_k_m": 15}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def write_f16(name, path, seed=0):
    """A random-weight F16 file of the named shapes (norms F32), tensors as llama.cpp names them."""
    import gguf
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
    from tiny_gguf import llama3_rope_factors
    s = SHAPES[name]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), s["arch"])
    d, hd, V = s["d"], s["hd"], s["vocab"]
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(s["base"])
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(3, V)])
    w.add_token_types([2, 3, 3] + [1] * (V - 3))
    w.add_token_scores([0.0] * V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def mat(n, cols, rows):  # [rows][cols]
        w.add_tensor(n, (rng.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5).astype(np.float16))

    def vec(n, k):
        w.add_tensor(n, (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32))

    q, kv = s["heads"] * hd, s["kv"] * hd
    mat("token_embd.weight", d, V)
    if not s["tied"]:
        mat("output.weight", d, V)
    vec("output_norm.weight", d)
    if s["arch"] == "llama":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(hd, s["base"], 32.0, 1.0, 4.0, 8192))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d)
        vec(p + "ffn_norm.weight", d)
        if s["arch"] == "phi3":
            mat(p + "attn_qkv.weight", d, q + 2 * kv)
            mat(p + "ffn_up.weight", d, 2 * s["ff"])
        else:
            mat(p + "attn_q.weight", d, q)
            mat(p + "attn_k.weight", d, kv)
            mat(p + "attn_v.weight", d, kv)
            mat(p + "ffn_gate.weight", d, s["ff"])
            mat(p + "ffn_up.weight", d, s["ff"])
        mat(p + "attn_output.weight", q, d)
        mat(p + "ffn_down.weight", s["ff"], d)
        if s["arch"] == "qwen3":
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def model_file(name, qtype, cache):
    import llama_cpp as L
    src, out = cache / f"{name}-f16.gguf", cache / f"{name}-{qtype}.gguf"
    if out.exists():
        return out
    if not src.exists():
        print(f"writing {src}", flush=True)
        write_f16(name, src.with_suffix(".tmp"))
        os.replace(src.with_suffix(".tmp"), src)
    print(f"quantizing {out}", flush=True)
    params = L.llama_model_quantize_default_params()
    params.ftype = FTYPES[qtype]
    params.nthread = 2
    rc = L.llama_model_quantize(str(src).encode(), str(out.with_suffix(".tmp")).encode(), params)
    assert rc == 0, f"llama_model_quantize failed with {rc}"
    os.replace(out.with_suffix(".tmp"), out)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,llama3.2-1b")
    ap.add_argument("--types", default="q8_0,q4_k_m")
    ap.add_argument("--threads", default="2")
    ap.add_argument("-n", type=int, default=128, help="tokens generated per decode run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=str(pathlib.Path.home() / ".cache" / "microspec" / "arch_bench"))
    a = ap.parse_args()
    import llama_cpp
    cache = pathlib.Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; llama-cpp-python {llama_cpp.__version__}; -n {a.n}, "
          f"{a.repeats} repeats (medians)")
    print("| model | type | threads | decode tok/s microspec | llama.cpp | ratio | prefill tok/s microspec "
          "| llama.cpp | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(1)
    for name in a.models.split(","):
        for qtype in a.types.split(","):
            path = model_file(name, qtype, cache)
            ids128 = [1] + [int(t) for t in rng.integers(3, SHAPES[name]["vocab"], 127)]
            ids512 = [1] + [int(t) for t in rng.integers(3, SHAPES[name]["vocab"], 511)]
            for t in [int(x) for x in a.threads.split(",")]:
                llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=t,
                                      n_threads_batch=t, verbose=False)
                ours(path, ids128, 4, t)  # warm-up: page the file in
                peer_run(llm, ids128, 4)
                o_dec, o_pre, l_dec, l_pre = [], [], [], []
                for _ in range(a.repeats):
                    o_dec.append(ours(path, ids128, a.n, t)["decode_tokens_per_second"])
                    o_pre.append(ours(path, ids512, 1, t)["prefill_tokens_per_second"])
                    l_dec.append(peer_run(llm, ids128, a.n)[1])
                    l_pre.append(peer_run(llm, ids512, 1)[0])
                m = statistics.median
                print(f"| {name} | {qtype} | {t} | {m(o_dec):.1f} | {m(l_dec):.1f} | {m(o_dec) / m(l_dec):.2f}x | "
                      f"{m(o_pre):.0f} | {m(l_pre):.0f} | {m(o_pre) / m(l_pre):.2f}x |", flush=True)
                del llm


if __name__ == "__main__":
    sys.exit(main())
