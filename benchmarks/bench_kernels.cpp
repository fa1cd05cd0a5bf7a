// Kernel micro-benchmark: matmul throughput on the weight shapes that dominate decoding, in GB/s of
// weights streamed, per kernel table and thread count.
//
//   bench_kernels [--quick] [--tokens N]... [--only SHAPE] [--table NAME] [--threads N] [--hot]
//                 [--rows N]
//
// --rows N replaces every shape's row count: with --hot and a matrix that fits in L2 (e.g. --rows
// 1024), the figure is the kernel's compute rate alone.
//
// Each figure is the best of many timings (the machine is shared with other work).
// Weights are random blocks (valid f16 scales). A matrix that fits in the caches would measure cache
// bandwidth, not the DRAM streaming a decode step sees (its ~240 MB of weights far exceed L3), so
// small matrices are replicated to >= 256 MB and the copies are cycled through.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/matmul.h"
#include "kernels/threadpool.h"

using namespace microspec;

namespace {

struct Shape {
  const char* what;
  GgmlType type;
  int64_t rows, cols;
};

// Random bytes with every block's f16 scale fields set to small finite values.
std::vector<uint8_t> random_weights(GgmlType type, int64_t rows, int64_t cols, size_t copies) {
  const size_t bytes = row_bytes(type, cols) * size_t(rows) * copies;
  std::vector<uint8_t> w(bytes);
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    std::memcpy(&w[i], &s, 8);
  }
  const TypeTraits& tr = type_traits(type);
  std::vector<size_t> f16_fields;
  switch (type) {
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
      f16_fields = {0, 2};
      break;
    case GgmlType::Q6_K:
      f16_fields = {offsetof(BlockQ6_K, d)};
      break;
    default:
      f16_fields = {0};
  }
  const fp16_t scale = fp32_to_fp16(0.01f);
  for (size_t b = 0; b < bytes / tr.block_bytes; ++b)
    for (size_t off : f16_fields) std::memcpy(&w[b * tr.block_bytes + off], &scale, 2);
  return w;
}

// --hot: one copy of each matrix, so small ones stay in cache (kernel compute speed, not DRAM).
bool g_hot = false;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void bench(const Shape& s, const KernelTable& k, int threads, int64_t n_tokens, bool quick) {
  const size_t matrix_bytes = row_bytes(s.type, s.cols) * size_t(s.rows);
  const size_t copies =
      g_hot || matrix_bytes >= (size_t(256) << 20) ? 1 : ((size_t(256) << 20) / matrix_bytes + 1);
  static std::vector<uint8_t> w;  // reused across calls of the same shape
  static const Shape* w_shape = nullptr;
  if (w_shape != &s) {
    w = random_weights(s.type, s.rows, s.cols, copies);
    w_shape = &s;
  }
  std::vector<float> x(size_t(n_tokens * s.cols)), y(size_t(n_tokens * s.rows));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float((i * 7919) % 1000) / 500.0f - 1.0f;
  ThreadPool pool(threads);
  MatmulContext ctx(pool, k);
  ctx.reserve(n_tokens, s.cols);
  auto run = [&](size_t copy) {
    const QMatrix q{s.type, w.data() + copy * matrix_bytes, s.rows, s.cols, row_bytes(s.type, s.cols)};
    matmul(ctx, q, x.data(), n_tokens, y.data(), s.rows);
  };
  for (size_t c = 0; c < copies; ++c) run(c);  // warm up: page in, grow scratch
  // The best of many short timings: the machine is shared, and the best is the kernel's own speed.
  // Each timing covers several calls so that small matrices measure well above timer resolution.
  const double min_time = quick ? 0.3 : 1.0;
  const int per_timing = matrix_bytes >= (size_t(16) << 20) ? 1 : 8;
  int64_t calls = 0;
  double per_call = 1e30;
  for (const double start = now(); now() - start < min_time || calls < 3 * per_timing;) {
    const double t0 = now();
    for (int i = 0; i < per_timing; ++i) run(size_t(calls++) % copies);
    per_call = std::min(per_call, (now() - t0) / per_timing);
  }
  std::printf("%-28s %-5s %6lldx%-5lld tok %3lld  %-9s thr %d  %9.1f us/call  %6.2f GB/s  %7.1f GMAC/s\n",
              s.what, type_name(uint32_t(s.type)).c_str(), (long long)s.rows, (long long)s.cols,
              (long long)n_tokens, k.name, threads, per_call * 1e6, double(matrix_bytes) / per_call / 1e9,
              double(s.rows) * double(s.cols) * double(n_tokens) / per_call / 1e9);
  std::fflush(stdout);
}

// The ceiling for the GB/s figures: plain AVX2 reads of a 256 MB buffer, split like a matmul.
void bench_memory(int threads) {
  const size_t bytes = size_t(256) << 20;
  static std::vector<uint8_t> buf(bytes, 1);
  ThreadPool pool(threads);
  std::vector<long long> sink(64 * size_t(threads));
  auto pass = [&] {
    pool.parallel_for(int64_t(bytes / 4096), 16, [&](int64_t b, int64_t e, int t) {
      __m256i acc = _mm256_setzero_si256();
      for (const uint8_t* p = buf.data() + b * 4096; p < buf.data() + e * 4096; p += 128) {
        acc = _mm256_add_epi64(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        acc = _mm256_add_epi64(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
        acc = _mm256_add_epi64(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64)));
        acc = _mm256_add_epi64(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 96)));
      }
      sink[size_t(t) * 64] += _mm256_extract_epi64(acc, 0);
    });
  };
  pass();
  const double t0 = now();
  int passes = 0;
  while (now() - t0 < 0.5 || passes < 2) pass(), ++passes;
  std::printf("memory read ceiling: %d threads %.2f GB/s\n", threads,
              double(bytes) * passes / (now() - t0) / 1e9);
}

void bench_pool_overhead(int threads) {
  ThreadPool pool(threads);
  std::vector<int64_t> sink(64 * size_t(threads));
  const int calls = 200000;
  for (int i = 0; i < 1000; ++i)
    pool.parallel_for(64, 16, [&](int64_t b, int64_t, int t) { sink[size_t(t) * 64] += b; });
  const double t0 = now();
  for (int i = 0; i < calls; ++i)
    pool.parallel_for(64, 16, [&](int64_t b, int64_t, int t) { sink[size_t(t) * 64] += b; });
  const double per = (now() - t0) / calls;
  std::printf("thread pool: %d threads, empty parallel_for: %.2f us/call\n", threads, per * 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::vector<int64_t> tokens;
  std::string only, table_name;  // filters: shape name substring, table name
  int only_threads = 0;
  int64_t rows_override = 0;  // --rows: 0 keeps each shape's own
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--hot"))
      g_hot = true;
    else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc)
      tokens.push_back(std::atoll(argv[++i]));
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc)
      only = argv[++i];
    else if (!std::strcmp(argv[i], "--table") && i + 1 < argc)
      table_name = argv[++i];
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      only_threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--rows") && i + 1 < argc && std::atoll(argv[i + 1]) > 0)
      rows_override = std::atoll(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--tokens N]... [--only SHAPE] [--table NAME] [--threads N] [--hot] "
                   "[--rows N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (tokens.empty()) tokens = {1};
  static Shape shapes[] = {
      {"gemma lm_head", GgmlType::Q8_0, 262144, 640},    {"gemma ffn_up/gate", GgmlType::Q5_0, 2048, 640},
      {"gemma attn_output", GgmlType::Q4_K, 640, 1024},  {"gemma ffn_down", GgmlType::Q6_K, 640, 2048},
      {"smollm ffn_up/gate", GgmlType::Q4_1, 1536, 576}, {"smollm lm_head", GgmlType::Q8_0, 49152, 576},
  };
  if (rows_override > 0)
    for (Shape& s : shapes) s.rows = rows_override;
  std::vector<const KernelTable*> tables = {&avx2_kernels()};
  if (const KernelTable* t = avx512_kernels()) tables.push_back(t);
  if (only.empty()) {
    bench_memory(1);
    bench_memory(2);
    bench_pool_overhead(2);
  }
  for (const Shape& s : shapes) {
    if (!only.empty() && std::string(s.what).find(only) == std::string::npos) continue;
    for (int64_t nt : tokens)
      for (const KernelTable* k : tables) {
        if (!table_name.empty() && table_name != k->name) continue;
        for (int threads : {1, 2})
          if (!only_threads || threads == only_threads) bench(s, *k, threads, nt, quick);
      }
  }
  return 0;
}
