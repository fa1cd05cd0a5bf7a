// CUDA backend against the CPU path: every kernel with the CPU as its oracle, then whole forwards
// (sequences and token trees, KV compaction) and greedy generation on tiny generated models of
// every weight type the device supports. Without a GPU every test here is reported as skipped.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <tuple>
#include <vector>

#include "../support/resident_sampling.h"
#include "../support/resident_step.h"
#include "../support/resident_tree.h"
#include "../support/test_helpers.h"
#include "../support/tiny_head.h"
#include "../support/tiny_model.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_model.h"
#include "cuda/draft_vocab.h"
#include "cuda/eagle_head.h"
#include "cuda/ops.h"
#include "cuda/packed_head.h"
#include "draft_head/eagle3_head.h"
#include "gguf/gguf.h"
#include "kernels/kernels.h"
#include "kernels/matmul.h"
#include "kernels/threadpool.h"
#include "math/select.h"
#include "model/model.h"
#include "sampling/sampler.h"
#include "speculative/tree.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"
#include "vocab/candidate_stream.h"
#include "vocab/packed_head.h"

namespace microspec {
namespace {

#define REQUIRE_GPU()                                                       \
  do {                                                                      \
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device here"; \
  } while (0)

// A device buffer freed at scope end.
template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) { MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(count, 1) * sizeof(T))); }
  DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    cuda::upload(ptr, host.data(), host.size() * sizeof(T));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  std::vector<T> to_host() const {
    std::vector<T> h(n);
    MS_CUDA(cudaDeviceSynchronize());
    MS_CUDA(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

std::vector<float> normal_floats(size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

float max_abs(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Largest |a - b| relative to the largest magnitude in b (the CPU oracle); NaN anywhere is infinite.
float rel_max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  float m = 0.0f;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    m = std::max(m, std::fabs(a[i] - b[i]));
  }
  return m / std::max(max_abs(b), 1e-30f);
}

// "at i: got G, want W" for the element with the largest difference (failure messages).
std::string worst(const std::vector<float>& a, const std::vector<float>& b) {
  size_t wi = 0;
  float wd = -1.0f;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (!(std::fabs(a[i] - b[i]) <= wd)) wd = std::fabs(a[i] - b[i]), wi = i;
  if (a.empty() || b.empty()) return "empty";
  return "at " + std::to_string(wi) + ": got " + std::to_string(a[wi]) + ", want " + std::to_string(b[wi]) +
         " (of " + std::to_string(a.size()) + ")";
}

// Tolerance of a device product against the CPU: the same block arithmetic, float sums in another order.
constexpr float kMatmulTol = 1e-4f;

const GgmlType kDeviceTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1,
                                 GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K};

// The activation quantizers are the CPU's bit for bit (the products' integer sums depend on it).
TEST(CudaKernels, ActivationQuantizationMatchesCpuBitwise) {
  REQUIRE_GPU();
  const int64_t cols = 1024;
  const int32_t n = 3;
  std::vector<float> x = normal_floats(size_t(n) * cols, 21);
  x[5] = 0.0f;
  for (int j = 256; j < 512; ++j) x[j] = 0.0f;  // an all-zero block
  for (GgmlType act : {GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K}) {
    SCOPED_TRACE(type_name(uint32_t(act)));
    const size_t rb = row_bytes(act, cols);
    std::vector<uint8_t> want(rb * n);
    for (int32_t t = 0; t < n; ++t) reference_kernels().quantize[int(act)](x.data() + t * cols, want.data() + t * rb, cols);
    DeviceBuffer<float> dx(x);
    DeviceBuffer<uint8_t> out(want.size());
    cuda::quantize_activations(act, dx.ptr, cols, n, cols, out.ptr, nullptr);
    const std::vector<uint8_t> got = out.to_host();
    size_t first = 0;
    while (first < got.size() && got[first] == want[first]) ++first;
    std::string bytes;
    for (size_t i = first; i < first + 8 && i < got.size(); ++i)
      bytes += " " + std::to_string(got[i]) + "/" + std::to_string(want[i]);
    EXPECT_EQ(first, got.size()) << "first differing byte " << first << " of " << got.size() << ": got/want" << bytes;
  }
}

// A random matrix of `rows` rows in `type`: 520 columns for the float types (a product ending
// inside a 32-column chunk), 512 for the block formats.
struct TestWeights {
  int64_t cols;
  size_t row_bytes;
  std::vector<uint8_t> bytes;
};
TestWeights test_weights(GgmlType type, int64_t rows, unsigned seed) {
  const bool float_type = type == GgmlType::F32 || type == GgmlType::F16 || type == GgmlType::BF16;
  const int64_t cols = float_type ? 520 : 512;
  const std::vector<float> wf = normal_floats(size_t(rows * cols), seed);
  const size_t rb = row_bytes(type, cols);
  std::vector<uint8_t> wq(rb * rows);
  for (int64_t r = 0; r < rows; ++r) quantize_row_reference(type, wf.data() + r * cols, wq.data() + r * rb, cols);
  return TestWeights{cols, rb, std::move(wq)};
}

// Every weight type against the CPU, for one token, a few, a verification's 60 and more than one
// pass of the BF16 tensor-core product (64 tokens); float weights with a column count that ends
// inside a 32-column chunk.
TEST(CudaKernels, MatmulMatchesCpuForEveryWeightType) {
  REQUIRE_GPU();
  const int64_t rows = 77;
  ThreadPool pool(1);
  MatmulContext ctx(pool, reference_kernels());
  for (GgmlType type : kDeviceTypes) {
    SCOPED_TRACE(type_name(uint32_t(type)));
    const auto [cols, rb, wq] = test_weights(type, rows, 11);
    const QMatrix cpu_w{type, wq.data(), rows, cols, rb};
    DeviceBuffer<uint8_t> dw(wq);
    const cuda::DeviceMatrix gpu_w{type, dw.ptr, rows, cols, rb};
    for (int32_t n_tokens : {1, 3, 10, 60, 70}) {
      SCOPED_TRACE(n_tokens);
      const std::vector<float> x = normal_floats(size_t(n_tokens * cols), 100 + n_tokens);
      std::vector<float> want(size_t(n_tokens * rows));
      matmul(ctx, cpu_w, x.data(), n_tokens, want.data(), rows);
      DeviceBuffer<float> dx(x);
      DeviceBuffer<float> dy(want.size());
      DeviceBuffer<uint8_t> scratch(cuda::matmul_scratch_bytes(n_tokens, cols));
      MS_CUDA(cudaMemset(dy.ptr, 0xFF, want.size() * sizeof(float)));  // NaN: every output must be written
      cuda::matmul(gpu_w, cuda::RowSelection{nullptr, rows}, dx.ptr, cols, n_tokens, dy.ptr, rows,
                   cuda::Store::Overwrite, scratch.ptr, nullptr);
      const std::vector<float> got = dy.to_host();
      EXPECT_LT(rel_max_diff(got, want), kMatmulTol) << worst(got, want);
      if (type == GgmlType::BF16) {  // the tensor-core product's peer on CUDA cores
        DeviceBuffer<float> dyc(want.size());
        cuda::matmul_bf16_cuda_cores(gpu_w, cuda::RowSelection{nullptr, rows}, dx.ptr, cols, n_tokens, dyc.ptr, rows,
                                     cuda::Store::Overwrite, scratch.ptr, nullptr);
        const std::vector<float> got_cores = dyc.to_host();
        EXPECT_LT(rel_max_diff(got_cores, want), kMatmulTol) << "CUDA cores: " << worst(got_cores, want);
      }

      // A subset of rows (the LM head over a draft vocabulary), accumulated onto existing values.
      const std::vector<int32_t> ids = {5, 0, 76, 33, 34};
      std::vector<float> want_rows(size_t(n_tokens) * ids.size());
      matmul_rows(ctx, cpu_w, ids.data(), int64_t(ids.size()), x.data(), n_tokens, want_rows.data(),
                  int64_t(ids.size()));
      std::vector<float> base = normal_floats(want_rows.size(), 7);
      for (size_t i = 0; i < base.size(); ++i) want_rows[i] += base[i];
      DeviceBuffer<int32_t> dids(ids);
      DeviceBuffer<float> dyr(base);
      cuda::matmul(gpu_w, cuda::RowSelection{dids.ptr, int64_t(ids.size())}, dx.ptr, cols, n_tokens, dyr.ptr,
                   int64_t(ids.size()), cuda::Store::Accumulate, scratch.ptr, nullptr);
      const std::vector<float> got_rows = dyr.to_host();
      EXPECT_LT(rel_max_diff(got_rows, want_rows), kMatmulTol) << worst(got_rows, want_rows);
    }
  }
}

// What lossless speculation on the device rests on: a token's product is the same bits whatever
// batch it is in (alone as in a decode step, or at any place of a verification batch, in one pass
// or the second), for every weight type.
TEST(CudaKernels, MatmulIsBatchInvariant) {
  REQUIRE_GPU();
  const int64_t rows = 77;
  const int32_t n_all = 70;
  for (GgmlType type : kDeviceTypes) {
    SCOPED_TRACE(type_name(uint32_t(type)));
    const auto [cols, rb, wq] = test_weights(type, rows, 12);
    DeviceBuffer<uint8_t> dw(wq);
    const cuda::DeviceMatrix gpu_w{type, dw.ptr, rows, cols, rb};
    const std::vector<float> x = normal_floats(size_t(n_all * cols), 13);
    DeviceBuffer<float> dx(x);
    DeviceBuffer<uint8_t> scratch(cuda::matmul_scratch_bytes(n_all, cols));
    auto product = [&](int32_t first, int32_t n) {
      DeviceBuffer<float> dy(size_t(n) * rows);
      cuda::matmul(gpu_w, cuda::RowSelection{nullptr, rows}, dx.ptr + int64_t(first) * cols, cols, n, dy.ptr, rows,
                   cuda::Store::Overwrite, scratch.ptr, nullptr);
      return dy.to_host();
    };
    const std::vector<float> all = product(0, n_all);
    auto expect_same_bits = [&](const std::vector<float>& got, int32_t first, const char* what) {
      for (size_t i = 0; i < got.size(); ++i) {
        const float want = all[size_t(first) * rows + i];
        if (std::memcmp(&got[i], &want, sizeof(float)) != 0) {
          ADD_FAILURE() << what << ": token " << first + int64_t(i) / rows << " row " << int64_t(i) % rows << ": "
                        << got[i] << " vs " << want << " in the " << n_all << "-token batch";
          return;
        }
      }
    };
    for (int32_t t : {0, 1, 7, 8, 37, 63, 64, 69}) expect_same_bits(product(t, 1), t, "alone");
    for (int32_t n : {2, 8, 9, 17, 33, 60}) expect_same_bits(product(0, n), 0, "a shorter batch");
    expect_same_bits(product(5, 60), 5, "a batch starting at token 5");
  }
}

TEST(CudaKernels, EmbeddingRowsMatchCpuDequantization) {
  REQUIRE_GPU();
  const int64_t rows = 9, cols = 512;
  for (GgmlType type : kDeviceTypes) {
    SCOPED_TRACE(type_name(uint32_t(type)));
    const std::vector<float> wf = normal_floats(size_t(rows * cols), 3);
    const size_t rb = row_bytes(type, cols);
    std::vector<uint8_t> wq(rb * rows);
    for (int64_t r = 0; r < rows; ++r) quantize_row_reference(type, wf.data() + r * cols, wq.data() + r * rb, cols);
    const std::vector<int32_t> ids = {4, 8, 0, 4};
    std::vector<float> want(ids.size() * cols);
    for (size_t i = 0; i < ids.size(); ++i) {
      dequantize_row(type, wq.data() + ids[i] * rb, want.data() + i * cols, cols);
      for (int64_t j = 0; j < cols; ++j) want[i * cols + j] *= 2.5f;
    }
    DeviceBuffer<uint8_t> dw(wq);
    DeviceBuffer<int32_t> dids(ids);
    DeviceBuffer<float> out(want.size());
    cuda::gather_rows_f32(cuda::DeviceMatrix{type, dw.ptr, rows, cols, rb}, dids.ptr, int32_t(ids.size()), 2.5f,
                          out.ptr, nullptr);
    EXPECT_LT(rel_max_diff(out.to_host(), want), 1e-6f);
  }
}

TEST(CudaKernels, ArgmaxAndTopKFollowTheCpuOrder) {
  REQUIRE_GPU();
  const int64_t n = 50000;
  std::vector<float> x = normal_floats(size_t(2 * n), 5);
  x[123] = 9.0f;
  x[40000] = 9.0f;  // a tie: the lower index wins
  x[7] = NAN;
  x[n + 77] = NAN;
  x[n + 4242] = 5.5f;
  DeviceBuffer<float> dx(x);
  DeviceBuffer<int32_t> out(2);
  DeviceBuffer<uint64_t> scratch(2);
  cuda::argmax_rows(dx.ptr, 2, n, out.ptr, scratch.ptr, nullptr);
  const std::vector<int32_t> got = out.to_host();
  EXPECT_EQ(got[0], 123);
  EXPECT_EQ(got[1], 4242);
  {
    // A maximum of zero: -0 at index 3 and +0 at index 9 tie, and the CPU takes the lower index.
    std::vector<float> zeros(1000, -1.0f);
    zeros[3] = -0.0f;
    zeros[9] = 0.0f;
    DeviceBuffer<float> dz(zeros);
    DeviceBuffer<int32_t> zero_out(1);
    DeviceBuffer<uint64_t> zero_scratch(1);
    cuda::argmax_rows(dz.ptr, 1, int64_t(zeros.size()), zero_out.ptr, zero_scratch.ptr, nullptr);
    const int32_t picked = zero_out.to_host()[0];
    EXPECT_EQ(picked, argmax(zeros.data(), int64_t(zeros.size())));
    EXPECT_EQ(picked, 3);
  }

  const int32_t k = 20;
  std::vector<int32_t> order;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isnan(x[i])) order.push_back(int32_t(i));
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] > x[b]; });
  DeviceBuffer<int32_t> ids(2 * k);
  DeviceBuffer<float> vals(2 * k);
  cuda::top_k_rows(dx.ptr, n, n, cuda::RowRange{.max_rows = 1}, k, ids.ptr, vals.ptr, nullptr);
  std::vector<int32_t> top = ids.to_host();
  const std::vector<float> topv = vals.to_host();
  for (int32_t j = 0; j < k; ++j) {
    EXPECT_EQ(top[j], order[j]) << "rank " << j;
    EXPECT_EQ(topv[j], x[order[j]]);
  }

  // Rows picked on the device: the range [1, 2) of a launch sized for 2 rows takes row 1 only, and
  // its second block leaves its output alone.
  std::vector<int32_t> order1;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isnan(x[n + i])) order1.push_back(int32_t(i));
  std::stable_sort(order1.begin(), order1.end(), [&](int32_t a, int32_t b) { return x[n + a] > x[n + b]; });
  DeviceBuffer<int32_t> range(std::vector<int32_t>{1, 1});  // first, count
  MS_CUDA(cudaMemset(ids.ptr, 0xFF, 2 * k * sizeof(int32_t)));
  cuda::top_k_rows(dx.ptr, n, n, cuda::RowRange{range.ptr, range.ptr + 1, 2}, k, ids.ptr, vals.ptr, nullptr);
  top = ids.to_host();
  for (int32_t j = 0; j < k; ++j) {
    EXPECT_EQ(top[j], order1[j]) << "row 1, rank " << j;
    EXPECT_EQ(top[k + j], -1) << "the unused block wrote rank " << j;
  }

  // Rows listed on the device (a tree's accepted rows), from an offset read there: list[1, 3) is
  // row 1, then row 0.
  DeviceBuffer<int32_t> list(std::vector<int32_t>{0, 1, 0}), from(std::vector<int32_t>{1, 2});  // first, count
  cuda::top_k_rows(dx.ptr, n, n, cuda::RowRange{from.ptr, from.ptr + 1, 2, list.ptr}, k, ids.ptr, vals.ptr, nullptr);
  top = ids.to_host();
  for (int32_t j = 0; j < k; ++j) {
    EXPECT_EQ(top[j], order1[j]) << "listed row 1, rank " << j;
    EXPECT_EQ(top[k + j], order[j]) << "listed row 0, rank " << j;
  }
}

// How far the draw u = (bits >> 11) * 2^-53 * mass of a sampled token lies from the nearest edge
// of the CPU distribution's cumulative sums, as a share of the mass: a device whose weights differ
// in the last bits (its expf, or its logits) can pick a neighbouring token only when this is tiny.
double draw_margin(const std::vector<std::pair<int32_t, float>>& dist, uint64_t bits) {
  double mass = 0.0;
  for (const auto& e : dist) mass += e.second;
  const double u = static_cast<double>(bits >> 11) * 0x1.0p-53 * mass;
  double cum = 0.0, margin = u;
  for (const auto& e : dist) {
    cum += e.second;
    margin = std::min(margin, std::fabs(u - cum));
  }
  return margin / mass;
}

// Sampled decoding's pick: top_k_rows, then the ranked draw in one device thread, against the
// CPU's Sampler with the same seed over rows with ties, NaN, -inf, +inf and fewer samplable values
// than k; the random bits are indexed by a count read on the device. Equal tokens, except where
// the draw lies within float rounding of an edge of the distribution (device expf vs the host's).
TEST(CudaKernels, DrawTopKMatchesTheCpuSampler) {
  REQUIRE_GPU();
  const int64_t n = 1000;
  const int32_t rows = 10;
  DeviceBuffer<float> drow(static_cast<size_t>(n));
  DeviceBuffer<int32_t> ids(64), out(1), draw(1);
  DeviceBuffer<float> vals(64);
  DeviceBuffer<uint64_t> dbits(static_cast<size_t>(rows));
  DeviceBuffer<DrawSettings> settings(1);
  int32_t total = 0, edge = 0;
  for (int32_t k : {1, 7, 40, 64}) {
    for (float top_p : {1.0f, 0.9f, 0.3f}) {
      for (float temperature : {0.2f, 0.8f, 1.5f}) {
        const SamplingParams p{.temperature = temperature, .top_k = k, .top_p = top_p, .seed = uint64_t(total + 1)};
        Sampler cpu(p, n), listed(p, n);
        std::mt19937_64 rng(p.seed);
        std::vector<uint64_t> bits(static_cast<size_t>(rows));
        for (uint64_t& b : bits) b = rng();
        cuda::upload(dbits.ptr, bits.data(), bits.size() * sizeof(uint64_t));
        const DrawSettings st{.temperature = temperature, .top_p = top_p};
        cuda::upload(settings.ptr, &st, sizeof st);
        std::vector<std::pair<int32_t, float>> dist;
        for (int32_t r = 0; r < rows; ++r, ++total) {
          std::vector<float> x = normal_floats(size_t(n), unsigned(1000 + total), r % 2 ? 3.0f : 0.5f);
          if (r % 3 == 1)
            for (float& v : x) v = std::round(v * 2.0f) / 2.0f;  // ties
          if (r % 4 == 2)
            for (int64_t i = 5; i < n; ++i) x[size_t(i)] = -INFINITY;  // fewer samplable values than k
          if (r == 3) x[10] = NAN, x[20] = -INFINITY;
          if (r == 8) x[30] = x[600] = INFINITY;
          cuda::upload(drow.ptr, x.data(), x.size() * sizeof(float));
          cuda::upload(draw.ptr, &r, sizeof r);
          cuda::top_k_rows(drow.ptr, n, n, cuda::RowRange{}, k, ids.ptr, vals.ptr, nullptr);
          cuda::draw_top_k(ids.ptr, vals.ptr, k, settings.ptr, dbits.ptr, draw.ptr, out.ptr, nullptr);
          const int32_t got = out.to_host()[0];
          const int32_t want = cpu.sample(x.data());
          listed.distribution(x.data(), dist);
          if (got != want) {
            ++edge;
            EXPECT_LT(draw_margin(dist, bits[size_t(r)]), 1e-5)
                << "k " << k << ", top-p " << top_p << ", T " << temperature << ", row " << r << ": device " << got
                << ", CPU " << want;
          }
        }
      }
    }
  }
  EXPECT_LE(edge, total / 100) << "tokens that differed at an edge of the distribution, of " << total;
  // A row with nothing samplable gives -1 (the host reports it).
  const std::vector<float> dead(size_t(n), -INFINITY);
  cuda::upload(drow.ptr, dead.data(), dead.size() * sizeof(float));
  cuda::top_k_rows(drow.ptr, n, n, cuda::RowRange{}, 5, ids.ptr, vals.ptr, nullptr);
  cuda::draw_top_k(ids.ptr, vals.ptr, 5, settings.ptr, dbits.ptr, nullptr, out.ptr, nullptr);
  EXPECT_EQ(out.to_host()[0], -1);
  EXPECT_THROW(cuda::draw_top_k(ids.ptr, vals.ptr, 65, settings.ptr, dbits.ptr, nullptr, out.ptr, nullptr), Error);
}

// A draft tree's proposals against tree.h's top_k_logprobs: the same ids (mapped through a slot
// table, over a count read on the device), log-probabilities to float rounding; a row with fewer
// values than k pads with -1; -inf is never chosen.
TEST(CudaKernels, TreeProposalsMatchTopKLogprobs) {
  REQUIRE_GPU();
  const int64_t n = 3000;
  const int32_t k = 10, rows = 3;
  std::vector<float> x = normal_floats(size_t(rows * n), 11);
  x[5] = x[9] = 4.0f;  // a tie
  x[17] = NAN;
  x[n + 3] = -INFINITY;
  std::vector<int32_t> slot_ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) slot_ids[size_t(i)] = int32_t(7 * i + 1);
  DeviceBuffer<float> dx(x);
  DeviceBuffer<int32_t> ids(slot_ids), tokens(size_t(rows * k));
  DeviceBuffer<float> logprobs(size_t(rows * k));
  for (const int32_t n_valid : {int32_t(n), 2500, 6}) {
    SCOPED_TRACE("valid " + std::to_string(n_valid));
    DeviceBuffer<int32_t> count(std::vector<int32_t>{n_valid});
    cuda::tree_proposals(dx.ptr, n, n, count.ptr, ids.ptr, rows, k, tokens.ptr, logprobs.ptr, nullptr);
    const std::vector<int32_t> got = tokens.to_host();
    const std::vector<float> got_lp = logprobs.to_host();
    for (int32_t r = 0; r < rows; ++r) {
      std::vector<Proposal> want(static_cast<size_t>(k));
      const int32_t m = top_k_logprobs(x.data() + size_t(r) * n, n_valid, k, want.data());
      for (int32_t j = 0; j < k; ++j) {
        if (j >= m) {
          EXPECT_EQ(got[size_t(r * k + j)], -1) << "row " << r << ", rank " << j;
          continue;
        }
        EXPECT_EQ(got[size_t(r * k + j)], slot_ids[size_t(want[size_t(j)].token)]) << "row " << r << ", rank " << j;
        EXPECT_NEAR(got_lp[size_t(r * k + j)], want[size_t(j)].logprob, 1e-5f) << "row " << r << ", rank " << j;
      }
    }
  }
  // The full vocabulary: no count, no table.
  cuda::tree_proposals(dx.ptr, n, n, nullptr, nullptr, 1, k, tokens.ptr, logprobs.ptr, nullptr);
  std::vector<Proposal> want(static_cast<size_t>(k));
  top_k_logprobs(x.data(), int32_t(n), k, want.data());
  const std::vector<int32_t> got = tokens.to_host();
  for (int32_t j = 0; j < k; ++j) EXPECT_EQ(got[size_t(j)], want[size_t(j)].token) << "rank " << j;
}

// --- whole models -----------------------------------------------------------------------------

struct TinyPair {
  std::string path;
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> cpu;
  std::unique_ptr<cuda::CudaModel> gpu;
  explicit TinyPair(const test::TinyModelSpec& spec) {
    path = (std::filesystem::temp_directory_path() /
            ("microspec_cuda_" + spec.arch + "_" + type_name(uint32_t(spec.weight_type)) + "_" +
             std::to_string(::getpid()) + ".gguf"))
               .string();
    test::write_tiny_model(spec, path);
    file = GgufFile::open(path);
    ModelOptions opt;
    opt.n_threads = 2;
    opt.n_batch = 64;
    cpu = Model::load(*file, opt);
    cuda::CudaModelOptions gopt;
    gopt.n_batch = 64;
    gopt.n_ctx = 256;
    gpu = cuda::CudaModel::load(*file, gopt);
  }
  ~TinyPair() { std::filesystem::remove(path); }
};

// Shapes every device type can hold: K-quant rows need multiples of 256 elements.
test::TinyModelSpec device_spec(const std::string& arch, GgmlType type) {
  test::TinyModelSpec s;
  s.arch = arch;
  s.weight_type = type;
  s.n_embd = 256;
  s.n_head = 8;
  s.n_head_kv = 4;
  s.head_dim = 32;
  s.n_ff = 512;
  s.n_layer = 3;
  s.sliding_window = 6;
  s.untied_output = arch == "llama";
  return s;
}

struct Case {
  std::string arch;
  GgmlType type;
};
const Case kModelCases[] = {{"gemma3", GgmlType::Q8_0}, {"gemma3", GgmlType::Q4_K}, {"llama", GgmlType::Q6_K},
                            {"llama", GgmlType::Q4_1},  {"llama", GgmlType::Q5_0},  {"llama", GgmlType::BF16},
                            {"gemma3", GgmlType::F16},  {"qwen2", GgmlType::Q8_0}};

// A random EAGLE-3 head (Q8_0, as the trained ones; F32 where a test compares the device's draws
// with the CPU's) for device_spec's targets: it reads the inputs of layers 0 and 2 and the stream
// after the last layer.
struct TinyHeadFile {
  std::string path;
  explicit TinyHeadFile(GgmlType type = GgmlType::Q8_0) {
    path = (std::filesystem::temp_directory_path() /
            ("microspec_cuda_head_" + std::to_string(::getpid()) + "_" + type_name(uint32_t(type)) + ".gguf"))
               .string();
    test::TinyHeadSpec h;
    h.n_embd = 256;
    h.target_hidden = 256;
    h.target_layers = {0, 2, 3};
    h.n_head = 4;
    h.n_head_kv = 2;
    h.head_dim = 64;
    h.n_ff = 512;
    h.weight_type = type;
    test::write_tiny_head(h, path);
  }
  ~TinyHeadFile() { std::filesystem::remove(path); }
  std::unique_ptr<cuda::DeviceEagleHead> on_device(const TinyPair& m) const {
    return std::make_unique<cuda::DeviceEagleHead>(*GgufFile::open(path), m.cpu->config(), m.gpu->embedding_matrix(),
                                                   /*max_rows=*/64, /*n_ctx=*/256, /*max_prompt=*/256, m.gpu->stream());
  }
};

std::vector<int32_t> random_tokens(int n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Whole-model logits against the CPU. Float weights: only float sums differ. Quantized weights: a
// last-bit difference in front of an activation quantizer can move one int8 quant by a step
// (up to 1/127 of its block's largest value), which the next layers carry: measured up to 1.2e-2
// of the largest logit on these models. Greedy tokens are checked for equality separately.
float logit_tolerance(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16 ? 1e-3f : 3e-2f;
}

// The argmax of every row agrees (rows of n values), but where the CPU's best two lie within `tol`
// of the row's largest |logit| (a near tie, which either side may take): there the device's pick
// must be within `tol` of the CPU's best on the CPU's logits.
void expect_same_argmax(const std::vector<float>& got, const std::vector<float>& want, int32_t n, float tol,
                        const std::string& what) {
  for (size_t r = 0; r * n < want.size(); ++r) {
    const auto row = want.begin() + r * n;
    const auto g = std::max_element(got.begin() + r * n, got.begin() + (r + 1) * n) - (got.begin() + r * n);
    const auto w = std::max_element(row, row + n) - row;
    if (g == w) continue;
    float scale = 0.0f;
    for (auto it = row; it != row + n; ++it) scale = std::max(scale, std::fabs(*it));
    EXPECT_LT(row[w] - row[g], tol * scale) << what << " row " << r << ": device " << g << ", CPU " << w;
  }
}

// Logits of a tree batch on both: a prefix, then a tree whose rows are all output; then the
// accepted path is committed (KV compaction) and one more token run on both.
TEST(CudaModel, TreeForwardAndCompactionMatchCpu) {
  REQUIRE_GPU();
  for (const Case& c : kModelCases) {
    SCOPED_TRACE(c.arch + " " + type_name(uint32_t(c.type)));
    TinyPair m(device_spec(c.arch, c.type));
    const int32_t V = m.cpu->config().n_vocab;
    KVCache kv = m.cpu->make_cache(256);
    const std::vector<int32_t> prefix = random_tokens(13, V, 1);
    Batch b;
    ForwardOutput out;
    b.set_sequence(prefix, 0, true);
    m.cpu->forward(b, kv, out, {.logits = true});
    kv.commit_prefix(b.size());
    m.gpu->forward(cuda::HostBatch{b.tokens, b.positions, b.parents, b.output_rows, 0}, {.logits = true});
    m.gpu->commit_prefix(b.size());
    std::vector<float> got;
    m.gpu->logits_to_host(b.size(), got);
    const float tol = logit_tolerance(c.type);
    EXPECT_LT(rel_max_diff(got, out.logits), tol) << "prefix";
    expect_same_argmax(got, out.logits, V, tol, "prefix");

    // Tree: 0 <- {1, 2}, 1 <- {3}, 2 <- {4, 5}, 3 <- {6}.
    b.clear();
    b.tokens = random_tokens(7, V, 2);
    b.parents = {-1, 0, 0, 1, 2, 2, 3};
    const int32_t depth[] = {0, 1, 1, 2, 2, 2, 3};
    for (int32_t i = 0; i < 7; ++i) b.positions.push_back(13 + depth[i]), b.output_rows.push_back(i);
    m.cpu->forward(b, kv, out, {.logits = true});
    m.gpu->forward(cuda::HostBatch{b.tokens, b.positions, b.parents, b.output_rows, 0}, {.logits = true});
    m.gpu->logits_to_host(7, got);
    EXPECT_LT(rel_max_diff(got, out.logits), tol) << "tree";
    expect_same_argmax(got, out.logits, V, tol, "tree");

    const std::vector<int32_t> path = {0, 1, 3, 6};
    kv.commit(path);
    m.gpu->commit(path);
    ASSERT_EQ(m.gpu->n_past(), kv.n_past());
    const std::vector<int32_t> next = {7};
    b.set_sequence(next, kv.n_past(), true);
    m.cpu->forward(b, kv, out, {.logits = true});
    m.gpu->forward(cuda::HostBatch{b.tokens, b.positions, b.parents, b.output_rows, 0}, {.logits = true});
    m.gpu->logits_to_host(1, got);
    EXPECT_LT(rel_max_diff(got, out.logits), tol) << "after compaction";
    expect_same_argmax(got, out.logits, V, tol, "after compaction");
  }
}

int32_t first_argmax(const float* x, int32_t n) {
  return int32_t(std::max_element(x, x + n) - x);
}

// The CPU's plain decoding of n_predict tokens after `prompt`: each step's logits row goes to
// `pick`, which returns the token (and may note how near it came to picking another).
std::vector<int32_t> cpu_decode(Model& cpu, const std::vector<int32_t>& prompt, int32_t n_predict,
                                const std::function<int32_t(const std::vector<float>& logits)>& pick) {
  KVCache kv = cpu.make_cache(256);
  Batch b;
  ForwardOutput out;
  b.set_sequence(prompt, 0, false);
  std::vector<int32_t> tokens;
  for (int32_t step = 0; step < n_predict; ++step) {
    cpu.forward(b, kv, out, {.logits = true});
    kv.commit_prefix(b.size());
    tokens.push_back(pick(out.logits));
    const std::vector<int32_t> t = {tokens.back()};
    b.set_sequence(t, kv.n_past(), false);
  }
  return tokens;
}

// The device's plain generation with `o` (graphs on, then off) against the CPU's tokens: the same
// until a step where the CPU's pick came within its tolerance of another (margin[i] < slack[i]);
// the comparison ends there. Returns the tokens of the run with graphs on.
std::vector<int32_t> expect_device_decode(cuda::CudaModel& gpu, const std::vector<int32_t>& prompt,
                                          cuda::PlainOptions o, const std::vector<int32_t>& want,
                                          const std::vector<double>& margin, const std::vector<double>& slack) {
  std::vector<int32_t> with_graphs;
  for (cuda::Graphs g : {cuda::Graphs::On, cuda::Graphs::Off}) {
    SCOPED_TRACE(g == cuda::Graphs::On ? "graphs on" : "graphs off");
    o.graphs = g;
    const std::vector<int32_t> got = gpu.generate_plain(prompt, o);
    EXPECT_EQ(got.size(), want.size());
    size_t k = 0;
    while (k < want.size() && k < got.size() && got[k] == want[k]) ++k;
    if (k < want.size() && k < got.size())
      EXPECT_LT(margin[k], slack[k]) << "token " << k << ": device " << got[k] << ", CPU " << want[k]
                                     << " with a margin of " << margin[k];
    if (g == cuda::Graphs::On) with_graphs = got;
  }
  return with_graphs;
}

// Greedy decoding on the device (graphs on and off) gives the CPU's tokens, token for token. The
// two differ in float summation order, so where the CPU's best two logits are closer than the
// numeric tolerance (a near tie, which quantized activations make possible: see logit_tolerance)
// either token is a correct greedy choice: there, and only there, the sequences may part, and
// the comparison ends at that step. Sampled decoding likewise draws what the CPU's sampled
// decoding draws with the same seed and settings (top-k 40, top-p 0.95, temperature 0.9), until a
// draw that lies within the logits' tolerance of an edge of the distribution; seeds give other
// texts wherever the CPU's do (on some cases it does not: top-p keeps one token at every step), and
// a greedy run after sampled ones is greedy again (the decode graph is captured per pick).
TEST(CudaModel, PlainTokensEqualCpu) {
  REQUIRE_GPU();
  int32_t cases_with_two_texts = 0;  // where the CPU's two seeds give two texts
  for (const Case& c : kModelCases) {
    SCOPED_TRACE(c.arch + " " + type_name(uint32_t(c.type)));
    TinyPair m(device_spec(c.arch, c.type));
    const int32_t V = m.cpu->config().n_vocab, n_predict = 48;
    const std::vector<int32_t> prompt = random_tokens(9, V, 3);
    std::vector<double> margin, slack;  // per step: (best - second best) / largest |logit|, its tolerance
    const std::vector<int32_t> want = cpu_decode(*m.cpu, prompt, n_predict, [&](const std::vector<float>& logits) {
      std::vector<float> sorted = logits;
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      margin.push_back((sorted[0] - sorted[1]) / max_abs(logits));
      slack.push_back(logit_tolerance(c.type));
      return first_argmax(logits.data(), V);
    });
    cuda::PlainOptions greedy;
    greedy.n_predict = n_predict;
    // The device's own tokens from here on (they may part from the CPU's at a near tie).
    const std::vector<int32_t> mine = expect_device_decode(*m.gpu, prompt, greedy, want, margin, slack);
    ASSERT_GE(mine.size(), 4u);
    // A stop id ends generation after it.
    cuda::PlainOptions o;
    o.n_predict = 6;
    o.stop_ids = {mine[2]};
    const std::vector<int32_t> stopped = m.gpu->generate_plain(prompt, o);
    const size_t first = size_t(std::find(mine.begin(), mine.end(), mine[2]) - mine.begin());
    EXPECT_EQ(stopped, std::vector<int32_t>(mine.begin(), mine.begin() + first + 1));
    // A token handler that ends the text with the fourth token.
    o.stop_ids.clear();
    int32_t seen = 0;
    EXPECT_EQ(m.gpu->generate_plain(prompt, o, [&](int32_t) { return ++seen < 4; }),
              std::vector<int32_t>(mine.begin(), mine.begin() + 4));
    EXPECT_EQ(seen, 4);

    // Sampled.
    const std::vector<int32_t> greedy_before = m.gpu->generate_plain(prompt, greedy);
    std::vector<std::vector<int32_t>> texts, cpu_texts;
    for (uint64_t seed : {1u, 2u}) {
      SCOPED_TRACE("seed " + std::to_string(seed));
      const SamplingParams p{.temperature = 0.9f, .top_k = 40, .top_p = 0.95f, .seed = seed};
      Sampler sampler(p, V), listed(p, V);
      std::mt19937_64 rng(seed);  // the sampler's bits, one per token
      std::vector<double> draw_edge, draw_slack;  // per step: the draw's distance to an edge, what the logits allow
      std::vector<std::pair<int32_t, float>> dist;
      const std::vector<int32_t> drawn = cpu_decode(*m.cpu, prompt, n_predict, [&](const std::vector<float>& logits) {
        listed.distribution(logits.data(), dist);
        draw_edge.push_back(draw_margin(dist, rng()));
        // A logit moved by d moves each probability by about p * d / T: the cumulative sums by
        // at most 2 d / T.
        draw_slack.push_back(2.0 * logit_tolerance(c.type) * max_abs(logits) / p.temperature);
        return sampler.sample(logits.data());
      });
      cuda::PlainOptions sampled;
      sampled.n_predict = n_predict;
      sampled.sampling = p;
      texts.push_back(expect_device_decode(*m.gpu, prompt, sampled, drawn, draw_edge, draw_slack));
      cpu_texts.push_back(drawn);
    }
    // Some tiny models put all of top-p's mass on one token at every step: one text whatever the seed.
    if (cpu_texts[0] != cpu_texts[1]) {
      EXPECT_NE(texts[0], texts[1]) << "two seeds, one text (the CPU's differ)";
      ++cases_with_two_texts;
    }
    EXPECT_EQ(m.gpu->generate_plain(prompt, greedy), greedy_before) << "greedy after sampling";
    cuda::PlainOptions bad;
    bad.sampling = SamplingParams{.temperature = 0.5f, .top_k = 65};
    EXPECT_THROW(m.gpu->generate_plain(prompt, bad), Error);
    bad.sampling.top_k = 0;
    EXPECT_THROW(m.gpu->generate_plain(prompt, bad), Error);
  }
  EXPECT_GT(cases_with_two_texts, 0) << "no model case tells the seeds apart";
}

// Speculative decoding on the device (chains and trees from the self-draft, a draft model and an
// EAGLE-3 head) gives exactly the device's plain greedy tokens: every kernel is batch invariant, so this is bitwise.
// The step is device-resident; each variant runs replayed as a CUDA graph and launched kernel by
// kernel, with host checks every step or every 4 steps. Variants: the full
// vocabulary's draft head (chains of 1 and 4; and every layer drafting, so every chain must be
// accepted whole) and MicroSpec's, in the stream's variants: prompt + steps, steps only (its first
// chain drafts from an empty vocabulary), K_ver at the last accepted position only with a window
// smaller than the prompt and the gather in line, prompt only; and a separate draft model (the
// target's weights drawn again in another format: it agrees often, not always, so chains are cut
// and fully accepted; its cache stays one token behind the target's), with both vocabularies.
// Trees: the self-draft's, the head's and a draft model's, with both vocabularies.
// Then, on one model, with the self-drafter and a draft model (chains and trees): a stop token, and
// a prompt that leaves too little context for whole chains, both equal to plain greedy decoding.
TEST(CudaModel, SpeculativeChainEqualsPlainGreedy) {
  REQUIRE_GPU();
  using Source = CandidateStreamParams::Source;
  using Rows = CandidateStreamParams::KverRows;
  // The target's first layers, a draft model or an EAGLE-3 head, drafting a chain or an EAGLE-2
  // tree (speculative/tree_state.h, CudaModel::enqueue_tree_step, whose CPU side is
  // tests/test_spec_tree_state.cpp).
  enum class Drafter { Self, Model, Head };
  struct Variant {
    const char* name;
    int32_t depth;  // the chain's (unused with a tree)
    std::optional<PrunedVocabSpec> vocab;
    Drafter drafter;
    int32_t draft_layers = 2;        // of 3 (the self-draft's)
    std::optional<TreeShape> tree{};  // a tree of this shape instead of a chain
  };
  auto dynamic = [](int32_t w_max, Source source, Rows rows, bool async) {
    std::optional<PrunedVocabSpec> p = test::window_spec(w_max, source, rows);
    p->window.async_gather = async;
    return p;
  };
  // ids 7, 14, 21, ...: a fixed set (freq), or pinned beside a window (hybrid).
  auto fixed = [](int32_t n) { return test::with_every_7th(PrunedVocabSpec{}, n, PrunedVocabSpec::Kind::Fixed); };
  auto hybrid = [&](int32_t w_max, int32_t n_pinned) {
    return test::with_every_7th(dynamic(w_max, Source::Both, Rows::Accepted, true), n_pinned,
                                PrunedVocabSpec::Kind::Window);
  };
  const Variant variants[] = {
      {"full, depth 1", 1, std::nullopt, Drafter::Self},
      {"full, depth 4", 4, std::nullopt, Drafter::Self},
      {"full, depth 3, every layer drafts", 3, std::nullopt, Drafter::Self, 3},
      {"dynamic W 64", 4, dynamic(64, Source::Both, Rows::Accepted, true), Drafter::Self},
      {"dynamic ext W 64", 4, dynamic(64, Source::Ext, Rows::Accepted, true), Drafter::Self},
      {"dynamic W 5, K_ver last row, in line", 4, dynamic(5, Source::Both, Rows::Last, false), Drafter::Self},
      {"dynamic ctx W 3072", 4, dynamic(3072, Source::Ctx, Rows::Accepted, true), Drafter::Self},
      {"freq: 40 fixed ids", 4, fixed(40), Drafter::Self},
      {"hybrid W 16 + 24 pinned", 4, hybrid(16, 24), Drafter::Self},
      {"draft model, full, depth 3", 3, std::nullopt, Drafter::Model},
      {"draft model, dynamic W 64", 4, dynamic(64, Source::Both, Rows::Accepted, true), Drafter::Model},
      {"EAGLE-3 head, full, depth 1", 1, std::nullopt, Drafter::Head},
      {"EAGLE-3 head, full, depth 4", 4, std::nullopt, Drafter::Head},
      {"EAGLE-3 head, dynamic W 64", 4, dynamic(64, Source::Both, Rows::Accepted, true), Drafter::Head},
      {"EAGLE-3 head, freq: 40 fixed ids", 3, fixed(40), Drafter::Head},
      {"tree k 2 depth 3, 6 nodes, full", 0, std::nullopt, Drafter::Self, 2, TreeShape{2, 3, 6}},
      {"tree k 4 depth 1, every candidate, full", 0, std::nullopt, Drafter::Self, 2, TreeShape{4, 1, 20}},
      {"tree k 1 depth 3, every layer drafts, full", 0, std::nullopt, Drafter::Self, 3, TreeShape{1, 3, 4}},
      {"tree k 3 depth 2, every layer drafts, full", 0, std::nullopt, Drafter::Self, 3, TreeShape{3, 2, 8}},
      {"tree k 3 depth 2, dynamic W 64", 0, dynamic(64, Source::Both, Rows::Accepted, true), Drafter::Self, 2, TreeShape{3, 2, 8}},
      {"tree k 2 depth 2, dynamic ext W 64", 0, dynamic(64, Source::Ext, Rows::Accepted, true), Drafter::Self, 2, TreeShape{2, 2, 5}},
      {"tree k 2 depth 3, dynamic W 5, K_ver last row, in line", 0, dynamic(5, Source::Both, Rows::Last, false),
       Drafter::Self, 2, TreeShape{2, 3, 6}},
      {"tree k 2 depth 3, freq: 40 fixed ids", 0, fixed(40), Drafter::Self, 2, TreeShape{2, 3, 6}},
      {"tree k 2 depth 3, hybrid W 16 + 24 pinned", 0, hybrid(16, 24), Drafter::Self, 2, TreeShape{2, 3, 6}},
      {"EAGLE-3 head tree k 2 depth 3, 6 nodes, full", 0, std::nullopt, Drafter::Head, 2, TreeShape{2, 3, 6}},
      {"EAGLE-3 head tree k 3 depth 2, dynamic W 64", 0, dynamic(64, Source::Both, Rows::Accepted, true),
       Drafter::Head, 2, TreeShape{3, 2, 8}},
      {"EAGLE-3 head tree k 2 depth 2, dynamic ext W 64", 0, dynamic(64, Source::Ext, Rows::Accepted, true),
       Drafter::Head, 2, TreeShape{2, 2, 5}},
      {"draft model tree k 2 depth 3, 6 nodes, full", 0, std::nullopt, Drafter::Model, 2, TreeShape{2, 3, 6}},
      {"draft model tree k 3 depth 2, dynamic W 64", 0, dynamic(64, Source::Both, Rows::Accepted, true),
       Drafter::Model, 2, TreeShape{3, 2, 8}},
      {"draft model tree k 1 depth 3, freq: 40 fixed ids", 0, fixed(40), Drafter::Model, 2, TreeShape{1, 3, 4}}};
  const TinyHeadFile head_file;
  struct Launch {
    cuda::Graphs graphs;
    int32_t sync_every;
    const char* name;
  };
  const Launch launches[] = {{cuda::Graphs::On, 4, "graph, sync every 4"}, {cuda::Graphs::Off, 1, "kernels, sync every step"}};
  for (const Case& c : kModelCases) {
    SCOPED_TRACE(c.arch + " " + type_name(uint32_t(c.type)));
    TinyPair m(device_spec(c.arch, c.type));
    TinyPair draft(device_spec(c.arch, c.type == GgmlType::Q8_0 ? GgmlType::Q4_1 : GgmlType::Q8_0));
    const std::unique_ptr<cuda::DeviceEagleHead> head = head_file.on_device(m);
    const std::vector<int32_t> prompt = random_tokens(7, m.cpu->config().n_vocab, 5);
    cuda::PlainOptions g;
    g.n_predict = 40;
    const std::vector<int32_t> plain = m.gpu->generate_plain(prompt, g);
    int32_t draft_model_accepted = 0, tree_accepted = 0;
    for (const Variant& v : variants) {
      std::optional<cuda::SpecChainStats> first_launch;
      for (const Launch& l : launches) {
        SCOPED_TRACE(std::string(v.name) + ", " + l.name);
        cuda::SpecChainOptions o;
        o.n_predict = 40;
        o.draft_layers = v.draft_layers;
        o.depth = v.depth;
        o.vocab = v.vocab;
        o.graphs = l.graphs;
        o.sync_every = l.sync_every;
        if (v.drafter == Drafter::Model) o.draft_model = draft.gpu.get();
        if (v.drafter == Drafter::Head) o.draft_head = head.get();
        o.tree = v.tree;
        cuda::SpecChainStats st;
        EXPECT_EQ(m.gpu->generate_speculative(prompt, o, &st), plain);
        EXPECT_GT(st.steps, 0);
        EXPECT_LE(st.steps, 40);
        // The target drafting for itself: a chain accepted whole, and in a tree at least its own
        // first token.
        const int32_t chain = v.tree ? (v.tree->top_k == 1 ? v.tree->depth + 1 : 0) : v.depth;
        if (v.draft_layers == 3 && chain > 0) EXPECT_EQ(st.accepted_drafts, chain * st.steps) << "the target's own chain";
        if (v.draft_layers == 3) EXPECT_GE(st.accepted_drafts, st.steps) << "the target's own token";
        if (v.drafter == Drafter::Model) draft_model_accepted += st.accepted_drafts;
        if (v.drafter == Drafter::Self && v.tree && v.draft_layers == 2) tree_accepted += st.accepted_drafts;
        // The same counts whenever the host looks: the steps up to the one that emitted the 40th token.
        if (first_launch) {
          EXPECT_EQ(st.steps, first_launch->steps);
          EXPECT_EQ(st.accepted_drafts, first_launch->accepted_drafts);
        }
        first_launch = st;
      }
    }
    EXPECT_GT(draft_model_accepted, 0) << "the draft model never agreed: whole chains went untested";
    EXPECT_GT(tree_accepted, 0) << "no tree path of the partial drafter was ever accepted";
  }

  TinyPair m(device_spec("llama", GgmlType::Q8_0));
  TinyPair draft(device_spec("llama", GgmlType::Q4_1));
  const std::unique_ptr<cuda::DeviceEagleHead> head = head_file.on_device(m);
  const int32_t V = m.cpu->config().n_vocab;
  for (const Launch& l : launches)
    for (const std::optional<PrunedVocabSpec>& vocab : {std::optional<PrunedVocabSpec>(), dynamic(64, Source::Both, Rows::Accepted, true)})
    for (const Variant& d : {Variant{"self-draft, chain of 4", 4, std::nullopt, Drafter::Self},
                             Variant{"draft model, chain of 4", 4, std::nullopt, Drafter::Model},
                             Variant{"EAGLE-3 head, chain of 4", 4, std::nullopt, Drafter::Head},
                             Variant{"self-draft, tree k 3 depth 3, 10 nodes", 4, std::nullopt, Drafter::Self, 2,
                                     TreeShape{3, 3, 10}},
                             Variant{"draft model, tree k 3 depth 3, 10 nodes", 4, std::nullopt, Drafter::Model, 2,
                                     TreeShape{3, 3, 10}}}) {
      SCOPED_TRACE(std::string(l.name) + (vocab ? ", dynamic, " : ", full, ") + d.name);
      cuda::SpecChainOptions o;
      o.draft_layers = d.draft_layers;
      o.depth = d.depth;
      o.vocab = vocab;
      o.graphs = l.graphs;
      o.sync_every = l.sync_every;
      if (d.drafter == Drafter::Model) o.draft_model = draft.gpu.get();
      if (d.drafter == Drafter::Head) o.draft_head = head.get();
      o.tree = d.tree;
      // A stop token: the output ends with its first occurrence.
      const std::vector<int32_t> prompt = random_tokens(7, V, 9);
      cuda::PlainOptions g;
      g.n_predict = 40;
      const std::vector<int32_t> plain = m.gpu->generate_plain(prompt, g);
      o.n_predict = 40;
      o.stop_ids = {plain[17]};
      const size_t first = size_t(std::find(plain.begin(), plain.end(), plain[17]) - plain.begin());
      cuda::SpecChainStats stopped, limited;
      EXPECT_EQ(m.gpu->generate_speculative(prompt, o, &stopped),
                std::vector<int32_t>(plain.begin(), plain.begin() + first + 1));
      // Counted as a run that wanted that many tokens counts: up to the step that emitted the last.
      o.stop_ids.clear();
      o.n_predict = int32_t(first) + 1;
      EXPECT_EQ(m.gpu->generate_speculative(prompt, o, &limited),
                std::vector<int32_t>(plain.begin(), plain.begin() + first + 1));
      EXPECT_EQ(stopped.steps, limited.steps);
      EXPECT_EQ(stopped.accepted_drafts, limited.accepted_drafts);
      // A text the host ends (a stop string, say), which the device knows nothing of: the same.
      o.n_predict = 40;
      cuda::SpecChainStats cut;
      int32_t seen = 0;
      const std::vector<int32_t> cut_text =
          m.gpu->generate_speculative(prompt, o, &cut, [&](int32_t) { return ++seen <= int32_t(first); });
      EXPECT_EQ(cut_text, std::vector<int32_t>(plain.begin(), plain.begin() + first + 1));
      EXPECT_EQ(seen, int32_t(first) + 1) << "no token after the one that ended the text";
      EXPECT_EQ(cut.steps, limited.steps);
      EXPECT_EQ(cut.accepted_drafts, limited.accepted_drafts);
      // Any number of stop tokens (the host looks for them).
      o.stop_ids.assign(40, plain[17]);
      EXPECT_EQ(m.gpu->generate_speculative(prompt, o, nullptr),
                std::vector<int32_t>(plain.begin(), plain.begin() + first + 1));
      o.stop_ids.clear();
      // The context's end (256 slots): 230 prompt tokens leave room for 27 tokens; the last chains
      // do not fit, and plain decode steps finish.
      const std::vector<int32_t> long_prompt = random_tokens(230, V, 10);
      g.n_predict = 100;
      const std::vector<int32_t> plain_end = m.gpu->generate_plain(long_prompt, g);
      ASSERT_EQ(plain_end.size(), 256u - 230u + 1u);
      o.n_predict = 100;
      EXPECT_EQ(m.gpu->generate_speculative(long_prompt, o, nullptr), plain_end);
    }
}

// Speculative sampling on the device (a chain: speculative/chain_sampling.h). On float-weight
// models (F32: the device's logits are the CPU's up to float summation order, so a draw lands on
// the other side of an edge of its distribution about once in a million) the device emits the
// host-driven resident step's tokens (run_resident_sampled, which tests/test_spec_chain_sampling.cpp
// proves equal to the CPU Decoder's for a seed) for the self-draft with the full vocabulary (a
// chain of 4; a chain of 3 cut from a tree of depth 4, whose draft draws past the chain are
// skipped), with MicroSpec's (prompt and steps; steps only, whose first chain is placeholders), for
// a draft model and for an EAGLE-3 head (F32 too), and on trees drafted by the self-draft, the F32
// head and a draft model (the host-driven tree step, run_tree, which tests/test_spec_tree_state.cpp proves equal to the CPU Decoder's: the same
// draws without replacement, kept nodes and recursive rejection sampling), graphs on and off,
// with the same counts. On
// every model case the target drafting for itself (every layer) has every draft accepted (q == p
// bit for bit: batch invariance), two seeds give two texts wherever the host-driven step's do,
// greedy decoding after sampling is greedy again, and the Q8_0 head's sampled chain runs to the end with in-range tokens.
TEST(CudaModel, SpeculativeSamplingFollowsTheCpuDecoder) {
  REQUIRE_GPU();
  using Source = CandidateStreamParams::Source;
  using Rows = CandidateStreamParams::KverRows;
  enum class Drafter { Self, Model, Head };
  struct Variant {
    const char* name;
    TreeParams tree;  // the CPU decoder's chain: top-k 1
    int32_t draft_layers;
    std::optional<PrunedVocabSpec> vocab;
    Drafter drafter = Drafter::Self;
  };
  const Variant variants[] = {
      {"full, chain of 4", {3, 1, 4, 0}, 2, std::nullopt},
      {"full, chain of 3 from a tree of depth 4", {4, 1, 3, 0}, 2, std::nullopt},
      {"dynamic W 64", {3, 1, 4, 0}, 2, test::window_spec(64, Source::Both, Rows::Accepted)},
      {"dynamic ext W 64", {3, 1, 4, 0}, 2, test::window_spec(64, Source::Ext, Rows::Accepted)},
      {"draft model, full", {3, 1, 4, 0}, 0, std::nullopt, Drafter::Model},
      {"EAGLE-3 head, full, chain of 3 from a tree of depth 4", {4, 1, 3, 0}, 0, std::nullopt, Drafter::Head},
      {"EAGLE-3 head, dynamic W 64", {3, 1, 4, 0}, 0, test::window_spec(64, Source::Both, Rows::Accepted), Drafter::Head}};
  struct Launch {
    cuda::Graphs graphs;
    int32_t sync_every;
    const char* name;
  };
  const Launch launches[] = {{cuda::Graphs::On, 4, "graph, sync every 4"}, {cuda::Graphs::Off, 1, "kernels, sync every step"}};
  const SamplingParams sp{.temperature = 0.9f, .top_k = 20, .top_p = 0.95f, .seed = 4};
  const int32_t n_predict = 40;
  const TinyHeadFile head_file, f32_head_file(GgmlType::F32);
  for (const char* arch : {"llama", "gemma3"}) {
    TinyPair m(device_spec(arch, GgmlType::F32));
    TinyPair draft(device_spec(arch, GgmlType::F16));
    const std::unique_ptr<cuda::DeviceEagleHead> f32_head = f32_head_file.on_device(m);
    const std::vector<int32_t> prompt = random_tokens(7, m.cpu->config().n_vocab, 5);
    for (const Variant& v : variants) {
      int32_t accepted = 0;
      const std::vector<int32_t> want = test::run_resident_sampled(
          *m.cpu, prompt, n_predict, v.tree, v.draft_layers, v.vocab, v.drafter == Drafter::Model ? draft.cpu.get() : nullptr,
          v.drafter == Drafter::Head ? f32_head_file.path : std::string(), sp, &accepted);
      for (const Launch& l : launches) {
        SCOPED_TRACE(std::string(arch) + ", " + v.name + ", " + l.name);
        cuda::SpecChainOptions o;
        o.n_predict = n_predict;
        o.depth = std::min(v.tree.depth + 1, v.tree.total_tokens);
        o.draft_draws = v.tree.depth + 1;
        o.draft_layers = v.draft_layers > 0 ? v.draft_layers : 1;
        o.vocab = v.vocab;
        o.draft_model = v.drafter == Drafter::Model ? draft.gpu.get() : nullptr;
        o.draft_head = v.drafter == Drafter::Head ? f32_head.get() : nullptr;
        o.sampling = sp;
        o.graphs = l.graphs;
        o.sync_every = l.sync_every;
        cuda::SpecChainStats st;
        EXPECT_EQ(m.gpu->generate_speculative(prompt, o, &st), want);
        EXPECT_EQ(st.accepted_drafts, accepted);
      }
    }
    // Trees drafted by 2 of 3 layers, the F32 head or the F16 draft model, the full head and
    // MicroSpec's window.
    struct TreeCase {
      const char* name;
      TreeParams params;
      std::optional<PrunedVocabSpec> vocab;
      Drafter drafter;
    };
    for (const TreeCase& tc : {
             TreeCase{"tree k 2 depth 3, 6 nodes, full", {.depth = 3, .top_k = 2, .total_tokens = 6}, std::nullopt,
                      Drafter::Self},
             TreeCase{"tree k 3 depth 2, 8 nodes, dynamic W 64", {.depth = 2, .top_k = 3, .total_tokens = 8},
                      test::window_spec(64, Source::Both, Rows::Accepted), Drafter::Self},
             TreeCase{"EAGLE-3 head tree k 2 depth 3, 6 nodes, dynamic W 64", {.depth = 3, .top_k = 2, .total_tokens = 6},
                      test::window_spec(64, Source::Both, Rows::Accepted), Drafter::Head},
             TreeCase{"draft model tree k 2 depth 3, 6 nodes, full", {.depth = 3, .top_k = 2, .total_tokens = 6},
                      std::nullopt, Drafter::Model}}) {
      const bool by_head = tc.drafter == Drafter::Head, by_model = tc.drafter == Drafter::Model;
      const test::TreeRun want = test::run_tree(*m.cpu, prompt, n_predict, tc.params, 2, tc.vocab, sp,
                                                by_head ? f32_head_file.path : std::string(),
                                                by_model ? draft.cpu.get() : nullptr);
      for (const Launch& l : launches) {
        SCOPED_TRACE(std::string(arch) + ", " + tc.name + ", " + l.name);
        cuda::SpecChainOptions o;
        o.n_predict = n_predict;
        o.tree = tc.params.fixed_shape();
        o.draft_layers = 2;
        o.draft_head = by_head ? f32_head.get() : nullptr;
        o.draft_model = by_model ? draft.gpu.get() : nullptr;
        o.vocab = tc.vocab;
        o.sampling = sp;
        o.graphs = l.graphs;
        o.sync_every = l.sync_every;
        cuda::SpecChainStats st;
        EXPECT_EQ(m.gpu->generate_speculative(prompt, o, &st), want.emitted);
        EXPECT_EQ(st.steps, want.steps);
        EXPECT_EQ(st.accepted_drafts, want.accepted);
      }
    }
  }
  int32_t cases_with_two_texts = 0;  // where the host-driven step's two seeds give two texts
  for (const Case& c : kModelCases) {
    SCOPED_TRACE(c.arch + " " + type_name(uint32_t(c.type)));
    TinyPair m(device_spec(c.arch, c.type));
    const std::vector<int32_t> prompt = random_tokens(7, m.cpu->config().n_vocab, 6);
    cuda::PlainOptions g;
    g.n_predict = n_predict;
    const std::vector<int32_t> plain = m.gpu->generate_plain(prompt, g);
    for (const std::optional<PrunedVocabSpec>& vocab :
         {std::optional<PrunedVocabSpec>(), test::window_spec(64, Source::Both, Rows::Accepted)}) {
      SCOPED_TRACE(vocab ? "dynamic W 64" : "full");
      std::vector<std::vector<int32_t>> texts, host_texts;
      for (uint64_t seed : {1u, 2u}) {
        cuda::SpecChainOptions o;
        o.n_predict = n_predict;
        o.depth = 4;
        o.draft_layers = 3;  // every layer: the drafts' q is the verification's p
        o.vocab = vocab;
        o.sampling = SamplingParams{.temperature = 1.1f, .top_k = 40, .top_p = 1.0f, .seed = seed};
        int32_t host_accepted = 0;
        host_texts.push_back(test::run_resident_sampled(*m.cpu, prompt, n_predict, TreeParams{3, 1, 4, 0}, 3, vocab,
                                                        nullptr, "", o.sampling, &host_accepted));
        cuda::SpecChainStats st;
        texts.push_back(m.gpu->generate_speculative(prompt, o, &st));
        EXPECT_EQ(texts.back().size(), size_t(n_predict));
        // A draft vocabulary's row holds fewer tokens than the full head's, so q differs from p there.
        if (!vocab) EXPECT_EQ(st.accepted_drafts, 4 * st.steps) << "seed " << seed << ": q == p, every draft accepted";
        EXPECT_GT(st.accepted_drafts, 0) << "seed " << seed;
      }
      // Some tiny models put nearly all the mass on one token at every step: one text whatever the
      // seed (the host-driven step on the CPU tells).
      if (host_texts[0] != host_texts[1]) {
        EXPECT_NE(texts[0], texts[1]) << "two seeds, one text (the host-driven step's differ)";
        ++cases_with_two_texts;
      }
      cuda::SpecChainOptions greedy;
      greedy.n_predict = n_predict;
      greedy.vocab = vocab;
      EXPECT_EQ(m.gpu->generate_speculative(prompt, greedy), plain) << "greedy after sampling";
    }
    // The Q8_0 head drafts sampled chains on every target (its catch-up reads the accepted drafts
    // and the drawn token that chain_sample_accept leaves in pred): a full text of in-range tokens.
    const std::unique_ptr<cuda::DeviceEagleHead> head = head_file.on_device(m);
    cuda::SpecChainOptions with_head;
    with_head.n_predict = n_predict;
    with_head.depth = 3;
    with_head.draft_head = head.get();
    with_head.sampling = SamplingParams{.temperature = 0.8f, .top_k = 16, .seed = 3};
    cuda::SpecChainStats head_stats;
    const std::vector<int32_t> head_text = m.gpu->generate_speculative(prompt, with_head, &head_stats);
    EXPECT_EQ(head_text.size(), size_t(n_predict));
    for (int32_t t : head_text) EXPECT_TRUE(t >= 0 && t < m.cpu->config().n_vocab) << t;
    EXPECT_GT(head_stats.steps, 0);
    cuda::SpecChainOptions tree;
    tree.tree = TreeShape{8, 8, 4};
    tree.sampling = SamplingParams{.temperature = 1.0f, .top_k = 8, .seed = 1};
    EXPECT_THROW(m.gpu->generate_speculative(prompt, tree), Error) << "a sampled tree of 520 draft draws a step";
  }
  EXPECT_GT(cases_with_two_texts, 0) << "no model case tells the seeds apart";
}

// Greedy decoding of the CPU's tokens on a real file (SmolLM2: Q4_1 and Q8_0 weights), compared as
// on the tiny models: equal up to the first CPU near tie. The file is part of the setup here; a GPU
// machine has it only where a session staged it (it is larger than one device call carries), so
// there its absence skips the test by name.
TEST(CudaModel, RealModelGreedyEqualsCpu) {
  REQUIRE_GPU();
  const std::string path = test::smollm_path();
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is not on this GPU machine";
  auto file = GgufFile::open(path);
  auto tok = Tokenizer::from_gguf(*file);
  ModelOptions opt;
  opt.n_threads = 4;
  auto cpu = Model::load(*file, opt);
  cuda::CudaModelOptions gopt;
  gopt.n_ctx = 512;
  auto gpu = cuda::CudaModel::load(*file, gopt);
  auto draft = cuda::CudaModel::load(*file, gopt);
  const int32_t V = cpu->config().n_vocab, n_predict = 64;
  for (const char* text : {"The history of the printing press", "def fibonacci(n):", "Rain falls on the"}) {
    SCOPED_TRACE(text);
    const std::vector<int32_t> prompt = tok->encode(text, tok->add_bos_default(), false);
    KVCache kv = cpu->make_cache(512);
    Batch b;
    ForwardOutput out;
    b.set_sequence(prompt, 0, false);
    std::vector<int32_t> want;
    std::vector<float> margin;
    for (int32_t step = 0; step < n_predict; ++step) {
      cpu->forward(b, kv, out, {.logits = true});
      kv.commit_prefix(b.size());
      want.push_back(first_argmax(out.logits.data(), V));
      std::vector<float> sorted = out.logits;
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      margin.push_back((sorted[0] - sorted[1]) / max_abs(out.logits));
      const std::vector<int32_t> t = {want.back()};
      b.set_sequence(t, kv.n_past(), false);
    }
    cuda::PlainOptions o;
    o.n_predict = n_predict;
    const std::vector<int32_t> got = gpu->generate_plain(prompt, o);
    ASSERT_EQ(got.size(), want.size());
    cuda::SpecChainOptions so;
    so.n_predict = n_predict;
    so.draft_layers = 24;  // of 30
    so.depth = 4;
    cuda::SpecChainStats st;
    EXPECT_EQ(gpu->generate_speculative(prompt, so, &st), got) << "speculative vs plain on the device";
    std::printf("[ real model ] speculative (self-draft 24 of 30 layers, chain of 4): %d steps, mean acceptance length %.2f\n",
                st.steps, st.mean_acceptance_length());
    so.vocab = PrunedVocabSpec{};  // MicroSpec's defaults: W_max 3072, K_pre 3, K_ver 3
    EXPECT_EQ(gpu->generate_speculative(prompt, so, &st), got) << "speculative, dynamic vocabulary, vs plain";
    std::printf("[ real model ] the same with the dynamic vocabulary: %d steps, mean acceptance length %.2f\n", st.steps,
                st.mean_acceptance_length());
    so.graphs = cuda::Graphs::Off;
    so.sync_every = 1;
    EXPECT_EQ(gpu->generate_speculative(prompt, so, &st), got) << "speculative, dynamic vocabulary, no graph, vs plain";
    so.graphs = cuda::Graphs::On;
    so.sync_every = 4;
    // The file as its own draft model: every chain is accepted whole (the drafter's cache is one
    // token behind, and each chain starts by running that token again with the new one).
    // (Full vocabulary: every kernel is batch invariant, so its drafts are the target's tokens.)
    so.draft_model = draft.get();
    so.vocab.reset();
    EXPECT_EQ(gpu->generate_speculative(prompt, so, &st), got) << "speculative, draft model, vs plain";
    EXPECT_EQ(st.accepted_drafts, 4 * st.steps) << "a model drafting for itself accepts whole chains";
    std::printf("[ real model ] the same with the file as its own draft model: %d steps, mean acceptance length %.2f\n",
                st.steps, st.mean_acceptance_length());
    so.draft_model = nullptr;
    size_t k = 0;
    while (k < want.size() && got[k] == want[k]) ++k;
    std::printf("[ real model ] \"%s\": %zu of %zu greedy tokens equal%s\n", text, k, want.size(),
                k < want.size() ? (" (then a CPU near tie, margin " + std::to_string(margin[k]) + ")").c_str() : "");
    if (k < want.size())
      EXPECT_LT(margin[k], logit_tolerance(GgmlType::Q4_1))
          << "token " << k << ": device " << got[k] << ", CPU " << want[k] << " with a margin of " << margin[k];
  }
}

// Rows gathered into the packed head on the copy stream give the full head's logits of those rows.
// The device's EAGLE-3 head against the CPU's: a catch-up of five rows fused from the target's
// features, then a draft row in the next pending slot fed the last row's output (its parent).
TEST(CudaModel, DraftHeadForwardMatchesCpu) {
  REQUIRE_GPU();
  TinyPair m(device_spec("llama", GgmlType::Q8_0));
  const TinyHeadFile head_file;
  Eagle3Head cpu(GgufFile::open(head_file.path), *m.cpu, 16);
  const std::unique_ptr<cuda::DeviceEagleHead> gpu = head_file.on_device(m);
  const int32_t H = cpu.config().n_embd, F = cpu.config().n_features(), n = 5;
  const std::vector<float> features = normal_floats(size_t(n) * F, 31);
  const std::vector<int32_t> tokens = random_tokens(n + 1, m.cpu->config().n_vocab, 32);
  std::vector<int32_t> positions = {0, 1, 2, 3, 4, 5}, parents = {-1, 0, 1, 2, 3, 4};

  // CPU: the catch-up rows, then the draft row at pending slot 5.
  KVCache kv = cpu.make_cache(256);
  Batch b;
  b.tokens.assign(tokens.begin(), tokens.begin() + n);
  b.positions.assign(positions.begin(), positions.begin() + n);
  b.parents.assign(parents.begin(), parents.begin() + n);
  std::vector<float> g(size_t(n) * H), prenorm(g.size()), normed(g.size());
  cpu.fuse(features.data(), n, g.data());
  cpu.forward(b, g.data(), kv, prenorm.data(), normed.data());
  const std::vector<float> want_pre = prenorm, want_normed = normed;
  Batch b2;
  b2.tokens = {tokens[n]};
  b2.positions = {positions[n]};
  b2.parents = {parents[n]};
  b2.start = n;
  std::vector<float> g2(prenorm.begin() + size_t(n - 1) * H, prenorm.begin() + size_t(n) * H), pre2(H), normed2(H);
  cpu.forward(b2, g2.data(), kv, pre2.data(), normed2.data());

  // Device: the same two forwards.
  DeviceBuffer<float> dfeatures(features);
  DeviceBuffer<int32_t> dtokens(tokens), dpositions(positions), dparents(parents);
  DeviceBuffer<float> got_pre(size_t(n) * H), got_normed(size_t(n) * H), dg2(g2), got_pre2(H), got_normed2(H);
  cudaStream_t s = m.gpu->stream();
  gpu->enqueue_forward(cuda::DeviceBatch{dtokens.ptr, dpositions.ptr, dparents.ptr, n, 0}, dfeatures.ptr, nullptr, s);
  MS_CUDA(cudaMemcpyAsync(got_pre.ptr, gpu->prenorm(), got_pre.n * sizeof(float), cudaMemcpyDeviceToDevice, s));
  MS_CUDA(cudaMemcpyAsync(got_normed.ptr, gpu->normed(), got_normed.n * sizeof(float), cudaMemcpyDeviceToDevice, s));
  gpu->enqueue_forward(cuda::DeviceBatch{dtokens.ptr + n, dpositions.ptr + n, dparents.ptr + n, 1, n}, nullptr, dg2.ptr, s);
  MS_CUDA(cudaMemcpyAsync(got_pre2.ptr, gpu->prenorm(), H * sizeof(float), cudaMemcpyDeviceToDevice, s));
  MS_CUDA(cudaMemcpyAsync(got_normed2.ptr, gpu->normed(), H * sizeof(float), cudaMemcpyDeviceToDevice, s));
  const float tol = 1e-3f;  // whole-layer outputs, as for the models' logits
  EXPECT_LT(rel_max_diff(got_pre.to_host(), want_pre), tol) << worst(got_pre.to_host(), want_pre);
  EXPECT_LT(rel_max_diff(got_normed.to_host(), want_normed), tol) << worst(got_normed.to_host(), want_normed);
  EXPECT_LT(rel_max_diff(got_pre2.to_host(), pre2), tol) << worst(got_pre2.to_host(), pre2);
  EXPECT_LT(rel_max_diff(got_normed2.to_host(), normed2), tol) << worst(got_normed2.to_host(), normed2);

  // What the device cannot run is refused by name: an own LM head.
  test::TinyHeadSpec own;
  own.n_embd = own.target_hidden = 256;
  own.target_layers = {0, 2, 3};
  own.own_lm_rows = m.cpu->config().n_vocab;
  const std::string own_path = head_file.path + ".own.gguf";
  test::write_tiny_head(own, own_path);
  const std::string e = test::error_of([&] {
    cuda::DeviceEagleHead(*GgufFile::open(own_path), m.cpu->config(), m.gpu->embedding_matrix(), 8, 256, 64,
                          m.gpu->stream());
  });
  std::filesystem::remove(own_path);
  EXPECT_NE(e.find("own LM head"), std::string::npos) << e;
}

TEST(CudaModel, PackedHeadGatherMatchesCpuRows) {
  REQUIRE_GPU();
  TinyPair m(device_spec("llama", GgmlType::Q6_K));
  const ModelConfig& cfg = m.cpu->config();
  const int32_t n = 3;
  const std::vector<float> hidden = normal_floats(size_t(n) * cfg.n_embd, 9);
  std::vector<int32_t> rows = {300, 2, 17, 99, 250, 1};
  std::vector<float> want(size_t(n) * rows.size());
  m.cpu->lm_head_rows(hidden.data(), n, rows.data(), int32_t(rows.size()), want.data());

  cuda::DevicePackedHead head(m.gpu->output_matrix(), 8, m.gpu->stream());
  // Two rounds of entries, the second overwriting a slot: the state after both is what counts.
  const std::vector<int32_t> first_ids = {300, 2, 5, 99}, first_slots = {0, 1, 2, 3};
  head.enter(first_ids, first_slots);
  const std::vector<int32_t> second_ids = {17, 250, 1}, second_slots = {2, 4, 5};
  head.enter(second_ids, second_slots);
  DeviceBuffer<float> dh(hidden);
  DeviceBuffer<float> logits(want.size());
  DeviceBuffer<uint8_t> scratch(cuda::matmul_scratch_bytes(n, cfg.n_embd));
  head.logits(dh.ptr, n, int32_t(rows.size()), logits.ptr, int64_t(rows.size()), scratch.ptr);
  MS_CUDA(cudaStreamSynchronize(m.gpu->stream()));
  EXPECT_LT(rel_max_diff(logits.to_host(), want), kMatmulTol);
}

// MicroSpec's vocabulary on the device against the CPU's CandidateStream + PackedHead, fed the
// same prompt, prompt candidates, tree tokens and verification logits: the same active set, the
// same token in every packed slot (the device runs the CPU's algorithm in one thread), packed rows
// whose logits are the full head's rows of those tokens, and an argmax over the active slots only.
// A window of 24 entries churns, so slots are freed, reused and compacted; the gather runs on the
// copy stream and in line. Also with pinned ids beside the window (hybrid), and the pinned ids
// alone (Fixed: freq), whose CPU reference is a stream with those pins that is never stepped.
TEST(CudaModel, DynamicVocabularyStateEqualsCpu) {
  REQUIRE_GPU();
  TinyPair m(device_spec("llama", GgmlType::Q6_K));
  const ModelConfig& cfg = m.cpu->config();
  const int32_t V = cfg.n_vocab, n_prompt = 30, k_pre = 2, n_hidden = 3;
  const std::vector<int32_t> prompt = random_tokens(n_prompt, V, 3);
  std::vector<int32_t> prompt_top = random_tokens(n_prompt * k_pre, V, 4);
  prompt_top[5] = -1;  // a position with fewer candidates: skipped by both
  const std::vector<float> hidden = normal_floats(size_t(n_hidden) * cfg.n_embd, 6);
  DeviceBuffer<float> d_hidden(hidden);
  DeviceBuffer<uint8_t> scratch(cuda::matmul_scratch_bytes(n_hidden, cfg.n_embd));
  DeviceBuffer<int32_t> d_best(n_hidden);
  using Source = CandidateStreamParams::Source;
  using Kind = PrunedVocabSpec::Kind;
  struct Variant {
    const char* name;
    Source source;
    bool async;
    int32_t n_pinned;
    Kind kind;
  };
  const Variant variants[] = {{"both, copy stream", Source::Both, true, 0, Kind::Window},
                              {"both, in line", Source::Both, false, 0, Kind::Window},
                              {"ext, copy stream", Source::Ext, true, 0, Kind::Window},
                              {"ext, in line", Source::Ext, false, 0, Kind::Window},
                              {"hybrid: both + 9 pinned", Source::Both, true, 9, Kind::Window},
                              {"fixed: 12 ids", Source::Both, true, 12, Kind::Fixed}};
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const Source source = v.source;
    const bool fixed = v.kind == Kind::Fixed;
    PrunedVocabSpec spec;
    spec.kind = v.kind;
    for (int32_t i = 0; i < v.n_pinned; ++i) spec.pinned.push_back(3 + 11 * i);
    DynamicVocabParams& p = spec.window;
    p.stream.w_max = 24;
    p.stream.k_pre = k_pre;
    p.stream.k_ver = 3;
    p.stream.source = source;
    p.async_gather = v.async;
    cuda::DeviceDraftVocab dev(m.gpu->output_matrix(), spec, {.max_prompt = n_prompt, .max_rows = n_hidden},
                               m.gpu->stream());
    cuda::upload(dev.prompt_ids(), prompt.data(), prompt.size() * 4);
    if (dev.prompt_top_k() > 0)
      cuda::upload(dev.prompt_top(), prompt_top.data(), prompt_top.size() * 4);
    CandidateStream cpu(V, fixed ? CandidateStreamParams{.w_max = 1} : p.stream, spec.pinned);
    PackedHead cpu_head(m.cpu->output_matrix(), cpu.window().capacity(), false);
    if (!fixed) ASSERT_EQ(dev.capacity(), cpu_head.capacity());  // a fixed one has no window entry
    std::vector<int32_t> entered, left;
    auto check = [&](const std::string& when) {
      cpu.window().take_changes(entered, left);
      cpu_head.update(left, entered);
      const cuda::DeviceDraftVocab::Snapshot snap = dev.snapshot();
      ASSERT_EQ(snap.active, cpu.window().active_size()) << when;
      ASSERT_EQ(int32_t(snap.token_of_slot.size()), cpu_head.size()) << when;
      for (int32_t j = 0; j < cpu_head.size(); ++j) ASSERT_EQ(snap.token_of_slot[j], cpu_head.token(j)) << when << " slot " << j;
      const int32_t n = cpu_head.size();
      const float* d_logits = dev.logits(d_hidden.ptr, n_hidden, scratch.ptr);
      dev.argmax(n_hidden, /*if_empty=*/-1, d_best.ptr);
      std::vector<float> got(size_t(n_hidden) * dev.capacity());
      MS_CUDA(cudaStreamSynchronize(m.gpu->stream()));
      MS_CUDA(cudaMemcpy(got.data(), d_logits, got.size() * 4, cudaMemcpyDeviceToHost));
      const std::vector<int32_t> best = d_best.to_host();
      if (n == 0) {
        for (int32_t b : best) EXPECT_EQ(b, -1) << when;
        return;
      }
      std::vector<float> want(size_t(n_hidden) * n), active(size_t(n_hidden) * n);
      m.cpu->lm_head_rows(hidden.data(), n_hidden, snap.token_of_slot.data(), n, want.data());
      for (int32_t t = 0; t < n_hidden; ++t) {
        std::copy_n(got.begin() + size_t(t) * dev.capacity(), n, active.begin() + size_t(t) * n);
        EXPECT_EQ(best[t], snap.token_of_slot[first_argmax(active.data() + size_t(t) * n, n)]) << when << " row " << t;
      }
      EXPECT_LT(rel_max_diff(active, want), kMatmulTol) << when;
    };
    dev.begin(n_prompt);
    if (fixed)
      cpu.begin({}, {}, 0);
    else
      cpu.begin(prompt, source == Source::Ext ? std::vector<int32_t>{} : prompt_top,
                source == Source::Ext ? 0 : k_pre);
    check("begin");
    for (int32_t step = 0; step < 40; ++step) {
      const std::vector<int32_t> tree = random_tokens(1 + step % 6, V, 100 + step);
      // Verification rows [first, first + count) of n_rows, as a chain's acceptance picks them.
      const int32_t n_rows = 1 + step % 4, first = step % 3 == 0 ? 0 : (step * 7) % n_rows;
      const int32_t count = step % 3 == 0 ? n_rows : 1;
      const std::vector<float> verify = normal_floats(size_t(n_rows) * V, 200 + step);
      std::vector<int32_t> rows;
      for (int32_t r = first; r < first + count; ++r) rows.push_back(r);
      DeviceBuffer<int32_t> d_tree(tree);
      DeviceBuffer<float> d_verify(verify);
      dev.step(d_tree.ptr, d_verify.ptr, VocabUpdate{.n_tree = int32_t(tree.size()), .first_row = first, .n_rows = count});
      if (!fixed) cpu.step(tree, verify.data(), rows);  // the fixed set never changes
      check("step " + std::to_string(step));
      MS_CUDA(cudaStreamSynchronize(m.gpu->stream()));  // d_tree and d_verify go out of scope
    }
  }
}

TEST(CudaModel, BadInputIsAnError) {
  REQUIRE_GPU();
  TinyPair m(device_spec("llama", GgmlType::Q8_0));
  const std::vector<int32_t> toks = {1, 100000}, pos = {0, 1}, par = {-1, 0}, outr = {1};
  EXPECT_THROW(m.gpu->forward(cuda::HostBatch{toks, pos, par, outr, 0}, {.logits = true}), Error);
  const std::vector<int32_t> ok = {1, 2}, bad_parent = {-1, 1};
  EXPECT_THROW(m.gpu->forward(cuda::HostBatch{ok, pos, bad_parent, outr, 0}, {.logits = true}), Error);
  const std::vector<int32_t> long_prompt(300, 5);
  EXPECT_THROW(m.gpu->generate_plain(long_prompt, cuda::PlainOptions{}), Error);
  // Draft trees the device has no fixed shape or room for, refused before anything runs.
  cuda::SpecChainOptions tree;
  tree.tree = TreeShape{2, 2, 0};
  EXPECT_THROW(m.gpu->generate_speculative(ok, tree, nullptr), Error);
  tree.tree = TreeShape{8, 8, 64};  // 65 verification rows: over the batch of 64
  EXPECT_THROW(m.gpu->generate_speculative(ok, tree, nullptr), Error);
  tree.tree = TreeShape{2, 65, 4};  // deeper than any TreeParams
  EXPECT_THROW(m.gpu->generate_speculative(ok, tree, nullptr), Error);
  cuda::SpecChainOptions tree_from_itself = tree;  // a draft model that is the target itself
  tree_from_itself.tree = TreeShape{2, 2, 4};
  tree_from_itself.draft_model = m.gpu.get();
  EXPECT_THROW(m.gpu->generate_speculative(ok, tree_from_itself, nullptr), Error);
  // A generation capacity whose random bits the device could not index, refused at load.
  cuda::CudaModelOptions huge;
  huge.max_generate = 1 << 23;
  const std::string e = test::error_of([&] { cuda::CudaModel::load(*m.file, huge); });
  EXPECT_NE(e.find("generation capacity 8388608 outside 0.."), std::string::npos) << e;
}

}  // namespace
}  // namespace microspec
