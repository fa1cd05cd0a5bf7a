#include "cuda/eagle_head.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "cuda/weights.h"
#include "gguf/gguf.h"
#include "model/config.h"
#include "util/error.h"

namespace microspec::cuda {

std::string device_head_unsupported(const GgufFile& f) {
  const std::string arch(f.get_string("general.architecture"));
  if (arch != "eagle3") return "an " + arch + " head (the device runs EAGLE-3 heads)";
  if (f.find_tensor("output.weight") || f.find_tensor("d2t"))
    return "an own LM head over a draft vocabulary (output.weight / d2t; the device scores the target's LM head)";
  if (f.find_tensor("rope_freqs.weight")) return "RoPE frequency factors (rope_freqs.weight)";
  for (const GgufTensor& t : f.tensors())
    if (t.ne.size() == 2 && !matmul_supported(t.type))
      return "tensor '" + t.name + "' of type " + type_name(uint32_t(t.type)) + ", which has no CUDA kernel";
  return {};
}

DeviceEagleHead::DeviceEagleHead(int32_t max_rows, int32_t n_ctx, int32_t max_prompt)
    : max_rows_(max_rows), n_ctx_(n_ctx), max_prompt_(max_prompt) {
  if (max_rows < 1 || n_ctx < 1 || max_prompt < 1)
    throw Error("device draft head: rows, context and prompt sizes must be >= 1");
}

DeviceEagleHead::DeviceEagleHead(const GgufFile& f, const ModelConfig& target_config, const DeviceMatrix& target_embd,
                                 int32_t max_rows, int32_t n_ctx, int32_t max_prompt, cudaStream_t stream)
    : DeviceEagleHead(max_rows, n_ctx, max_prompt) {
  if (const std::string why = device_head_unsupported(f); !why.empty())
    throw Error(f.name() + ": the CUDA backend cannot run this draft head: " + why + "; run it on the CPU");
  config_ = read_eagle3_config(f, target_config);
  check_head_tensors_finite(f);
  upload(f, target_config, target_embd, stream);
  allocate(stream);
}

std::unique_ptr<DeviceEagleHead> DeviceEagleHead::random(const Eagle3Config& config, const DeviceMatrix& target_embd,
                                                         GgmlType type, uint64_t seed, int32_t max_rows, int32_t n_ctx,
                                                         int32_t max_prompt, cudaStream_t stream) {
  if (config.arch != HeadArch::Eagle3 || config.n_draft_vocab != 0 || config.target_layers.empty())
    throw Error("DeviceEagleHead::random makes EAGLE-3 heads without an own LM head");
  std::unique_ptr<DeviceEagleHead> h(new DeviceEagleHead(max_rows, n_ctx, max_prompt));
  h->config_ = config;
  const Eagle3Config& c = h->config_;
  uint64_t stream_seed = seed;
  auto matrix = [&](int64_t cols, int64_t rows) {
    const size_t stride = row_bytes(type, cols);
    void* p = h->memory_.alloc(stride * rows);
    fill_random(type, p, cols * rows, std::sqrt(3.0f / float(cols)), ++stream_seed, stream);  // variance 1 / cols
    return DeviceMatrix{type, static_cast<const uint8_t*>(p), rows, cols, stride};
  };
  auto norm = [&](int64_t n) {
    float* p = static_cast<float*>(h->memory_.alloc(n * sizeof(float)));
    fill_random_f32(p, n, 1.0f, 0.1f, ++stream_seed, stream);
    return static_cast<const float*>(p);
  };
  const int64_t H = c.n_embd;
  h->fc_ = matrix(c.n_features(), H);
  if (c.norm_before_fc) h->fc_norm_ = norm(c.n_features());
  h->token_embd_ = target_embd;
  h->embd_norm_ = norm(H);
  h->hidden_norm_ = norm(H);
  h->qkv_ = {matrix(2 * H, c.q_dim() + 2 * int64_t(c.kv_dim()))};
  h->wo_ = matrix(c.q_dim(), H);
  h->ffn_norm_ = norm(H);
  h->gate_up_ = {matrix(H, 2 * int64_t(c.n_ff))};
  h->w_down_ = matrix(c.n_ff, H);
  h->output_norm_ = norm(H);
  h->allocate(stream);
  return h;
}

DeviceEagleHead::~DeviceEagleHead() = default;  // memory_ frees; callers synchronize their stream first

void DeviceEagleHead::upload(const GgufFile& f, const ModelConfig& target_config, const DeviceMatrix& target_embd,
                             cudaStream_t /*stream*/) {
  const Eagle3Config& c = config_;
  WeightUploader up(f, [&](size_t bytes) { return memory_.alloc(bytes); });
  const int64_t H = c.n_embd;
  fc_ = up.matrix("fc.weight", c.n_features(), H);
  if (c.norm_before_fc) fc_norm_ = up.vector("enc.output_norm.weight", c.n_features());
  token_embd_ = f.find_tensor("token_embd.weight") ? up.matrix("token_embd.weight", H, target_config.n_vocab)
                                                   : target_embd;
  embd_norm_ = up.vector("blk.0.attn_norm.weight", H);
  hidden_norm_ = up.vector("blk.0.attn_norm_2.weight", H);
  qkv_ = up.stacked({"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"},
                    {c.q_dim(), c.kv_dim(), c.kv_dim()}, 2 * H);
  wo_ = up.matrix("blk.0.attn_output.weight", c.q_dim(), H);
  ffn_norm_ = up.vector("blk.0.ffn_norm.weight", H);
  gate_up_ = up.stacked({"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"}, {c.n_ff, c.n_ff}, H);
  w_down_ = up.matrix("blk.0.ffn_down.weight", c.n_ff, H);
  output_norm_ = up.vector("output_norm.weight", H);
}

void DeviceEagleHead::allocate(cudaStream_t stream) {
  const Eagle3Config& c = config_;
  const size_t R = size_t(max_rows_), H = size_t(c.n_embd), F = size_t(c.n_features());
  auto floats = [&](size_t n) { return static_cast<float*>(memory_.alloc(n * sizeof(float))); };
  auto ints = [&](size_t n) { return static_cast<int32_t*>(memory_.alloc(n * sizeof(int32_t))); };
  qkv_dim_ = c.q_dim() + 2 * c.kv_dim();
  fnorm_ = floats(R * F);
  g_ = floats(R * H);
  embd_ = floats(R * H);
  gn_ = floats(R * H);
  x_ = floats(R * 2 * H);
  qkv_buf_ = floats(R * qkv_dim_);
  attn_ = floats(R * c.q_dim());
  prenorm_ = floats(R * H);
  rn_ = floats(R * H);
  gate_up_buf_ = floats(R * 2 * c.n_ff);
  ffn_h_ = floats(R * c.n_ff);
  normed_ = floats(R * H);
  const int64_t widest = std::max<int64_t>({c.n_features(), 2 * c.n_embd, c.n_ff, c.q_dim()});
  act_scratch_ = static_cast<uint8_t*>(memory_.alloc(matmul_scratch_bytes(max_rows_, widest)));
  prompt_capture_ = FeatureCapture{c.target_layers, floats(size_t(max_prompt_) * F)};
  step_capture_ = FeatureCapture{c.target_layers, floats(R * F)};
  catch_positions_ = ints(R);
  catch_parents_ = ints(R);
  draft_positions_ = ints(R);
  draft_parents_ = ints(R);
  root_row_ = ints(1);
  step_g_ = floats(H);
  step_hidden_ = floats(H);
  prompt_ids_ = ints(size_t(max_prompt_));
  prompt_positions_ = ints(size_t(max_prompt_));
  prompt_parents_ = ints(size_t(max_prompt_));

  kv_.n_layer = 1;
  kv_.n_ctx = n_ctx_;
  kv_.kv_dim = c.kv_dim();
  kv_.k = static_cast<uint16_t*>(memory_.alloc(size_t(n_ctx_) * c.kv_dim() * sizeof(uint16_t)));
  kv_.v = static_cast<uint16_t*>(memory_.alloc(size_t(n_ctx_) * c.kv_dim() * sizeof(uint16_t)));
  kv_.positions = ints(size_t(n_ctx_));
  kv_.parents = ints(size_t(n_ctx_));
  kv_.n_past = ints(1);

  // What never changes: the prompt rows' positions and parents (a chunk of rows starting at c takes
  // positions c.. and parents -1, 0, 1, ...).
  std::vector<int32_t> counting(static_cast<size_t>(max_prompt_));
  std::iota(counting.begin(), counting.end(), 0);
  cuda::upload(prompt_positions_, counting.data(), counting.size() * sizeof(int32_t));
  for (int32_t& v : counting) v -= 1;
  cuda::upload(prompt_parents_, counting.data(), counting.size() * sizeof(int32_t));
  MS_CUDA(cudaMemsetAsync(kv_.n_past, 0, sizeof(int32_t), stream));
  MS_CUDA(cudaMemsetAsync(kv_.parents, 0xFF, sizeof(int32_t) * n_ctx_, stream));
  MS_CUDA(cudaMemsetAsync(step_capture_.rows, 0, R * F * sizeof(float), stream));
  MS_CUDA(cudaStreamSynchronize(stream));
}

void DeviceEagleHead::project(const std::vector<DeviceMatrix>& parts, const float* x, int64_t ldx, int32_t n, float* y,
                              int64_t ldy, cudaStream_t stream) {
  int64_t offset = 0;
  for (const DeviceMatrix& w : parts) {
    matmul(w, RowSelection{nullptr, w.rows}, x, ldx, n, y + offset, ldy, Store::Overwrite, act_scratch_, stream);
    offset += w.rows;
  }
}

void DeviceEagleHead::enqueue_forward(const DeviceBatch& batch, const float* features, const float* g,
                                      cudaStream_t stream) {
  const Eagle3Config& c = config_;
  const int32_t n = batch.n, H = c.n_embd, F = c.n_features();
  if (n < 1 || n > max_rows_)
    throw Error("device draft head: " + std::to_string(n) + " rows, it takes 1.." + std::to_string(max_rows_));
  if ((features == nullptr) == (g == nullptr)) throw Error("device draft head: give features or hidden inputs, not both");
  set_slot_meta(kv_, batch, stream);

  // The hidden input: fc over the (normed) target features, or the previous row's output.
  if (features) {
    const float* in = features;
    if (fc_norm_) {
      rms_norm(features, fnorm_, RowGroups{n, 1, F}, F, fc_norm_, c.rms_eps, stream);
      in = fnorm_;
    }
    matmul(fc_, RowSelection{nullptr, H}, in, F, n, g_, H, Store::Overwrite, act_scratch_, stream);
    g = g_;
  }

  // Attention input: [attn_norm(embedding) ; attn_norm_2(g)] per row.
  gather_rows_f32(token_embd_, batch.tokens, n, 1.0f, embd_, stream);
  rms_norm(embd_, embd_, RowGroups{n, 1, H}, H, embd_norm_, c.rms_eps, stream);
  rms_norm(g, gn_, RowGroups{n, 1, H}, H, hidden_norm_, c.rms_eps, stream);
  const size_t row = size_t(H) * sizeof(float);
  MS_CUDA(cudaMemcpy2DAsync(x_, 2 * row, embd_, row, row, n, cudaMemcpyDeviceToDevice, stream));
  MS_CUDA(cudaMemcpy2DAsync(x_ + H, 2 * row, gn_, row, row, n, cudaMemcpyDeviceToDevice, stream));

  // Attention block (NORM RoPE, scale 1/sqrt(head_dim)), its residual g or attn_norm_2(g).
  project(qkv_, x_, 2 * int64_t(H), n, qkv_buf_, qkv_dim_, stream);
  const float theta_scale = std::pow(c.rope_base, -2.0f / c.head_dim);  // as the CPU head computes it
  rope_and_store_kv(qkv_buf_, qkv_dim_, kv_, 0, batch,
                    RopeShape{c.n_head, c.n_head_kv, c.head_dim, c.head_dim, /*neox=*/false, theta_scale}, stream);
  attention(kv_, 0, batch, qkv_buf_, qkv_dim_,
            AttentionShape{c.n_head, c.n_head_kv, c.head_dim, 1.0f / std::sqrt(float(c.head_dim)), 0}, attn_, stream);
  matmul(wo_, RowSelection{nullptr, H}, attn_, c.q_dim(), n, prenorm_, H, Store::Overwrite, act_scratch_, stream);
  add_inplace(prenorm_, c.norm_before_residual ? gn_ : g, int64_t(n) * H, stream);

  // Feed-forward block (SiLU-gated), added onto the stream; then the final norm.
  rms_norm(prenorm_, rn_, RowGroups{n, 1, H}, H, ffn_norm_, c.rms_eps, stream);
  project(gate_up_, rn_, H, n, gate_up_buf_, 2 * int64_t(c.n_ff), stream);
  gated_activation(gate_up_buf_, gate_up_buf_ + c.n_ff, 2 * int64_t(c.n_ff), n, c.n_ff, Activation::Silu, ffn_h_,
                   stream);
  matmul(w_down_, RowSelection{nullptr, H}, ffn_h_, c.n_ff, n, prenorm_, H, Store::Accumulate, act_scratch_, stream);
  rms_norm(prenorm_, normed_, RowGroups{n, 1, H}, H, output_norm_, c.rms_eps, stream);
}

void DeviceEagleHead::begin(std::span<const int32_t> prompt, cudaStream_t stream) {
  const int32_t n_prompt = static_cast<int32_t>(prompt.size());
  if (n_prompt < 1 || n_prompt > max_prompt_)
    throw Error("device draft head: a prompt of " + std::to_string(n_prompt) + " tokens, it keeps 1.." +
                std::to_string(max_prompt_));
  // Pageable source: staged before the call returns.
  MS_CUDA(cudaMemcpyAsync(prompt_ids_, prompt.data(), prompt.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  MS_CUDA(cudaMemsetAsync(kv_.n_past, 0, sizeof(int32_t), stream));
  const size_t F = size_t(config_.n_features());
  for (int32_t c = 0; c + 1 < n_prompt; c += max_rows_) {
    const int32_t len = std::min(max_rows_, n_prompt - 1 - c);
    enqueue_forward(DeviceBatch{prompt_ids_ + c + 1, prompt_positions_ + c, prompt_parents_, len, 0},
                    prompt_capture_.rows + size_t(c) * F, nullptr, stream);
    kv_advance(kv_, len, stream);
  }
}

void DeviceEagleHead::prepare_first_catch_up(int32_t n_prompt, const int32_t* first_token, int32_t* pred,
                                             int32_t rows, cudaStream_t stream) {
  if (n_prompt < 1 || n_prompt > max_prompt_ || rows < 1 || rows > max_rows_)
    throw Error("device draft head: prompt length or rows out of range");
  const size_t F = size_t(config_.n_features());
  MS_CUDA(cudaMemsetAsync(step_capture_.rows, 0, size_t(max_rows_) * F * sizeof(float), stream));
  MS_CUDA(cudaMemcpyAsync(step_capture_.rows, prompt_capture_.rows + size_t(n_prompt - 1) * F, F * sizeof(float),
                          cudaMemcpyDeviceToDevice, stream));
  MS_CUDA(cudaMemsetAsync(pred, 0, size_t(rows) * sizeof(int32_t), stream));
  MS_CUDA(cudaMemcpyAsync(pred, first_token, sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
}

HeadBatch DeviceEagleHead::batch_arrays() const {
  return HeadBatch{catch_positions_, catch_parents_, draft_positions_, draft_parents_, root_row_, kv_.n_past,
                   kv_.parents};
}

}  // namespace microspec::cuda
