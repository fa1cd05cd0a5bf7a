// Kernel micro-benchmark: matmul throughput on the weight shapes that dominate decoding, in GB/s of
// weights streamed, per kernel table and thread count; the time of each token count as a ratio to
// the 1-token call of the same matrix; and the machine's int8 dot-product peak, with the fraction
// of it that many-token calls reach.
//
//   bench_kernels [--quick] [--tokens N[,N...]]... [--only SHAPE] [--table NAME] [--threads N] [--hot]
//                 [--rows N] [--repeats N] [--cpu-time] [--no-repack]
//
// Matrices of a type that the table also reads repacked (repack.h: the AVX2, AVX-512 and AMX tables) are timed in
// both layouts, the file's and the interleaved one a model loads by default (--no-repack: the
// file's only).
//
// --rows N replaces every shape's row count: with --hot and a matrix that fits in L2 (e.g. --rows
// 1024), the figure is the kernel's compute rate alone.
//
// Each timing is the best of many calls (--cpu-time: by process CPU time, see g_cpu_time); with --repeats N (default 3) every token count of a matrix
// is timed N times, the counts interleaved, and the median of the N is reported, so that a ratio
// compares timings taken side by side on a machine shared with other work. The 1-token call is
// always timed, as the denominator of the ratios.
// Weights are random blocks (valid f16 scales). A matrix that fits in the caches would measure cache
// bandwidth, not the DRAM streaming a decode step sees (its ~240 MB of weights far exceed L3), so
// small matrices are replicated to >= 256 MB and the copies are cycled through.
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/matmul.h"
#include "kernels/repack.h"
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

// --cpu-time: time matmuls by the CPU time of the whole process (all threads) divided by the thread
// count instead of by the wall clock, so that time spent descheduled on a busy machine does not
// count. Meaningful with --threads 1 (pool workers that wait count their waiting as CPU time).
bool g_cpu_time = false;
int g_cpu_threads = 1;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double call_clock() {
  if (!g_cpu_time) return now();
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec)) / g_cpu_threads;
}

// The weights as stored in the file, or repacked into the interleaved layout (repack.h) that the
// table's gemm_interleaved kernel reads (what a model loads by default; --no-repack: file).
enum class Layout { File, Interleaved };

// Best time of one matmul call (seconds) of shape s on n_tokens tokens.
double time_call(const Shape& s, const KernelTable& k, ThreadPool& pool, int64_t n_tokens, bool quick,
                 Layout layout) {
  const size_t matrix_bytes = row_bytes(s.type, s.cols) * size_t(s.rows);
  const size_t copies =
      g_hot || matrix_bytes >= (size_t(256) << 20) ? 1 : ((size_t(256) << 20) / matrix_bytes + 1);
  static std::vector<uint8_t> w;  // reused across calls of the same shape
  static std::vector<uint8_t> il;  // w's copies interleaved, built when first asked for
  static const Shape* w_shape = nullptr;
  if (w_shape != &s) {
    w = random_weights(s.type, s.rows, s.cols, copies);
    il.clear();
    w_shape = &s;
  }
  const size_t il_bytes = layout == Layout::Interleaved ? interleaved_bytes(s.type, s.rows, s.cols) : 0;
  if (layout == Layout::Interleaved && il.empty()) {
    il.resize(il_bytes * copies + 64);
    for (size_t c = 0; c < copies; ++c)
      interleave_tiles(s.type, w.data() + c * matrix_bytes, row_bytes(s.type, s.cols), s.rows, s.cols, 0,
                       (s.rows + kInterleavedRows - 1) / kInterleavedRows, il.data() + c * il_bytes);
  }
  std::vector<float> x(size_t(n_tokens * s.cols)), y(size_t(n_tokens * s.rows));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float((i * 7919) % 1000) / 500.0f - 1.0f;
  MatmulContext ctx(pool, k);
  ctx.reserve(n_tokens, s.cols);
  auto run = [&](size_t copy) {
    QMatrix q{s.type, w.data() + copy * matrix_bytes, s.rows, s.cols, row_bytes(s.type, s.cols)};
    if (layout == Layout::Interleaved) {
      q.interleaved = il.data() + copy * il_bytes;
      q.interleaved_of = q.data;
    }
    matmul(ctx, q, x.data(), n_tokens, y.data(), s.rows);
  };
  for (size_t c = 0; c < copies; ++c) run(c);  // warm up: page in, grow scratch
  // The best of many short timings: the machine is shared, and the best is the kernel's own speed.
  // Each timing covers several calls so that small matrices measure well above timer resolution.
  const double min_time = quick ? 0.2 : 0.5;
  const int per_timing = matrix_bytes >= (size_t(16) << 20) ? 1 : 8;
  int64_t calls = 0;
  double per_call = 1e30;
  g_cpu_threads = pool.size();
  for (const double start = now(); now() - start < min_time || calls < 3 * per_timing;) {
    const double t0 = call_clock();
    for (int i = 0; i < per_timing; ++i) run(size_t(calls++) % copies);
    per_call = std::min(per_call, (call_clock() - t0) / per_timing);
  }
  return per_call;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Int8 multiply-accumulates per second that `threads` threads can issue with the instructions the
// table's integer dot products use; 0 where not measured.
struct Peaks {
  double avx512_vnni[3] = {0, 0, 0};  // by thread count (1, 2)
  double avx2[3] = {0, 0, 0};
  double amx[3] = {0, 0, 0};
  // The amx table's figures are fractions of the tile peak (its interleaved products from 16 or
  // 32 tokens run on tiles; its other kernels are the AVX-512 table's, far below that peak).
  double of(const KernelTable& k, int threads) const {
    const std::string name = k.name;
    return name == "amx" ? amx[threads] : name == "avx512" ? avx512_vnni[threads] : name == "avx2" ? avx2[threads] : 0;
  }
};
Peaks g_peaks;

void bench(const Shape& s, const KernelTable& k, Layout layout, int threads, const std::vector<int64_t>& tokens,
           int repeats, bool quick) {
  std::vector<int64_t> counts = {1};
  for (int64_t nt : tokens)
    if (std::find(counts.begin(), counts.end(), nt) == counts.end()) counts.push_back(nt);
  ThreadPool pool(threads);
  std::vector<std::vector<double>> times(counts.size());
  for (int r = 0; r < repeats; ++r)
    for (size_t i = 0; i < counts.size(); ++i) times[i].push_back(time_call(s, k, pool, counts[i], quick, layout));
  const size_t matrix_bytes = row_bytes(s.type, s.cols) * size_t(s.rows);
  const double one = median(times[0]);
  const double peak = g_peaks.of(k, threads);
  for (size_t i = 0; i < counts.size(); ++i) {
    const int64_t nt = counts[i];
    if (nt == 1 && std::find(tokens.begin(), tokens.end(), int64_t(1)) == tokens.end()) continue;
    const double t = median(times[i]);
    const double gmacs = double(s.rows) * double(s.cols) * double(nt) / t / 1e9;
    char frac[32] = "";
    if (peak > 0) std::snprintf(frac, sizeof frac, "  %5.1f%% of peak", 100.0 * gmacs / peak);
    std::printf("%-20s %-5s %6lldx%-5lld tok %3lld  %-6s %-11s thr %d  %9.1f us/call  x%5.2f of 1 tok  %6.2f GB/s  %7.1f GMAC/s%s\n",
                s.what, type_name(uint32_t(s.type)).c_str(), (long long)s.rows, (long long)s.cols,
                (long long)nt, k.name, layout == Layout::File ? "file" : "interleaved", threads, t * 1e6, t / one, double(matrix_bytes) / t / 1e9, gmacs, frac);
    std::fflush(stdout);
  }
}

// --- int8 dot-product peak -------------------------------------------------------------------
// Independent accumulator chains (more than the instruction's latency x throughput), no memory
// operands: the rate at which a core issues the instruction, in multiply-accumulates.
constexpr int kPeakChains = 12;

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double vnni_macs(int64_t iters, int64_t* sink) {
  __m512i acc[kPeakChains];
  for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm512_set1_epi32(j);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i) {
    __asm__ volatile("" : "+v"(a), "+v"(b));  // opaque operands: nothing is hoisted or folded
    for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
  }
  __m512i t = acc[0];
  for (int j = 1; j < kPeakChains; ++j) t = _mm512_add_epi32(t, acc[j]);
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, t);
  for (int32_t v : lanes) *sink += v;
  return double(iters) * kPeakChains * 64;
}

// AVX2: vpmaddubsw (u8 x s8 -> s16 pairs), vpmaddwd with ones (-> s32), vpaddd: 32 MACs per three.
double avx2_macs(int64_t iters, int64_t* sink) {
  __m256i acc[kPeakChains];
  for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm256_set1_epi32(j);
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < iters; ++i) {
    __asm__ volatile("" : "+x"(a), "+x"(b));
    for (int j = 0; j < kPeakChains; ++j)
      acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
  }
  __m256i t = acc[0];
  for (int j = 1; j < kPeakChains; ++j) t = _mm256_add_epi32(t, acc[j]);
  *sink += _mm256_extract_epi32(t, 0) + _mm256_extract_epi32(t, 7);
  return double(iters) * kPeakChains * 32;
}

double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// MAC/s of `loop` on `threads` threads, the best of several runs of ~0.1 s. Each thread's rate is
// its MACs over its own CPU time (a loop on registers only: no stalls to hide), so time spent
// descheduled on a shared machine does not lower the peak; the rates of the threads add up.
double peak_rate(double (*loop)(int64_t, int64_t*), int threads) {
  ThreadPool pool(threads);
  std::vector<int64_t> sink(64 * size_t(threads));
  const int64_t iters = 2000000;
  double best = 0;
  for (int run = 0; run < 5; ++run) {
    std::vector<double> macs(static_cast<size_t>(threads), 0.0), cpu(static_cast<size_t>(threads), 0.0);
    pool.parallel_for(threads, 1, [&](int64_t b, int64_t e, int t) {
      for (int64_t i = b; i < e; ++i) {
        const double t0 = thread_cpu_seconds();
        macs[size_t(t)] += loop(iters, &sink[size_t(t) * 64]);
        cpu[size_t(t)] += thread_cpu_seconds() - t0;
      }
    });
    double total = 0;  // a thread that took over another's share counts once
    for (size_t t = 0; t < macs.size(); ++t)
      if (cpu[t] > 0) total += macs[t] / cpu[t];
    best = std::max(best, total);
  }
  return best;
}

// AMX: TDPBSUD on tiles of 16 rows x 64 bytes (16 x 16 x 64 = 16384 multiply-accumulates each),
// four independent accumulator tiles and fixed sources (the full-depth form; the kernels' blocks
// of 32 elements use half-depth A tiles). Only called where amx_kernels() says the CPU and the OS
// give the tiles (which also asked for the tile data permission).
struct alignas(64) PeakTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16};
};

__attribute__((target("amx-tile,amx-int8"))) double amx_macs(int64_t iters, int64_t* sink) {
  static const PeakTileConfig config;
  alignas(64) static int8_t src[16 * 64];
  alignas(64) int32_t c[16 * 16];
  for (int i = 0; i < 16 * 64; ++i) src[i] = int8_t(i % 7 - 3);
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, src, 64);
  _tile_loadd(5, src, 64);
  // A quarter of the iterations, four multiplies each: the count stays comparable to the loops above.
  for (int64_t i = 0; i < iters / 4; ++i) {
    _tile_dpbsud(0, 4, 5);
    _tile_dpbsud(1, 4, 5);
    _tile_dpbsud(2, 4, 5);
    _tile_dpbsud(3, 4, 5);
  }
  _tile_stored(0, c, 64);
  _tile_release();
  *sink += c[0];
  return double(iters / 4) * 4 * 16 * 16 * 64;
}

void bench_peaks(int only_threads) {
  const bool vnni = avx512_kernels() != nullptr, amx = amx_kernels() != nullptr;
  for (int threads : {1, 2}) {
    if (only_threads && threads != only_threads) continue;
    g_peaks.avx2[threads] = peak_rate(avx2_macs, threads) / 1e9;
    std::printf("int8 peak, avx2 (vpmaddubsw+vpmaddwd+vpaddd): %d threads %7.1f GMAC/s\n", threads,
                g_peaks.avx2[threads]);
    if (vnni) {
      g_peaks.avx512_vnni[threads] = peak_rate(vnni_macs, threads) / 1e9;
      std::printf("int8 peak, avx512 (vpdpbusd zmm):              %d threads %7.1f GMAC/s\n", threads,
                  g_peaks.avx512_vnni[threads]);
    }
    if (amx) {
      g_peaks.amx[threads] = peak_rate(amx_macs, threads) / 1e9;
      std::printf("int8 peak, amx (tdpbsud 16x16x64):             %d threads %7.1f GMAC/s\n", threads,
                  g_peaks.amx[threads]);
    }
  }
  if (!vnni) std::printf("int8 peak, avx512: this CPU lacks AVX-512 VNNI, not measured\n");
  if (!amx) std::printf("int8 peak, amx: this CPU or OS gives no AMX int8 tiles, not measured\n");
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
  int repeats = 3;
  int64_t rows_override = 0;  // --rows: 0 keeps each shape's own
  bool no_repack = false;     // --no-repack: the file's layout only
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--cpu-time"))
      g_cpu_time = true;
    else if (!std::strcmp(argv[i], "--hot"))
      g_hot = true;
    else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) {
      for (const char* p = argv[++i]; *p;) {  // a list: 1,2,5,8
        char* end;
        const long long v = std::strtoll(p, &end, 10);
        if (end == p || v < 1) {
          std::fprintf(stderr, "--tokens: expected positive counts separated by commas, got '%s'\n", argv[i]);
          return 2;
        }
        tokens.push_back(v);
        p = *end == ',' ? end + 1 : end;
      }
    } else if (!std::strcmp(argv[i], "--repeats") && i + 1 < argc && std::atoi(argv[i + 1]) > 0)
      repeats = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc)
      only = argv[++i];
    else if (!std::strcmp(argv[i], "--table") && i + 1 < argc)
      table_name = argv[++i];
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      only_threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--rows") && i + 1 < argc && std::atoll(argv[i + 1]) > 0)
      rows_override = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--no-repack"))
      no_repack = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--tokens N]... [--only SHAPE] [--table NAME] [--threads N] [--hot] "
                   "[--rows N] [--repeats N] [--cpu-time] [--no-repack]\n",
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
  if (const KernelTable* t = amx_kernels()) tables.push_back(t);
  if (only.empty()) {
    bench_memory(1);
    bench_memory(2);
    bench_pool_overhead(2);
  }
  bench_peaks(only_threads);
  for (const Shape& s : shapes) {
    if (!only.empty() && std::string(s.what).find(only) == std::string::npos) continue;
    for (const KernelTable* k : tables) {
      if (!table_name.empty() && table_name != k->name) continue;
      // The file's layout, then the interleaved one where the table reads it for this type.
      for (Layout layout : {Layout::File, Layout::Interleaved}) {
        if (layout == Layout::Interleaved && (no_repack || !k->gemm_interleaved[int(s.type)])) continue;
        for (int threads : {1, 2})
          if (!only_threads || threads == only_threads) bench(s, *k, layout, threads, tokens, repeats, quick);
      }
    }
  }
  return 0;
}
