#include "cuda/cuda_model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/draft_vocab.h"
#include "cuda/weights.h"
#include "gguf/gguf.h"
#include "kernels/types.h"
#include "util/error.h"

namespace microspec::cuda {

// Output rows of several matrices side by side: part i writes columns [offset_i, offset_i + rows_i)
// of y. Consecutive weights of one type are uploaded into one allocation and run as one matrix.
struct CudaModel::Projection {
  std::vector<DeviceMatrix> parts;
};

struct CudaModel::Layer {
  const float* attn_norm = nullptr;       // [n_embd]
  Projection qkv;                         // rows: [q_dim | kv_dim | kv_dim][n_embd]
  const float* qkv_bias = nullptr;        // [q_dim + 2 kv_dim] (Qwen2), else null
  const float* q_norm = nullptr;          // [head_dim] (Gemma 3), else null
  const float* k_norm = nullptr;          // [head_dim] (Gemma 3), else null
  DeviceMatrix wo;                        // [n_embd rows][q_dim]
  const float* post_attn_norm = nullptr;  // [n_embd] (Gemma 3), else null
  const float* ffn_norm = nullptr;        // [n_embd]
  Projection gate_up;                     // rows: [n_ff | n_ff][n_embd]
  DeviceMatrix w_down;                    // [n_embd rows][n_ff]
  const float* post_ffw_norm = nullptr;   // [n_embd] (Gemma 3), else null
};

// The arrays of speculative/tree_state.h's TreeState that are the tree's own (the verification
// batch, the argmax, the keep list and the counters are the model's buffers).
struct CudaModel::DeviceTree {
  TreeShape shape;
  DeviceAllocations memory;
  int32_t* draft_tokens = nullptr;     // [top_k] the next draft forward's rows
  int32_t* draft_positions = nullptr;  // [top_k]
  int32_t* draft_parents = nullptr;    // [top_k]
  int32_t* draft_out_rows = nullptr;   // [top_k] 0, 1, ...: every draft row's output
  int32_t* prop_token = nullptr;       // [top_k][top_k]
  float* prop_logprob = nullptr;       // [top_k][top_k]
  int32_t* cand_token = nullptr;       // [candidates]
  int32_t* cand_parent = nullptr;      // [candidates]
  int32_t* cand_depth = nullptr;       // [candidates]
  float* cand_score = nullptr;         // [candidates]
  int32_t* cand_slot = nullptr;        // [candidates]
  int32_t* cand_node = nullptr;        // [candidates]
  int32_t* frontier = nullptr;         // [top_k]
  int32_t* n_nodes = nullptr;          // [1]
  int32_t* row_slot = nullptr;         // [1 + total]
  int32_t* n_keep = nullptr;           // [1]
  // An EAGLE-3 head's (tree_state.h's TreeHeadBatch and what passes between its rows), when
  // head_features > 0.
  int32_t head_features = 0;               // F: its features per row
  int32_t* catch_tokens = nullptr;         // [max_emitted]
  int32_t* catch_rows = nullptr;           // [max_emitted]
  int32_t* catch_positions = nullptr;      // [max_emitted]
  int32_t* catch_parents = nullptr;        // [max_emitted]
  int32_t* head_draft_positions = nullptr; // [top_k]
  int32_t* root_row = nullptr;             // [1]
  float* catch_features = nullptr;         // [max_emitted][F] the catch-up's rows of the last verification's features
  float* slot_prenorm = nullptr;           // [draft_slots][H] each draft slot's pre-norm output
  float* head_g = nullptr;                 // [top_k][H] a level's hidden inputs: its parents' outputs
  // A separate draft model's (tree_state.h's TreeDraftModel; its first forward's arrays are the
  // draft model's own batch buffers, as a chain's; kv_compact moves its cache's n_past).
  int32_t* dm_parents = nullptr;           // [top_k]
  int32_t* dm_keep = nullptr;              // [max_emitted]

  // head_features, n_embd: an EAGLE-3 head's F and H (0, 0: the self-draft's tree).
  DeviceTree(const TreeShape& s, int32_t head_features_, int32_t n_embd, cudaStream_t stream)
      : shape(s), head_features(head_features_) {
    auto ints = [&](int32_t n) { return static_cast<int32_t*>(memory.alloc(size_t(n) * sizeof(int32_t))); };
    auto floats = [&](int32_t n) { return static_cast<float*>(memory.alloc(size_t(n) * sizeof(float))); };
    const int32_t k = s.top_k, n_cand = s.candidates();
    draft_tokens = ints(k);
    draft_positions = ints(k);
    draft_parents = ints(k);
    draft_out_rows = ints(k);
    prop_token = ints(k * k);
    prop_logprob = floats(k * k);
    cand_token = ints(n_cand);
    cand_parent = ints(n_cand);
    cand_depth = ints(n_cand);
    cand_score = floats(n_cand);
    cand_slot = ints(n_cand);
    cand_node = ints(n_cand);
    frontier = ints(k);
    n_nodes = ints(1);
    row_slot = ints(s.verify_rows());
    n_keep = ints(1);
    dm_parents = ints(k);
    dm_keep = ints(s.max_emitted());
    if (head_features > 0) {
      const int32_t e = s.max_emitted();
      catch_tokens = ints(e);
      catch_rows = ints(e);
      catch_positions = ints(e);
      catch_parents = ints(e);
      head_draft_positions = ints(k);
      root_row = ints(1);
      catch_features = floats(e * head_features);
      slot_prenorm = floats(s.draft_slots() * n_embd);
      head_g = floats(k * n_embd);
    }
    std::vector<int32_t> iota(static_cast<size_t>(k));
    for (int32_t i = 0; i < k; ++i) iota[size_t(i)] = i;
    MS_CUDA(cudaMemcpyAsync(draft_out_rows, iota.data(), iota.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    MS_CUDA(cudaStreamSynchronize(stream));
  }
};


CudaModel::CudaModel(const ModelConfig& config, const CudaModelOptions& options)
    : config_(config), options_(options) {
  if (!device_available()) throw Error("--device cuda: no CUDA device is available");
  if (options_.n_batch < 1) throw Error("batch size must be >= 1");
  if (options_.n_ctx < 1) throw Error("context size must be >= 1");
  // The random bits sampling may use: one per generated token and batch row, and the draft's
  // kMaxDraftDrawsPerStep per step, indexed in int32.
  if (options_.max_generate < 0 ||
      (int64_t(options_.max_generate) + 1) * std::max(options_.n_batch, kMaxDraftDrawsPerStep) > INT32_MAX)
    throw Error("generation capacity " + std::to_string(options_.max_generate) + " outside 0.." +
                std::to_string(INT32_MAX / std::max(options_.n_batch, kMaxDraftDrawsPerStep) - 1) + " for a batch of " +
                std::to_string(options_.n_batch));
  if (options_.n_ctx > attention_max_ctx())
    throw Error("context size " + std::to_string(options_.n_ctx) + " exceeds the CUDA backend's " +
                std::to_string(attention_max_ctx()));
  attention_prepare(options_.n_ctx);
  try {
    MS_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MS_CUDA(cudaEventCreate(&ev_start_));
    MS_CUDA(cudaEventCreate(&ev_stop_));
    MS_CUDA(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming));
    MS_CUDA(cudaEventCreateWithFlags(&ev_join_, cudaEventDisableTiming));
  } catch (...) {
    destroy_stream_and_events();  // no destructor runs for a constructor that throws
    throw;
  }
  layers_.resize(config_.n_layer);
}

CudaModel::~CudaModel() {
  draft_vocab_.reset();  // it runs on stream_ and reads output_
  if (stream_) cudaStreamSynchronize(stream_);
  if (decode_graph_) cudaGraphExecDestroy(decode_graph_);
  if (chain_graph_) cudaGraphExecDestroy(chain_graph_);
  for (void* p : allocations_) cudaFree(p);
  destroy_stream_and_events();
}

void CudaModel::destroy_stream_and_events() {
  for (cudaEvent_t* e : {&ev_start_, &ev_stop_, &ev_fork_, &ev_join_}) {
    if (*e) cudaEventDestroy(*e);
    *e = nullptr;
  }
  if (stream_) cudaStreamDestroy(stream_);
  stream_ = nullptr;
}

void* CudaModel::alloc(size_t bytes) {
  void* p = nullptr;
  MS_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  allocations_.push_back(p);
  return p;
}

std::unique_ptr<CudaModel> CudaModel::load(const GgufFile& f, const CudaModelOptions& options) {
  ModelConfig c = read_model_config(f);
  // The CUDA path implements gemma3, llama and qwen2 without RoPE scaling, partial rotary or soft-capping.
  const bool cuda_arch = c.arch == Arch::Gemma3 || c.arch == Arch::Llama || c.arch == Arch::Qwen2;
  if (!cuda_arch || c.n_rot != c.head_dim || c.rope_freq_scale != 1.0f || c.rope_attn_factor != 1.0f ||
      c.final_softcap != 0.0f || f.find_tensor("rope_freqs.weight"))
    throw Error(f.name() + ": the CUDA path runs gemma3, llama and qwen2 files without RoPE scaling or "
                "soft-capping; run this " + c.arch_name + " file on the CPU");
  // Its windowed attention was written for Gemma 3 and has never run on a GPU: a llama file with
  // Mistral's window (llama.attention.sliding_window) is refused rather than run untested.
  if (c.arch != Arch::Gemma3 && c.sliding_window > 0)
    throw Error(f.name() + ": " + c.arch_name + ".attention.sliding_window = " + std::to_string(c.sliding_window) +
                ": the CUDA path does not apply a sliding window to " + c.arch_name + " files; run it on the CPU");
  std::unique_ptr<CudaModel> m(new CudaModel(c, options));
  const int32_t d = c.n_embd;

  WeightUploader up(f, [&](size_t bytes) { return m->alloc(bytes); });
  auto matrix = [&](const std::string& name, int64_t cols, int64_t rows) { return up.matrix(name, cols, rows); };
  auto projection = [&](const std::vector<std::string>& names, const std::vector<int64_t>& rows, int64_t cols) {
    return Projection{up.stacked(names, rows, cols)};
  };
  auto vector = [&](const std::string& name, int64_t n) { return up.vector(name, n); };

  m->token_embd_ = matrix("token_embd.weight", d, c.n_vocab);
  m->output_ = f.find_tensor("output.weight") ? matrix("output.weight", d, c.n_vocab) : m->token_embd_;
  m->output_norm_ = vector("output_norm.weight", d);
  const bool gemma = c.arch == Arch::Gemma3, qwen = c.arch == Arch::Qwen2;
  for (int32_t il = 0; il < c.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    Layer& L = m->layers_[il];
    L.attn_norm = vector(p + "attn_norm.weight", d);
    L.qkv = projection({p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"},
                       {c.q_dim(), c.kv_dim(), c.kv_dim()}, d);
    if (qwen) {
      std::vector<float> bias;
      for (const char* part : {"attn_q.bias", "attn_k.bias", "attn_v.bias"}) {
        const GgufTensor* t = f.find_tensor(p + part);
        const int64_t n = std::string(part) == "attn_q.bias" ? c.q_dim() : c.kv_dim();
        if (!t || t->type != GgmlType::F32 || t->ne.size() != 1 || t->ne[0] != n)
          throw Error(f.name() + ": tensor '" + p + part + "' must be F32 [" + std::to_string(n) + "]");
        const float* b = reinterpret_cast<const float*>(t->data);
        bias.insert(bias.end(), b, b + n);
      }
      float* dst = static_cast<float*>(m->alloc(bias.size() * sizeof(float)));
      upload(dst, bias.data(), bias.size() * sizeof(float));
      L.qkv_bias = dst;
    }
    if (gemma) {
      L.q_norm = vector(p + "attn_q_norm.weight", c.head_dim);
      L.k_norm = vector(p + "attn_k_norm.weight", c.head_dim);
      L.post_attn_norm = vector(p + "post_attention_norm.weight", d);
      L.post_ffw_norm = vector(p + "post_ffw_norm.weight", d);
    }
    L.wo = matrix(p + "attn_output.weight", c.q_dim(), d);
    L.ffn_norm = vector(p + "ffn_norm.weight", d);
    L.gate_up = projection({p + "ffn_gate.weight", p + "ffn_up.weight"}, {c.n_ff, c.n_ff}, d);
    L.w_down = matrix(p + "ffn_down.weight", c.n_ff, d);
  }
  m->weight_bytes_ = up.bytes();
  m->allocate_buffers();
  return m;
}

std::unique_ptr<CudaModel> CudaModel::random(const ModelConfig& config, GgmlType type, uint64_t seed,
                                             const CudaModelOptions& options) {
  if (config.arch != Arch::Llama) throw Error("CudaModel::random makes llama-architecture models only");
  std::unique_ptr<CudaModel> m(new CudaModel(config, options));
  const ModelConfig& c = m->config_;
  const int32_t d = c.n_embd;
  uint64_t stream_seed = seed;
  auto matrix = [&](int64_t cols, int64_t rows) {
    const size_t stride = row_bytes(type, cols);
    void* p = m->alloc(stride * rows);
    // Uniform with variance 1 / cols: unit-scale outputs for unit-scale inputs.
    fill_random(type, p, cols * rows, std::sqrt(3.0f / float(cols)), ++stream_seed, m->stream_);
    m->weight_bytes_ += stride * rows;
    return DeviceMatrix{type, static_cast<const uint8_t*>(p), rows, cols, stride};
  };
  auto norm = [&](int64_t n) {
    float* p = static_cast<float*>(m->alloc(n * sizeof(float)));
    fill_random_f32(p, n, 1.0f, 0.1f, ++stream_seed, m->stream_);
    return static_cast<const float*>(p);
  };
  m->token_embd_ = matrix(d, c.n_vocab);
  m->output_ = matrix(d, c.n_vocab);
  m->output_norm_ = norm(d);
  for (Layer& L : m->layers_) {
    L.attn_norm = norm(d);
    L.qkv.parts = {matrix(d, c.q_dim() + 2 * c.kv_dim())};
    L.wo = matrix(c.q_dim(), d);
    L.ffn_norm = norm(d);
    L.gate_up.parts = {matrix(d, 2 * int64_t(c.n_ff))};
    L.w_down = matrix(c.n_ff, d);
  }
  m->allocate_buffers();
  MS_CUDA(cudaStreamSynchronize(m->stream_));
  return m;
}

void CudaModel::allocate_buffers() {
  const ModelConfig& c = config_;
  const size_t B = options_.n_batch, d = c.n_embd;
  qkv_dim_ = c.q_dim() + 2 * c.kv_dim();
  auto floats = [&](size_t n) { return static_cast<float*>(alloc(n * sizeof(float))); };
  auto ints = [&](size_t n) { return static_cast<int32_t*>(alloc(n * sizeof(int32_t))); };
  x_ = floats(B * d);
  xn_ = floats(B * d);
  qkv_ = floats(B * qkv_dim_);
  attn_ = floats(B * c.q_dim());
  o_ = floats(B * d);
  gate_up_ = floats(B * 2 * c.n_ff);
  ffn_h_ = floats(B * c.n_ff);
  residual_ = floats(B * d);
  hidden_ = floats(B * d);
  logits_ = floats(B * c.n_vocab);
  top_values_ = floats(B * 64);
  const int64_t widest = std::max<int64_t>({c.n_embd, c.n_ff, c.q_dim()});
  act_scratch_ = static_cast<uint8_t*>(alloc(matmul_scratch_bytes(int64_t(B), widest)));
  d_tokens_ = ints(B);
  d_positions_ = ints(B);
  d_parents_ = ints(B);
  d_out_rows_ = ints(B);
  d_keep_ = ints(options_.n_ctx);
  d_n_keep_ = ints(1);
  d_out_ids_ = ints(options_.max_generate);
  d_counter_ = ints(1);
  d_sample_settings_ = static_cast<DrawSettings*>(alloc(sizeof(DrawSettings)));
  max_draw_bits_ = 1 + options_.max_generate * options_.n_batch;
  d_draw_bits_ = static_cast<uint64_t*>(alloc(sizeof(uint64_t) * size_t(max_draw_bits_)));
  d_top_ids_ = ints(64);
  max_draft_bits_ = options_.max_generate * kMaxDraftDrawsPerStep;
  d_draft_bits_ = static_cast<uint64_t*>(alloc(sizeof(uint64_t) * size_t(max_draft_bits_)));
  d_target_drawn_ = ints(1);
  d_draft_drawn_ = ints(1);
  d_draft_top_ids_ = ints(B * 64);
  d_draft_top_values_ = floats(B * 64);
  d_verify_top_ids_ = ints(B * 64);
  d_verify_top_values_ = floats(B * 64);
  d_argmax_scratch_ = static_cast<uint64_t*>(alloc(sizeof(uint64_t) * B));
  d_argmax_out_ = ints(B);
  d_update_ = static_cast<VocabUpdate*>(alloc(sizeof(VocabUpdate)));
  d_steps_ = ints(1);
  d_step_counts_ = ints(options_.max_generate);

  kv_.n_layer = c.n_layer;
  kv_.n_ctx = options_.n_ctx;
  kv_.kv_dim = c.kv_dim();
  const size_t kv_elems = size_t(c.n_layer) * options_.n_ctx * c.kv_dim();
  kv_.k = static_cast<uint16_t*>(alloc(kv_elems * sizeof(uint16_t)));
  kv_.v = static_cast<uint16_t*>(alloc(kv_elems * sizeof(uint16_t)));
  kv_.positions = ints(options_.n_ctx);
  kv_.parents = ints(options_.n_ctx);
  kv_.n_past = ints(1);
  MS_CUDA(cudaMemsetAsync(kv_.n_past, 0, sizeof(int32_t), stream_));
  MS_CUDA(cudaMemsetAsync(kv_.parents, 0xFF, sizeof(int32_t) * options_.n_ctx, stream_));
  MS_CUDA(cudaStreamSynchronize(stream_));
}

DeviceBatch CudaModel::device_batch(int32_t offset, int32_t n, int32_t start) const {
  return DeviceBatch{d_tokens_ + offset, d_positions_ + offset, d_parents_ + offset, n, start};
}

DecodeState CudaModel::decode_state() const {
  return DecodeState{d_tokens_, d_positions_, d_parents_, d_out_rows_, d_out_ids_, d_counter_};
}

void CudaModel::forward(const HostBatch& b, const ForwardOptions& options) {
  const int32_t n = static_cast<int32_t>(b.tokens.size());
  const int32_t n_out = static_cast<int32_t>(b.output_rows.size());
  if (n == 0) throw Error("forward: empty batch");
  if (n > options_.n_batch)
    throw Error("forward: batch of " + std::to_string(n) + " tokens exceeds n_batch " +
                std::to_string(options_.n_batch));
  if (b.positions.size() != size_t(n) || b.parents.size() != size_t(n))
    throw Error("forward: batch positions/parents do not match its tokens");
  if (b.start < 0 || n_past_ + b.start + n > options_.n_ctx)
    throw Error("context full: " + std::to_string(n_past_ + b.start + n) + " tokens needed, context size is " +
                std::to_string(options_.n_ctx));
  for (int32_t i = 0; i < n; ++i) {
    if (b.tokens[i] < 0 || b.tokens[i] >= config_.n_vocab)
      throw Error("forward: token id " + std::to_string(b.tokens[i]) + " is outside the vocabulary (0.." +
                  std::to_string(config_.n_vocab - 1) + ")");
    if (b.parents[i] < -1 || b.parents[i] >= b.start + i)
      throw Error("forward: parent of token " + std::to_string(i) + " is not written yet");
    if (b.positions[i] < 0) throw Error("forward: negative position");
  }
  for (int32_t r : b.output_rows)
    if (r < 0 || r >= n) throw Error("forward: output row out of range");
  if (options.capture && options.end_layer >= 0 && options.end_layer < config_.n_layer)
    throw Error("forward: features are captured from a forward of every layer");
  // Pageable sources: the runtime stages them before returning, so they may go out of scope.
  MS_CUDA(cudaMemcpyAsync(d_tokens_, b.tokens.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  MS_CUDA(cudaMemcpyAsync(d_positions_, b.positions.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  MS_CUDA(cudaMemcpyAsync(d_parents_, b.parents.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  if (n_out > 0)
    MS_CUDA(cudaMemcpyAsync(d_out_rows_, b.output_rows.data(), n_out * sizeof(int32_t), cudaMemcpyHostToDevice,
                            stream_));
  enqueue_forward(device_batch(0, n, b.start), d_out_rows_, n_out, options);
}

void CudaModel::project(const Projection& p, const float* x, int32_t n, float* y, int64_t ldy) {
  int64_t offset = 0;
  for (const DeviceMatrix& w : p.parts) {
    matmul(w, RowSelection{nullptr, w.rows}, x, config_.n_embd, n, y + offset, ldy, Store::Overwrite,
           act_scratch_, stream_);
    offset += w.rows;
  }
}

void CudaModel::enqueue_layer(const Layer& L, int32_t il, const DeviceBatch& batch) {
  const ModelConfig& c = config_;
  const int32_t d = c.n_embd, hd = c.head_dim, n = batch.n;
  const bool gemma = c.arch == Arch::Gemma3;
  float* q = qkv_;
  float* k = qkv_ + c.q_dim();

  // Attention block.
  rms_norm(x_, xn_, RowGroups{n, 1, d}, d, L.attn_norm, c.rms_eps, stream_);
  project(L.qkv, xn_, n, qkv_, qkv_dim_);
  if (L.qkv_bias) add_bias_rows(qkv_, qkv_dim_, n, L.qkv_bias, qkv_dim_, stream_);
  if (L.q_norm) rms_norm(q, q, RowGroups{n, c.n_head, qkv_dim_}, hd, L.q_norm, c.rms_eps, stream_);
  if (L.k_norm) rms_norm(k, k, RowGroups{n, c.n_head_kv, qkv_dim_}, hd, L.k_norm, c.rms_eps, stream_);
  const bool sliding = !c.layer_is_sliding.empty() && c.layer_is_sliding[il];
  const float base = sliding ? c.rope_base_local : c.rope_base;
  const float theta_scale = std::pow(base, -2.0f / c.n_rot);  // as the CPU computes it
  const bool neox = c.rope_style == RopeStyle::Neox;
  rope_and_store_kv(qkv_, qkv_dim_, kv_, il, batch, RopeShape{c.n_head, c.n_head_kv, hd, c.n_rot, neox, theta_scale},
                    stream_);
  const AttentionShape shape{c.n_head, c.n_head_kv, hd, c.attn_scale, sliding ? c.sliding_window : 0};
  attention(kv_, il, batch, q, qkv_dim_, shape, attn_, stream_);
  if (gemma) {
    matmul(L.wo, RowSelection{nullptr, d}, attn_, c.q_dim(), n, o_, d, Store::Overwrite, act_scratch_, stream_);
    rms_norm(o_, o_, RowGroups{n, 1, d}, d, L.post_attn_norm, c.rms_eps, stream_);
    add_inplace(x_, o_, int64_t(n) * d, stream_);
  } else {
    matmul(L.wo, RowSelection{nullptr, d}, attn_, c.q_dim(), n, x_, d, Store::Accumulate, act_scratch_, stream_);
  }

  // Feed-forward block.
  rms_norm(x_, xn_, RowGroups{n, 1, d}, d, L.ffn_norm, c.rms_eps, stream_);
  project(L.gate_up, xn_, n, gate_up_, 2 * int64_t(c.n_ff));
  gated_activation(gate_up_, gate_up_ + c.n_ff, 2 * int64_t(c.n_ff), n, c.n_ff,
                   gemma ? Activation::GeluTanh : Activation::Silu, ffn_h_, stream_);
  if (gemma) {
    matmul(L.w_down, RowSelection{nullptr, d}, ffn_h_, c.n_ff, n, o_, d, Store::Overwrite, act_scratch_, stream_);
    rms_norm(o_, o_, RowGroups{n, 1, d}, d, L.post_ffw_norm, c.rms_eps, stream_);
    add_inplace(x_, o_, int64_t(n) * d, stream_);
  } else {
    matmul(L.w_down, RowSelection{nullptr, d}, ffn_h_, c.n_ff, n, x_, d, Store::Accumulate, act_scratch_,
           stream_);
  }
}

void CudaModel::enqueue_forward(const DeviceBatch& batch, const int32_t* out_rows, int32_t n_out,
                                const ForwardOptions& options) {
  const ModelConfig& c = config_;
  const int32_t n_layers = options.end_layer < 0 || options.end_layer > c.n_layer ? c.n_layer : options.end_layer;
  set_slot_meta(kv_, batch, stream_);
  gather_rows_f32(token_embd_, batch.tokens, batch.n, c.embed_scale, x_, stream_);
  // The stream entering layer il (il == n_layer: leaving the last) into its features' column.
  auto capture_at = [&](int32_t il) {
    if (!options.capture) return;
    const std::vector<int32_t>& layers = options.capture->layers;
    const size_t row = size_t(c.n_embd) * sizeof(float);
    for (size_t j = 0; j < layers.size(); ++j)
      if (layers[j] == il)
        MS_CUDA(cudaMemcpy2DAsync(options.capture->rows + j * c.n_embd, layers.size() * row, x_, row, row, batch.n,
                                  cudaMemcpyDeviceToDevice, stream_));
  };
  for (int32_t il = 0; il < n_layers; ++il) {
    capture_at(il);
    enqueue_layer(layers_[il], il, batch);
  }
  capture_at(n_layers);
  select_rows(x_, c.n_embd, out_rows, n_out, residual_, stream_);
  rms_norm(residual_, hidden_, RowGroups{n_out, 1, c.n_embd}, c.n_embd, output_norm_, c.rms_eps, stream_);
  if (options.logits)
    matmul(output_, RowSelection{nullptr, c.n_vocab}, hidden_, c.n_embd, n_out, logits_, c.n_vocab,
           Store::Overwrite, act_scratch_, stream_);
}

void CudaModel::logits_to_host(int32_t n_rows, std::vector<float>& out) const {
  out.resize(size_t(n_rows) * config_.n_vocab);
  MS_CUDA(cudaMemcpyAsync(out.data(), logits_, out.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  MS_CUDA(cudaStreamSynchronize(stream_));
}

void CudaModel::commit_prefix(int32_t n) {
  if (n < 0 || n_past_ + n > options_.n_ctx) throw Error("commit_prefix: " + std::to_string(n) + " slots");
  kv_advance(kv_, n, stream_);
  n_past_ += n;
}

void CudaModel::commit(std::span<const int32_t> indices) {
  for (size_t j = 0; j < indices.size(); ++j)
    if (indices[j] < 0 || (j > 0 && indices[j] <= indices[j - 1]) || n_past_ + indices[j] >= options_.n_ctx)
      throw Error("commit: pending indices must be increasing and inside the context");
  const int32_t n = static_cast<int32_t>(indices.size());
  if (n == 0) return;
  MS_CUDA(cudaMemcpyAsync(d_keep_, indices.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  MS_CUDA(cudaMemcpyAsync(d_n_keep_, &n, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  kv_compact(kv_, d_keep_, d_n_keep_, stream_);
  n_past_ += n;
}

void CudaModel::truncate(int32_t n) {
  if (n < 0 || n > n_past_) throw Error("truncate: " + std::to_string(n) + " is not within the committed tokens");
  MS_CUDA(cudaMemcpyAsync(kv_.n_past, &n, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  MS_CUDA(cudaStreamSynchronize(stream_));  // &n is a stack value
  n_past_ = n;
}

void CudaModel::enqueue_decode_step(const TokenPick& pick) {
  enqueue_forward(device_batch(0, 1, 0), d_out_rows_, 1, {.logits = true});
  enqueue_pick(logits_, pick, d_counter_);  // the token's index among the generated ones picks its bits
  decode_advance(kv_, decode_state(), stream_);
}

void CudaModel::drop_decode_graph_unless(const TokenPick& pick) {
  if (decode_graph_ && !(decode_graph_pick_ == pick)) {
    cudaGraphExecDestroy(decode_graph_);
    decode_graph_ = nullptr;
  }
  decode_graph_pick_ = pick;
}

void CudaModel::enqueue_pick(const float* row, const TokenPick& pick, const int32_t* draw) {
  const int64_t V = config_.n_vocab;
  if (pick.sample_k == 0) {
    argmax_rows(row, 1, V, d_tokens_, d_argmax_scratch_, stream_);
    return;
  }
  top_k_rows(row, V, V, RowRange{}, pick.sample_k, d_top_ids_, top_values_, stream_);
  draw_top_k(d_top_ids_, top_values_, pick.sample_k, d_sample_settings_, d_draw_bits_, draw, d_tokens_, stream_);
}

TokenPick CudaModel::begin_sampling(const SamplingParams& sampling, int32_t n_bits) {
  // The CPU Sampler's rules: a temperature whose inverse overflows is greedy.
  const float t = sampling.temperature;
  if (!(t >= 0.0f) || std::isinf(t))
    throw Error("sampling: temperature must be a finite number >= 0, got " + std::to_string(t));
  if (sampling.greedy()) return {};
  if (!(sampling.top_p >= 0.0f)) throw Error("sampling: top_p must be >= 0 (1 = off), got " + std::to_string(sampling.top_p));
  if (sampling.top_k < 1 || sampling.top_k > 64 || sampling.top_k >= config_.n_vocab)
    throw Error("sampling on the device draws from the top-k tokens: top_k must be in 1..64 and below the vocabulary "
                "size " + std::to_string(config_.n_vocab) + ", got " + std::to_string(sampling.top_k));
  if (n_bits < 0 || n_bits > max_draw_bits_)
    throw Error("sampling: " + std::to_string(n_bits) + " random draws, room for " + std::to_string(max_draw_bits_));
  // The seed's mt19937_64 outputs in order: what the CPU's Sampler draws (plain decoding: one per
  // token).
  std::mt19937_64 rng(sampling.seed);
  std::vector<uint64_t> bits(static_cast<size_t>(n_bits));
  for (uint64_t& b : bits) b = rng();
  const DrawSettings settings{.temperature = t, .top_p = sampling.top_p};
  // Pageable host memory: each copy has read its source when it returns.
  MS_CUDA(cudaMemcpyAsync(d_sample_settings_, &settings, sizeof settings, cudaMemcpyHostToDevice, stream_));
  if (n_bits > 0)
    MS_CUDA(cudaMemcpyAsync(d_draw_bits_, bits.data(), bits.size() * sizeof(uint64_t), cudaMemcpyHostToDevice,
                            stream_));
  return TokenPick{.sample_k = sampling.top_k};
}

void CudaModel::begin_spec_sampling(const SamplingParams& sampling, int32_t steps, int32_t draws_per_step) {
  const int64_t n = int64_t(steps) * draws_per_step;
  if (steps < 0 || draws_per_step < 0 || draws_per_step > kMaxDraftDrawsPerStep || n > max_draft_bits_)
    throw Error("speculative sampling: " + std::to_string(steps) + " steps of " + std::to_string(draws_per_step) +
                " draft draws, room for " + std::to_string(max_draft_bits_) + " (at most " +
                std::to_string(kMaxDraftDrawsPerStep) + " a step)");
  // The draft sampler's seed is the CPU decoder's (engine/speculative_decoder.h).
  std::mt19937_64 rng(draft_sampler_seed(sampling.seed));
  std::vector<uint64_t> bits(static_cast<size_t>(n));
  for (uint64_t& b : bits) b = rng();
  const int32_t counters[2] = {1, 0};  // the target's draw 0 is the first token's
  // Pageable host memory: each copy has read its source when it returns.
  if (n > 0)
    MS_CUDA(cudaMemcpyAsync(d_draft_bits_, bits.data(), bits.size() * sizeof(uint64_t), cudaMemcpyHostToDevice,
                            stream_));
  MS_CUDA(cudaMemcpyAsync(d_target_drawn_, &counters[0], sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  MS_CUDA(cudaMemcpyAsync(d_draft_drawn_, &counters[1], sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
}

void CudaModel::continue_sampling_plainly(const SamplingParams& sampling, int32_t drawn, int32_t at, int32_t n_tokens) {
  if (drawn < 0 || at < 0 || n_tokens < 0 || int64_t(at) + n_tokens > max_draw_bits_)
    throw Error("sampling: " + std::to_string(n_tokens) + " random draws from index " + std::to_string(at) +
                ", room for " + std::to_string(max_draw_bits_));
  std::mt19937_64 rng(sampling.seed);
  rng.discard(static_cast<unsigned long long>(drawn));
  std::vector<uint64_t> bits(static_cast<size_t>(n_tokens));
  for (uint64_t& b : bits) b = rng();
  if (n_tokens > 0)
    MS_CUDA(cudaMemcpyAsync(d_draw_bits_ + at, bits.data(), bits.size() * sizeof(uint64_t), cudaMemcpyHostToDevice,
                            stream_));
}

cudaGraphExec_t CudaModel::capture(const std::function<void()>& enqueue) {
  cudaGraph_t graph = nullptr;
  MS_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (...) {
    cudaStreamEndCapture(stream_, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  MS_CUDA(cudaStreamEndCapture(stream_, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  MS_CUDA(e);
  return exec;
}

void CudaModel::run_steps(cudaGraphExec_t& graph, int32_t steps, Graphs graphs, const std::function<void()>& enqueue) {
  if (graphs == Graphs::On && !graph) graph = capture(enqueue);
  for (int32_t s = 0; s < steps; ++s) {
    if (graphs == Graphs::On)
      MS_CUDA(cudaGraphLaunch(graph, stream_));
    else
      enqueue();
  }
}

void CudaModel::prefill_for_decode(std::span<const int32_t> prompt) { prefill_for_decode(prompt, PromptCandidates{}); }

void CudaModel::prefill_for_decode(std::span<const int32_t> prompt, const PromptCandidates& candidates,
                                   const TokenPick& pick) {
  if (prompt.empty()) throw Error("generate: empty prompt");
  if (candidates.k < 0 || candidates.k > 64 || (candidates.k > 0 && !candidates.prompt_top))
    throw Error("prefill: prompt candidates k " + std::to_string(candidates.k) + " outside 0..64 or without a buffer");
  truncate(0);
  const int32_t n_prompt = static_cast<int32_t>(prompt.size());
  if (n_prompt >= options_.n_ctx)
    throw Error("context full: the prompt has " + std::to_string(n_prompt) + " tokens, context size is " +
                std::to_string(options_.n_ctx));
  const int32_t k = candidates.k;
  if (candidates.prompt_ids)
    MS_CUDA(cudaMemcpyAsync(candidates.prompt_ids, prompt.data(), prompt.size() * sizeof(int32_t),
                            cudaMemcpyHostToDevice, stream_));
  std::vector<int32_t> positions, parents, out_rows;
  for (int32_t p0 = 0; p0 < n_prompt; p0 += options_.n_batch) {
    const int32_t n = std::min(options_.n_batch, n_prompt - p0);
    positions.resize(n);
    parents.resize(n);
    for (int32_t i = 0; i < n; ++i) positions[i] = p0 + i, parents[i] = i - 1;
    const bool last = p0 + n == n_prompt;
    // Output rows: every position when its candidates are wanted, else the last one of the prompt.
    out_rows.clear();
    for (int32_t i = k > 0 ? 0 : n - 1; i < n && (k > 0 || last); ++i) out_rows.push_back(i);
    FeatureCapture chunk;  // the prompt features' rows of this chunk
    if (candidates.capture)
      chunk = FeatureCapture{candidates.capture->layers,
                             candidates.capture->rows + size_t(p0) * candidates.capture->layers.size() * config_.n_embd};
    forward(HostBatch{prompt.subspan(p0, n), positions, parents, out_rows, 0},
            {.logits = !out_rows.empty(), .capture = candidates.capture ? &chunk : nullptr});
    commit_prefix(n);
    if (k > 0)
      top_k_rows(logits_, config_.n_vocab, config_.n_vocab, RowRange{.max_rows = n}, k,
                 candidates.prompt_top + int64_t(p0) * k, top_values_, stream_);
    if (last) {
      const float* row = logits_ + int64_t(out_rows.size() - 1) * config_.n_vocab;
      enqueue_pick(row, pick, nullptr);  // the first generated token: draw 0
      decode_begin(kv_, decode_state(), stream_);
    }
    MS_CUDA(cudaStreamSynchronize(stream_));  // positions/parents/out_rows are reused for the next chunk
  }
}

bool CudaModel::fetch_emitted(int32_t produced, int32_t limit, const std::vector<int32_t>& stop_ids,
                              const TokenHandler& on_token, std::vector<int32_t>& ids) {
  const size_t old = ids.size();
  if (size_t(produced) > old) {
    ids.resize(size_t(produced));
    MS_CUDA(cudaMemcpyAsync(ids.data() + old, d_out_ids_ + old, (produced - old) * sizeof(int32_t),
                            cudaMemcpyDeviceToHost, stream_));
  }
  MS_CUDA(cudaStreamSynchronize(stream_));
  for (size_t i = old; i < ids.size(); ++i) {
    if (ids[i] < 0)
      throw Error("the model's logits were all NaN at generated token " + std::to_string(i) + ": no token to pick");
    const bool refused = on_token && !on_token(ids[i]);
    const bool stop = std::find(stop_ids.begin(), stop_ids.end(), ids[i]) != stop_ids.end();
    if (refused || stop || int32_t(i) + 1 >= limit) {
      ids.resize(i + 1);
      return true;
    }
  }
  return false;
}

void CudaModel::decode_until(int32_t limit, const std::vector<int32_t>& stop_ids, Graphs graphs, int32_t sync_every,
                             const TokenPick& pick, const TokenHandler& on_token, std::vector<int32_t>& ids) {
  drop_decode_graph_unless(pick);
  int32_t produced = int32_t(ids.size());
  while (produced < limit && n_past_ < options_.n_ctx) {
    const int32_t steps = std::min({std::max(sync_every, 1), limit - produced, options_.n_ctx - n_past_});
    run_steps(decode_graph_, steps, graphs, [&] { enqueue_decode_step(pick); });
    n_past_ += steps;
    produced += steps;
    if (fetch_emitted(produced, limit, stop_ids, on_token, ids)) return;
  }
}

std::vector<int32_t> CudaModel::generate_plain(std::span<const int32_t> prompt, const PlainOptions& o,
                                                const TokenHandler& on_token) {
  const int32_t limit = std::min(o.n_predict, options_.max_generate);
  const TokenPick pick = begin_sampling(o.sampling, std::max(limit, 0));
  prefill_for_decode(prompt, PromptCandidates{}, pick);
  std::vector<int32_t> ids;
  if (limit <= 0) return ids;
  if (fetch_emitted(1, limit, o.stop_ids, on_token, ids)) return ids;  // the prompt's pick, in out_ids[0]
  decode_until(limit, o.stop_ids, o.graphs, o.sync_every, pick, on_token, ids);
  return ids;
}

ChainState CudaModel::chain_state(const ChainStep& step) const {
  ChainState s;
  s.tokens = d_tokens_;
  s.positions = d_positions_;
  s.parents = d_parents_;
  s.output_rows = d_out_rows_;
  s.pred = d_argmax_out_;
  s.draft_rows = step.vocab ? step.vocab->device_rows() : nullptr;
  s.n_past = kv_.n_past;
  s.out_ids = d_out_ids_;
  s.counter = d_counter_;
  s.update = d_update_;
  s.steps = d_steps_;
  s.step_counts = d_step_counts_;
  if (step.draft_model) {
    const CudaModel& d = *step.draft_model;
    s.draft = DraftModelBatch{d.d_tokens_, d.d_positions_, d.d_parents_, d.d_out_rows_, d.kv_.n_past};
  }
  if (step.head) s.head = step.head->batch_arrays();
  s.depth = step.depth;
  s.kver_last_only = step.vocab && step.vocab->kver_last_only();
  return s;
}

ChainSampling CudaModel::chain_sampling(const ChainStep& step) const {
  return ChainSampling{d_sample_settings_, step.sample_k, d_draft_top_ids_, d_draft_top_values_, d_verify_top_ids_,
                       d_verify_top_values_, d_draft_bits_, d_draft_drawn_, step.draft_draws, d_draw_bits_,
                       d_target_drawn_};
}

void CudaModel::enqueue_draft_draw(const ChainStep& step, int32_t d, const float* full_logits, cudaStream_t stream) {
  const int32_t k = step.sample_k;
  int32_t* ids = d_draft_top_ids_ + int64_t(d) * k;
  float* values = d_draft_top_values_ + int64_t(d) * k;
  if (step.vocab)
    step.vocab->ranked(1, k, ids, values);
  else
    top_k_rows(full_logits, config_.n_vocab, config_.n_vocab, RowRange{}, k, ids, values, stream);
  chain_draw(chain_state(step), chain_sampling(step), d, stream);
}

TreeSampling CudaModel::tree_sampling(const ChainStep& step) const {
  return TreeSampling{d_sample_settings_, step.sample_k, d_draft_top_ids_, d_draft_top_values_, d_verify_top_ids_,
                      d_verify_top_values_, d_draft_bits_, d_draft_drawn_, d_draw_bits_, d_target_drawn_};
}

TreeState CudaModel::tree_state(const ChainStep& step) const {
  // The tree's own arrays, then the model's: the verification batch, the argmax, the keep list,
  // the cache's n_past, the emitted tokens and the counters (the fields in TreeState's order).
  const DeviceTree& t = *tree_;
  return TreeState{t.draft_tokens, t.draft_positions, t.draft_parents, t.prop_token, t.prop_logprob, t.cand_token,
                   t.cand_parent, t.cand_depth, t.cand_score, t.cand_slot, t.cand_node, t.frontier,
                   d_tokens_, d_positions_, d_parents_, d_out_rows_, t.n_nodes, t.row_slot, d_argmax_out_, d_keep_, t.n_keep,
                   kv_.n_past, d_out_ids_, d_counter_, d_update_, d_steps_, d_step_counts_, t.shape,
                   step.vocab && step.vocab->kver_last_only(),
                   step.head ? TreeHeadBatch{t.catch_tokens, t.catch_rows, t.catch_positions, t.catch_parents,
                                             t.head_draft_positions, t.root_row, step.head->kv().n_past,
                                             step.head->kv().parents}
                             : TreeHeadBatch{},
                   step.draft_model ? TreeDraftModel{step.draft_model->d_tokens_, step.draft_model->d_positions_,
                                                     step.draft_model->d_parents_, step.draft_model->d_out_rows_,
                                                     t.dm_parents, t.dm_keep}
                                    : TreeDraftModel{}};
}

void CudaModel::fork_to(const CudaModel& drafter) {
  MS_CUDA(cudaEventRecord(ev_fork_, stream_));
  MS_CUDA(cudaStreamWaitEvent(drafter.stream_, ev_fork_, 0));
}

void CudaModel::join_from(const CudaModel& drafter) {
  MS_CUDA(cudaEventRecord(ev_join_, drafter.stream_));
  MS_CUDA(cudaStreamWaitEvent(stream_, ev_join_, 0));
}

// One tree step, all on the device, in a fixed sequence of launches (a graph replays it):
void CudaModel::enqueue_tree_step(const ChainStep& step) {
  const DeviceTree& t = *tree_;
  const TreeShape& shape = t.shape;
  const TreeState st = tree_state(step);
  const TreeSampling ts = tree_sampling(step);  // read with sampling only
  const int32_t k = shape.top_k, V = config_.n_vocab;
  // A draft model drafts on its own stream (the vocabulary's too), forked here and joined before
  // the verification; the self-draft and a head draft on the target's.
  CudaModel& drafter = step.draft_model ? *step.draft_model : *this;
  const cudaStream_t ds = drafter.stream_;
  if (step.draft_model) fork_to(drafter);
  // 1. The draft vocabulary's update from the previous verification (an empty one after the
  //    prompt): the tree's tokens (verification rows 1..n_nodes) and the target's top K_ver at the
  //    accepted rows (the keep list) tree_accept chose; its gather overlaps the root's forward on
  //    the copy stream.
  if (step.vocab) step.vocab->step(d_tokens_ + 1, logits_, d_update_, shape.total, shape.max_emitted(), d_keep_);
  // 2. The draft forwards: the self-draft's layers over the root alone, then each level's k
  //    frontier rows in their own pending slots (a head's: its catch-up, whose root row proposes
  //    the first level, then each level's rows fed their parents' outputs; a draft model's: the
  //    newest committed token with the root, then each level's rows one slot further on); each
  //    row's k best over the draft head become candidates, and the next frontier is chosen on the
  //    device.
  const TreeDraftModel& dm = st.draft;
  for (int32_t f = 0; f <= shape.depth; ++f) {
    const int32_t rows = shape.draft_rows(f);
    if (step.head) {
      enqueue_head_tree_rows(step, st, f);
    } else if (step.draft_model) {
      const DeviceBatch batch = f == 0 ? DeviceBatch{dm.first, dm.first_positions, dm.first_parents, 2, 0}
                                       : DeviceBatch{t.draft_tokens, t.draft_positions, dm.parents, rows,
                                                     shape.draft_start(f) + 1};
      drafter.enqueue_forward(batch, f == 0 ? dm.first_output : t.draft_out_rows, rows,
                              {.logits = step.vocab == nullptr});
      if (step.vocab) step.vocab->logits(drafter.hidden_, rows, drafter.act_scratch_);
    } else {
      enqueue_forward(DeviceBatch{t.draft_tokens, t.draft_positions, t.draft_parents, rows, shape.draft_start(f)},
                      t.draft_out_rows, rows, {.logits = step.vocab == nullptr, .end_layer = step.draft_layers});
      if (step.vocab) step.vocab->logits(hidden_, rows, act_scratch_);
    }
    if (step.sample_k > 0) {
      // Sampling: each row's sample_k best (at its pending slot's ranked row), then k draws from q.
      const int64_t at = int64_t(shape.draft_start(f)) * step.sample_k;
      if (step.vocab)
        step.vocab->ranked(rows, step.sample_k, d_draft_top_ids_ + at, d_draft_top_values_ + at);
      else
        top_k_rows(drafter.logits_, V, V, RowRange{.max_rows = rows}, step.sample_k, d_draft_top_ids_ + at,
                   d_draft_top_values_ + at, ds);
      tree_draw(st, ts, f, ds);
    } else if (step.vocab) {
      step.vocab->proposals(rows, k, t.prop_token, t.prop_logprob);
    } else {
      tree_proposals(drafter.logits_, V, V, nullptr, nullptr, rows, k, t.prop_token, t.prop_logprob, ds);
    }
    tree_absorb(st, f, ds);
  }
  // 3. The kept nodes (the best by score; sampling: the first made), then the verification of the
  //    root and every node with the tree's parent mask (placeholder rows past the nodes are never
  //    accepted): each row's argmax, or with sampling its sample_k best.
  if (step.sample_k > 0)
    tree_finish_first(st, ds);
  else
    tree_finish(st, ds);
  if (step.draft_model) join_from(drafter);
  enqueue_forward(device_batch(0, shape.verify_rows(), 0), d_out_rows_, shape.verify_rows(),
                  {.logits = true, .capture = step.head ? &step.head->step_capture() : nullptr});
  if (step.sample_k > 0)
    top_k_rows(logits_, V, V, RowRange{.max_rows = shape.verify_rows()}, step.sample_k, d_verify_top_ids_,
               d_verify_top_values_, stream_);
  else
    argmax_rows(logits_, shape.verify_rows(), V, d_argmax_out_, d_argmax_scratch_, stream_);
  // 4. Acceptance (greedy, or recursive rejection sampling), the cache compacted to the accepted
  //    path (n_past moves there), the next root.
  if (step.sample_k > 0)
    tree_sample_accept(st, ts, stream_);
  else
    tree_accept(st, stream_);
  kv_compact(kv_, d_keep_, t.n_keep, stream_);
  if (step.draft_model) kv_compact(drafter.kv_, dm.keep, t.n_keep, stream_);  // one token behind again
  tree_lay_out_root(st, stream_);
}

// One speculative step, all on the device, in a fixed sequence of launches (a graph replays it):
void CudaModel::enqueue_chain_step(const ChainStep& step) {
  const int32_t depth = step.depth;
  // A draft model works on its own stream, forked here and joined before the verification.
  CudaModel& drafter = step.draft_model ? *step.draft_model : *this;
  if (step.draft_model) fork_to(drafter);
  // 1. The draft vocabulary's update from the previous verification (an empty one after the
  //    prompt): the chain's drafts and the target's top K_ver at the rows chain_accept chose. Its
  //    gather runs on the copy stream, overlapping draft 0's backbone.
  if (step.vocab)
    step.vocab->step(d_tokens_ + 1, logits_, d_update_, depth, step.vocab->kver_last_only() ? 1 : depth + 1);
  // 2. Drafts: the backbone runs batch row d (the self-draft: alone, in pending slot d; a draft
  //    model: [last committed token, tokens[0]] first, then tokens[d] in its slot d + 1), the draft
  //    head's argmax is row d + 1. An empty draft vocabulary drafts token 0 as a placeholder
  //    (chain_accept ignores placeholders; the verification is valid whatever the tokens).
  if (step.head) enqueue_head_drafts(step);
  for (int32_t d = 0; d < depth && !step.head; ++d) {
    if (!step.draft_model) {
      enqueue_forward(device_batch(d, 1, d), d_out_rows_, 1,
                      {.logits = step.vocab == nullptr, .end_layer = step.draft_layers});
    } else if (d == 0) {
      drafter.enqueue_forward(DeviceBatch{drafter.d_tokens_, drafter.d_positions_, drafter.d_parents_, 2, 0},
                              drafter.d_out_rows_, 1, {.logits = step.vocab == nullptr});
    } else {
      drafter.enqueue_forward(
          DeviceBatch{d_tokens_ + d, drafter.d_positions_ + d + 1, drafter.d_parents_ + d + 1, 1, d + 1},
          drafter.d_out_rows_ + 1, 1, {.logits = step.vocab == nullptr});
    }
    int32_t* next = d_tokens_ + d + 1;
    if (step.vocab) step.vocab->logits(drafter.hidden_, 1, drafter.act_scratch_);
    if (step.sample_k > 0)
      enqueue_draft_draw(step, d, drafter.logits_, drafter.stream_);
    else if (step.vocab)
      step.vocab->argmax(1, /*if_empty=*/0, next);
    else
      argmax_rows(drafter.logits_, 1, config_.n_vocab, next, drafter.d_argmax_scratch_, drafter.stream_);
  }
  if (step.draft_model) join_from(drafter);
  // 3. Verification: every layer over the whole chain, the target's argmax per row, or with
  //    sampling its sample_k best (and, for a draft head, the features of every row: the next
  //    catch-up's).
  enqueue_forward(device_batch(0, depth + 1, 0), d_out_rows_, depth + 1,
                  {.logits = true, .capture = step.head ? &step.head->step_capture() : nullptr});
  if (step.sample_k > 0)
    top_k_rows(logits_, config_.n_vocab, config_.n_vocab, RowRange{.max_rows = depth + 1}, step.sample_k,
               d_verify_top_ids_, d_verify_top_values_, stream_);
  else
    argmax_rows(logits_, depth + 1, config_.n_vocab, d_argmax_out_, d_argmax_scratch_, stream_);
  // 4. Acceptance (greedy, or rejection sampling), emit, commit the accepted prefix, lay out the
  //    next batch (and the draft model's) and the vocabulary's update.
  if (step.sample_k > 0)
    chain_sample_accept(chain_state(step), chain_sampling(step), stream_);
  else
    chain_accept(chain_state(step), stream_);
}

void CudaModel::enqueue_head_tree_rows(const ChainStep& step, const TreeState& st, int32_t forward) {
  DeviceEagleHead& head = *step.head;
  const DeviceTree& t = *tree_;
  const TreeShape& shape = t.shape;
  const int32_t H = config_.n_embd, V = config_.n_vocab, k = shape.top_k;
  const float* normed = nullptr;  // the rows the draft LM head scores
  int32_t rows = 1;
  if (forward == 0) {
    // The catch-up: row i pairs the features of the last verification's row catch_rows[i] with
    // catch_tokens[i]; the rows before the root row are committed, the root row stays pending.
    const int32_t e = shape.max_emitted();
    select_rows(head.step_capture().rows, t.head_features, t.catch_rows, e, t.catch_features, stream_);
    head.enqueue_forward(DeviceBatch{t.catch_tokens, t.catch_positions, t.catch_parents, e, 0}, t.catch_features,
                         nullptr, stream_);
    tree_head_caught_up(st, stream_);
    select_rows(head.prenorm(), H, t.root_row, 1, t.slot_prenorm, stream_);  // slot 0: the root
    select_rows(head.normed(), H, t.root_row, 1, head.step_hidden(), stream_);
    normed = head.step_hidden();
  } else {
    // The level's rows in their pending slots, each fed its parent slot's output.
    const int32_t start = shape.draft_start(forward);
    rows = k;
    select_rows(t.slot_prenorm, H, t.draft_parents, k, t.head_g, stream_);
    head.enqueue_forward(DeviceBatch{t.draft_tokens, t.head_draft_positions, t.draft_parents, k, start}, nullptr,
                         t.head_g, stream_);
    MS_CUDA(cudaMemcpyAsync(t.slot_prenorm + int64_t(start) * H, head.prenorm(), size_t(k) * H * sizeof(float),
                            cudaMemcpyDeviceToDevice, stream_));
    normed = head.normed();
  }
  // Scored by the target's LM head: the draft vocabulary's packed rows, or every row into logits_.
  if (step.vocab)
    step.vocab->logits(normed, rows, act_scratch_);
  else
    matmul(output_, RowSelection{nullptr, V}, normed, H, rows, logits_, V, Store::Overwrite, act_scratch_, stream_);
}

void CudaModel::enqueue_head_drafts(const ChainStep& step) {
  DeviceEagleHead& head = *step.head;
  const int32_t depth = step.depth, H = config_.n_embd, V = config_.n_vocab;
  const HeadBatch hb = head.batch_arrays();
  // The catch-up: row i pairs the features of the last verification's row i with pred[i]; the
  // rows before the root row (the accepted drafts') are committed, the root row stays pending.
  head.enqueue_forward(DeviceBatch{d_argmax_out_, hb.catch_positions, hb.catch_parents, depth + 1, 0},
                       head.step_capture().rows, nullptr, stream_);
  chain_head_caught_up(chain_state(step), stream_);
  select_rows(head.prenorm(), H, hb.root_row, 1, head.step_g(), stream_);
  select_rows(head.normed(), H, hb.root_row, 1, head.step_hidden(), stream_);
  const size_t row = size_t(H) * sizeof(float);
  for (int32_t d = 0; d < depth; ++d) {
    if (d > 0) {  // tokens[d] in pending slot d, fed the previous row's output
      head.enqueue_forward(DeviceBatch{d_tokens_ + d, hb.draft_positions + d, hb.draft_parents + d, 1, d}, nullptr,
                           head.step_g(), stream_);
      MS_CUDA(cudaMemcpyAsync(head.step_g(), head.prenorm(), row, cudaMemcpyDeviceToDevice, stream_));
      MS_CUDA(cudaMemcpyAsync(head.step_hidden(), head.normed(), row, cudaMemcpyDeviceToDevice, stream_));
    }
    int32_t* next = d_tokens_ + d + 1;
    if (step.vocab)
      step.vocab->logits(head.step_hidden(), 1, act_scratch_);
    else
      matmul(output_, RowSelection{nullptr, V}, head.step_hidden(), H, 1, logits_, V, Store::Overwrite, act_scratch_,
             stream_);
    if (step.sample_k > 0)
      enqueue_draft_draw(step, d, logits_, stream_);
    else if (step.vocab)
      step.vocab->argmax(1, /*if_empty=*/0, next);
    else
      argmax_rows(logits_, 1, V, next, d_argmax_scratch_, stream_);
  }
}

std::vector<int32_t> CudaModel::generate_speculative(std::span<const int32_t> prompt, const SpecChainOptions& o,
                                                     SpecChainStats* stats, const TokenHandler& on_token) {
  if (o.tree) {
    const TreeShape& t = *o.tree;
    if (!t.valid())
      throw Error("draft tree of top-k " + std::to_string(t.top_k) + ", depth " + std::to_string(t.depth) + " and " +
                  std::to_string(t.total) + " nodes: top-k and depth must be in 1..64 and 0..64, the nodes in 1..the " +
                  "candidates (top-k + depth * top-k^2)");
    if (t.verify_rows() > options_.n_batch || t.top_k > options_.n_batch)
      throw Error("draft tree: its verification of " + std::to_string(t.verify_rows()) + " rows and its " +
                  std::to_string(t.top_k) + " draft rows must fit the batch of " + std::to_string(options_.n_batch));
  } else if (o.depth < 1 || o.depth + 1 > options_.n_batch) {
    throw Error("speculative depth " + std::to_string(o.depth) + " outside 1.." + std::to_string(options_.n_batch - 1));
  }
  CudaModel& drafter = o.draft_model ? *o.draft_model : *this;
  if (o.draft_model) {
    if (o.draft_model == this) throw Error("the draft model is the target itself (use the self-draft)");
    if (drafter.config_.n_vocab != config_.n_vocab)
      throw Error("draft model: vocabulary of " + std::to_string(drafter.config_.n_vocab) + " tokens, the target's has " +
                  std::to_string(config_.n_vocab));
    // A chain's first forward takes depth + 1 rows; a tree's two, a level's top-k.
    const int32_t draft_rows = o.tree ? std::max(2, o.tree->top_k) : o.depth + 1;
    if (drafter.options_.n_ctx < options_.n_ctx || drafter.options_.n_batch < draft_rows)
      throw Error("draft model: its context (" + std::to_string(drafter.options_.n_ctx) + ") must hold the target's (" +
                  std::to_string(options_.n_ctx) + ") and its batch (" + std::to_string(drafter.options_.n_batch) +
                  ") the step's " + std::to_string(draft_rows) + " rows");
  } else if (o.draft_head) {
    const DeviceEagleHead& h = *o.draft_head;
    const std::vector<int32_t>& layers = h.config().target_layers;
    if (h.config().n_embd != config_.n_embd || layers.empty() || layers.back() > config_.n_layer)
      throw Error("draft head: made for a target of hidden size " + std::to_string(h.config().n_embd) +
                  " reading layers up to " + std::to_string(layers.empty() ? 0 : layers.back()) + ", this one has " +
                  std::to_string(config_.n_embd) + " and " + std::to_string(config_.n_layer) + " layers");
    // A chain's forwards take depth + 1 rows; a tree's its catch-up, a level's and the verification's.
    const int32_t head_rows = o.tree ? std::max({o.tree->max_emitted(), o.tree->top_k, o.tree->verify_rows()}) : o.depth + 1;
    if (h.max_rows() < head_rows || h.kv().n_ctx < options_.n_ctx ||
        h.max_prompt() < static_cast<int32_t>(prompt.size()))
      throw Error("draft head: its rows (" + std::to_string(h.max_rows()) + "), cache (" + std::to_string(h.kv().n_ctx) +
                  ") and prompt room (" + std::to_string(h.max_prompt()) + ") must hold the step's " +
                  std::to_string(head_rows) + " rows, the target's context (" + std::to_string(options_.n_ctx) +
                  ") and the prompt (" + std::to_string(prompt.size()) + ")");
  } else if (o.draft_layers < 1 || o.draft_layers > config_.n_layer) {
    throw Error("draft layers " + std::to_string(o.draft_layers) + " outside 1.." + std::to_string(config_.n_layer));
  }
  if (o.draft_model && o.draft_head) throw Error("speculative decoding: a draft model or a draft head, not both");
  if (prompt.empty()) throw Error("generate: empty prompt");
  const bool sampled = !o.sampling.greedy();
  // The draft sampler's draws a step: a tree's k per draft row, a chain's draft_draws.
  const int32_t draft_draws = o.tree ? tree_draft_draws(*o.tree) : o.draft_draws > 0 ? o.draft_draws : o.depth;
  if (sampled && !o.tree && (draft_draws < o.depth || draft_draws > kMaxDraftDrawsPerStep))
    throw Error("speculative sampling: " + std::to_string(draft_draws) + " draft draws a step for a chain of " +
                std::to_string(o.depth) + " (the chain's length up to " + std::to_string(kMaxDraftDrawsPerStep) + ")");
  if (sampled && o.tree && (draft_draws > kMaxDraftDrawsPerStep || o.tree->draft_slots() > options_.n_batch))
    throw Error("speculative sampling on a draft tree of top-k " + std::to_string(o.tree->top_k) + " and depth " +
                std::to_string(o.tree->depth) + ": its " + std::to_string(o.tree->draft_slots()) + " draft rows draw " +
                std::to_string(draft_draws) + " tokens a step; at most " + std::to_string(kMaxDraftDrawsPerStep) +
                " draws and " + std::to_string(options_.n_batch) + " rows (the batch)");
  // Checked here rather than inside a step that a graph captures.
  const bool vocab_steps = o.vocab && o.vocab->kind == PrunedVocabSpec::Kind::Window &&
                           o.vocab->window.stream.source != CandidateStreamParams::Source::Ctx;
  const int32_t kver_rows = o.tree ? o.tree->max_emitted() : o.depth + 1;  // most rows a step takes K_ver from
  if (vocab_steps && kver_rows > DeviceDraftVocab::kMaxStepRows)
    throw Error("speculative depth " + std::to_string(o.tree ? o.tree->depth : o.depth) +
                ": the vocabulary window takes K_ver from at most " + std::to_string(DeviceDraftVocab::kMaxStepRows) +
                " verification rows");
  SpecChainStats st;
  std::vector<int32_t> out;
  if (o.n_predict <= 0 || options_.max_generate <= 0) {
    if (stats) *stats = st;
    return out;
  }
  // Sampling's settings and random bits: the first token's draw, then at most one target draw per
  // draft tried and one more per step (a chain's depth + 1, a tree's rows) and draft_draws draft
  // draws per step, each step emitting a token at least.
  const int32_t limit = std::min(o.n_predict, options_.max_generate);
  const int32_t target_draws = o.tree ? o.tree->verify_rows() : o.depth + 1;
  const TokenPick pick = begin_sampling(o.sampling, sampled ? 1 + limit * target_draws : 0);
  if (sampled) begin_spec_sampling(o.sampling, limit, draft_draws);

  // The draft LM head over the drafter's rows: MicroSpec's packed ones (state on the device) or the
  // full vocabulary's.
  // Made once and kept by the drafter (its head, its stream) for later generations with the same
  // settings; begin() restarts it. A step graph captured over a vocabulary it replaces is keyed
  // by the old one's serial, so it is never replayed (and is destroyed at the next capture).
  DeviceDraftVocab* vocab = nullptr;
  if (o.vocab) {
    const DeviceVocabSizes sizes{.max_prompt = options_.n_ctx, .max_rows = o.tree ? o.tree->top_k : 1};
    std::unique_ptr<DeviceDraftVocab>& kept = drafter.draft_vocab_;
    if (!kept || !kept->made_for(drafter.output_, *o.vocab, sizes, drafter.stream_)) {
      kept.reset();
      kept = std::make_unique<DeviceDraftVocab>(drafter.output_, *o.vocab, sizes, drafter.stream_);
    }
    vocab = kept.get();
  }

  // Prefill (it leaves the prompt's argmax in d_tokens_[0] and out_ids[0]), and the candidate
  // stream's start: the prompt and the target's top K_pre per position; a draft head's features.
  PromptCandidates candidates;
  if (vocab) candidates = PromptCandidates{vocab->prompt_top_k(), vocab->prompt_top(), vocab->prompt_ids()};
  if (o.draft_head) candidates.capture = &o.draft_head->prompt_capture();
  prefill_for_decode(prompt, candidates, pick);
  if (vocab) vocab->begin(int32_t(prompt.size()));  // prefill_for_decode has synchronized: the drafter's stream may read
  if (o.draft_head) {
    // The head's cache takes the prompt's rows but the last; its first catch-up is the root row.
    o.draft_head->begin(prompt, stream_);
    // A chain's catch-up reads its tokens from the argmax rows (the prompt's argmax first, then
    // zeros); a tree's from catch_tokens (tree_begin), so it takes the first row only.
    o.draft_head->prepare_first_catch_up(int32_t(prompt.size()), d_tokens_, d_argmax_out_, o.tree ? 1 : o.depth + 1,
                                         stream_);
  }
  if (o.draft_model) {
    // The draft model's cache holds the prompt but its last token, which starts its first batch
    // (speculative/chain_state.h).
    const int32_t n_prompt = int32_t(prompt.size());
    if (n_prompt > 1)
      drafter.prefill_for_decode(prompt.first(size_t(n_prompt - 1)));
    else
      drafter.truncate(0);
    // Pageable source: staged before the call returns; the drafter's stream is synchronized
    // before the first step.
    MS_CUDA(cudaMemcpyAsync(drafter.d_tokens_, &prompt.back(), sizeof(int32_t), cudaMemcpyHostToDevice,
                            drafter.stream_));
  }
  const int32_t head_features = o.draft_head ? o.draft_head->config().n_features() : 0;
  if (o.tree && (!tree_ || !(tree_->shape == *o.tree) || tree_->head_features != head_features)) {
    tree_.reset();
    tree_ = std::make_unique<DeviceTree>(*o.tree, head_features, config_.n_embd, stream_);
  }
  const ChainStep step{o.depth, o.draft_layers, vocab, o.draft_model, o.draft_head, o.tree,
                       sampled ? o.sampling.top_k : 0, sampled ? draft_draws : 0};
  out = speculate_resident(o, step, on_token, st);
  if (o.draft_model) {
    // The device moved the drafter's cache (chain_accept): its host mirror follows.
    MS_CUDA(cudaMemcpyAsync(&drafter.n_past_, drafter.kv_.n_past, sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    MS_CUDA(cudaStreamSynchronize(stream_));
  }
  if (stats) *stats = st;
  return out;
}

std::vector<int32_t> CudaModel::speculate_resident(const SpecChainOptions& o, const ChainStep& step,
                                                   const TokenHandler& on_token, SpecChainStats& st) {
  DeviceDraftVocab* vocab = step.vocab;
  const bool sampled = step.sample_k > 0;
  // The most tokens a step emits, and the pending cache slots its batches take.
  const int32_t per_step = o.tree ? o.tree->max_emitted() : o.depth + 1;
  const int32_t step_slots = o.tree ? o.tree->pending_slots() : o.depth + 1;
  const int32_t limit = std::min(o.n_predict, options_.max_generate);
  std::vector<int32_t> ids;
  // After the prompt's argmax (out_ids[0], the batch's row 0).
  if (o.tree)
    tree_begin(tree_state(step), stream_);
  else
    chain_begin(chain_state(step), stream_);
  if (vocab) vocab->wait_for_gather();      // the prompt's gather: a captured step must not wait on it
  // A draft model's stream joins the captured step idle (its prefill and the vocabulary's start).
  if (o.draft_model) MS_CUDA(cudaStreamSynchronize(o.draft_model->stream_));
  // A graph captured for another step (shape, vocabulary, draft model) is not this one's.
  if (chain_graph_ && !(chain_graph_for_ == step.key())) {
    cudaGraphExecDestroy(chain_graph_);
    chain_graph_ = nullptr;
  }
  chain_graph_for_ = step.key();
  // Every emitted token but the newest is in the cache (chain_accept), so n_past follows the count.
  const int32_t n_past_at_start = n_past_;
  int32_t produced = 1;
  bool done = fetch_emitted(produced, limit, o.stop_ids, on_token, ids);
  while (!done) {
    // Steps that fit even if each accepts its whole chain: every step's batch in the context, its
    // tokens in out_ids.
    const int32_t room = options_.n_ctx - n_past_;
    const int32_t fit_ctx = room >= step_slots ? (room - step_slots) / per_step + 1 : 0;
    const int32_t fit_out = (options_.max_generate - produced) / per_step;
    const int32_t steps = std::min({std::max(o.sync_every, 1), fit_ctx, fit_out, limit - produced});
    if (steps < 1) break;
    run_steps(chain_graph_, steps, o.graphs, [&] {
      if (o.tree)
        enqueue_tree_step(step);
      else
        enqueue_chain_step(step);
    });
    MS_CUDA(cudaMemcpyAsync(&produced, d_counter_, sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    MS_CUDA(cudaStreamSynchronize(stream_));  // the host reads it now
    n_past_ = n_past_at_start + produced - 1;
    done = fetch_emitted(produced, limit, o.stop_ids, on_token, ids);
  }
  // Where a whole chain no longer fits: plain decode steps from the same device state (sampled ones
  // draw the target's bits the steps left, in order, as the CPU's plain steps would).
  if (!done && sampled) {
    int32_t drawn = 0;
    MS_CUDA(cudaMemcpyAsync(&drawn, d_target_drawn_, sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    MS_CUDA(cudaStreamSynchronize(stream_));
    continue_sampling_plainly(o.sampling, drawn, produced, limit - produced);
  }
  if (!done) decode_until(limit, o.stop_ids, o.graphs, o.sync_every, TokenPick{.sample_k = step.sample_k}, on_token, ids);
  // The counts of the steps that emitted the tokens kept (steps may have run past them until the
  // host looked).
  int32_t n_steps = 0;
  MS_CUDA(cudaMemcpyAsync(&n_steps, d_steps_, sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  MS_CUDA(cudaStreamSynchronize(stream_));
  std::vector<int32_t> step_counts(static_cast<size_t>(n_steps));
  if (n_steps > 0)
    MS_CUDA(cudaMemcpyAsync(step_counts.data(), d_step_counts_, step_counts.size() * sizeof(int32_t),
                            cudaMemcpyDeviceToHost, stream_));
  MS_CUDA(cudaStreamSynchronize(stream_));
  const ChainTotals totals = chain_totals_until(step_counts.data(), n_steps, int32_t(ids.size()));
  st.steps = totals.steps;
  st.accepted_drafts = totals.accepted;
  return ids;
}

double CudaModel::time_decode_steps(int32_t steps, Graphs graphs, const SamplingParams& sampling) {
  if (n_past_ + steps > options_.n_ctx || steps + 1 > options_.max_generate)
    throw Error("time_decode_steps: " + std::to_string(steps) + " steps do not fit the context");
  // Captured before the timed region.
  const TokenPick pick = begin_sampling(sampling, options_.max_generate);
  drop_decode_graph_unless(pick);
  if (graphs == Graphs::On && !decode_graph_) decode_graph_ = capture([&] { enqueue_decode_step(pick); });
  MS_CUDA(cudaEventRecord(ev_start_, stream_));
  run_steps(decode_graph_, steps, graphs, [&] { enqueue_decode_step(pick); });
  MS_CUDA(cudaEventRecord(ev_stop_, stream_));
  MS_CUDA(cudaEventSynchronize(ev_stop_));
  n_past_ += steps;
  float ms = 0.0f;
  MS_CUDA(cudaEventElapsedTime(&ms, ev_start_, ev_stop_));
  return ms / 1000.0;
}

}  // namespace microspec::cuda
