#include "draft_head/eagle3_head.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "gguf/gguf.h"
#include "kernels/kernels.h"
#include "util/error.h"

namespace microspec {

namespace {

// A metadata integer that must equal what the target (or the head's own shapes) imply.
void expect_equal(const GgufFile& f, const std::string& what, int64_t expected, int64_t actual) {
  if (expected != actual)
    throw Error(f.name() + ": " + what + " is " + std::to_string(actual) + ", expected " + std::to_string(expected));
}

// Every element of a tensor is finite (weights of any supported type, dequantized row by row).
void check_finite(const GgufFile& f, const GgufTensor& t) {
  if (t.type == static_cast<GgmlType>(26) || t.type == static_cast<GgmlType>(27)) return;  // I32/I64 ids (d2t)
  const int64_t cols = t.ne.empty() ? 0 : t.ne[0], rows = t.rows();
  const size_t stride = row_bytes(t.type, cols);
  std::vector<float> row(size_t(std::max<int64_t>(cols, 1)));
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_row(t.type, t.data + size_t(r) * stride, row.data(), cols);
    for (int64_t c = 0; c < cols; ++c)
      if (!std::isfinite(row[size_t(c)]))
        throw Error(f.name() + ": tensor '" + t.name + "' holds a non-finite value (" + std::to_string(row[size_t(c)]) +
                    ") at row " + std::to_string(r) + ", column " + std::to_string(c));
  }
}

}  // namespace

Eagle3Config read_eagle3_config(const GgufFile& f, const ModelConfig& tc) {
  const std::string arch(f.get_string("general.architecture"));
  if (arch != "eagle3" && arch != "eagle2")
    throw Error(f.name() + ": general.architecture is '" + arch + "', expected 'eagle3' or 'eagle2' (an EAGLE draft head)");
  const std::string a = arch + ".";
  Eagle3Config c;
  c.arch = arch == "eagle3" ? HeadArch::Eagle3 : HeadArch::Eagle2;
  c.n_embd = static_cast<int32_t>(f.get_int(a + "embedding_length"));
  expect_equal(f, a + "block_count", 1, f.get_int(a + "block_count"));
  c.n_head = static_cast<int32_t>(f.get_int(a + "attention.head_count"));
  c.n_head_kv = static_cast<int32_t>(f.get_int_opt(a + "attention.head_count_kv").value_or(c.n_head));
  c.n_ff = static_cast<int32_t>(f.get_int(a + "feed_forward_length"));
  c.rms_eps = static_cast<float>(f.get_float(a + "attention.layer_norm_rms_epsilon"));
  c.rope_base = static_cast<float>(f.get_float_opt(a + "rope.freq_base").value_or(10000.0));
  if (c.n_embd < 1 || c.n_head < 1 || c.n_head_kv < 1 || c.n_ff < 1 || c.n_head % c.n_head_kv != 0)
    throw Error(f.name() + ": invalid head sizes (embedding " + std::to_string(c.n_embd) + ", heads " +
                std::to_string(c.n_head) + "/" + std::to_string(c.n_head_kv) + ", ffn " + std::to_string(c.n_ff) + ")");
  c.head_dim = static_cast<int32_t>(f.get_int_opt(a + "attention.key_length").value_or(c.n_embd / c.n_head));
  if (c.head_dim < 8 || c.head_dim % 8 != 0)  // the half-float attention kernels' multiple
    throw Error(f.name() + ": head dimension " + std::to_string(c.head_dim) + " is not a multiple of 8");
  if (auto v = f.get_int_opt(a + "attention.value_length")) expect_equal(f, a + "attention.value_length", c.head_dim, *v);
  if (auto r = f.get_int_opt(a + "rope.dimension_count")) expect_equal(f, a + "rope.dimension_count", c.head_dim, *r);
  if (!(c.rms_eps > 0.0f) || !(c.rope_base > 0.0f))
    throw Error(f.name() + ": rms epsilon and rope base must be positive");

  // Against the target: the features it reads and the hidden size its embeddings and LM head need.
  c.target_hidden = static_cast<int32_t>(f.get_int(a + "target_hidden_size"));
  expect_equal(f, a + "target_hidden_size (the target's embedding length)", tc.n_embd, c.target_hidden);
  expect_equal(f, a + "embedding_length (the target's, whose embeddings and LM head the head uses)", tc.n_embd,
               c.n_embd);
  if (c.arch == HeadArch::Eagle2) {
    c.target_layers = {tc.n_layer};  // the stream after the last layer, normed in fuse()
  } else {
    c.target_layers = f.get_i32_array(a + "target_layers");
    expect_equal(f, a + "target_layers count", 3, static_cast<int64_t>(c.target_layers.size()));
  }
  for (size_t i = 0; i < c.target_layers.size(); ++i) {
    const int32_t l = c.target_layers[i];
    if (l < 0 || l > tc.n_layer)
      throw Error(f.name() + ": " + a + "target_layers[" + std::to_string(i) + "] is " + std::to_string(l) +
                  ", expected a layer of the target in [0, " + std::to_string(tc.n_layer) + "] (the target has " +
                  std::to_string(tc.n_layer) + " layers)");
    if (i > 0 && l < c.target_layers[i - 1])
      throw Error(f.name() + ": " + a + "target_layers must be non-decreasing, got " +
                  std::to_string(c.target_layers[i - 1]) + " then " + std::to_string(l));
  }
  c.norm_before_residual = f.get_bool_or(a + "norm_before_residual", false);
  c.norm_before_fc = f.get_bool_or(a + "norm_before_fc", false);
  if (f.has("tokenizer.ggml.tokens"))
    expect_equal(f, "tokenizer.ggml.tokens count (the target's vocabulary)", tc.n_vocab,
                 static_cast<int64_t>(f.get_string_array("tokenizer.ggml.tokens").size()));
  return c;
}

void check_head_tensors_finite(const GgufFile& f) {
  for (const GgufTensor& t : f.tensors()) check_finite(f, t);
}

Eagle3Head::Eagle3Head(std::unique_ptr<GgufFile> file, Model& target, int32_t n_batch)
    : file_(std::move(file)), target_(target), n_batch_(n_batch), mm_(target.pool(), target.kernels()) {
  const GgufFile& f = *file_;
  if (n_batch_ < 1) throw Error("draft head: batch size must be >= 1");
  config_ = read_eagle3_config(f, target.config());
  const Eagle3Config& c = config_;
  load_weights();
  load_own_lm_head();
  check_head_tensors_finite(f);

  const int32_t H = c.n_embd, B = n_batch_;
  act_.features.assign(c.norm_before_fc ? size_t(B) * c.n_features() : 0, 0.0f);
  act_.embd.assign(size_t(B) * H, 0.0f);
  act_.x.assign(size_t(B) * 2 * H, 0.0f);  // EAGLE-3: attention input; EAGLE-2: fc input
  act_.gn.assign(size_t(B) * H, 0.0f);
  act_.q.assign(size_t(B) * c.q_dim(), 0.0f);
  act_.k.assign(size_t(B) * c.kv_dim(), 0.0f);
  act_.v.assign(size_t(B) * c.kv_dim(), 0.0f);
  act_.attn.assign(size_t(B) * c.q_dim(), 0.0f);
  act_.rn.assign(size_t(B) * H, 0.0f);
  act_.gate.assign(size_t(B) * c.n_ff, 0.0f);
  act_.up.assign(size_t(B) * c.n_ff, 0.0f);
  mm_.reserve(B, std::max({c.n_features(), 2 * H, c.n_ff, c.q_dim()}));
  if (c.arch == HeadArch::Eagle2) target_norm_ = target.output_norm_weights();
}

Eagle3Head::~Eagle3Head() = default;

void Eagle3Head::load_weights() {
  const GgufFile& f = *file_;
  const Eagle3Config& c = config_;
  // A matrix multiplied whole, repacked as the target's are.
  auto matrix = [&](const std::string& name, int64_t cols, int64_t rows) {
    const QMatrix m = load_matrix(f, name, cols, rows, mm_.kernels());
    return target_.repacks() ? repacked_.add(m, mm_.kernels(), mm_.pool()) : m;
  };
  auto vector = [&](const std::string& name, int64_t n) { return load_vector(f, name, n); };
  const int64_t H = c.n_embd;
  const int64_t in = c.attn_input();
  if (c.arch == HeadArch::Eagle3) {
    fc_ = matrix("fc.weight", c.n_features(), H);
    if (c.norm_before_fc) fc_norm_ = vector("enc.output_norm.weight", c.n_features());
    embd_norm_ = vector("blk.0.attn_norm.weight", H);
    hidden_norm_ = vector("blk.0.attn_norm_2.weight", H);
    output_norm_ = vector("output_norm.weight", H);
  } else {
    fc_ = matrix("fc.weight", 2 * H, H);
    if (f.find_tensor("fc.bias")) fc_bias_ = vector("fc.bias", H);
  }
  if (const GgufTensor* e = f.find_tensor("token_embd.weight")) {
    if (e->ne.size() == 2 && e->ne[1] != target_.config().n_vocab)
      throw Error(f.name() + ": token_embd.weight has " + std::to_string(e->ne[1]) + " rows, expected the target's " +
                  std::to_string(target_.config().n_vocab) + " (its vocabulary)");
    token_embd_ = load_matrix(f, "token_embd.weight", H, target_.config().n_vocab, mm_.kernels());  // rows looked up
  } else {
    token_embd_ = target_.embedding_matrix();
  }
  if (f.find_tensor("rope_freqs.weight")) rope_freqs_ = vector("rope_freqs.weight", c.head_dim / 2);
  wq_ = matrix("blk.0.attn_q.weight", in, c.q_dim());
  wk_ = matrix("blk.0.attn_k.weight", in, c.kv_dim());
  wv_ = matrix("blk.0.attn_v.weight", in, c.kv_dim());
  wo_ = matrix("blk.0.attn_output.weight", c.q_dim(), H);
  ffn_norm_ = vector("blk.0.ffn_norm.weight", H);
  w_gate_ = matrix("blk.0.ffn_gate.weight", H, c.n_ff);
  w_up_ = matrix("blk.0.ffn_up.weight", H, c.n_ff);
  w_down_ = matrix("blk.0.ffn_down.weight", c.n_ff, H);
}

void Eagle3Head::load_own_lm_head() {
  const GgufFile& f = *file_;
  Eagle3Config& c = config_;
  const int64_t n_vocab = target_.config().n_vocab;
  const GgufTensor* out = f.find_tensor("output.weight");
  const GgufTensor* d2t = f.find_tensor("d2t");
  if (!out) {
    if (d2t) throw Error(f.name() + ": d2t without output.weight (the own LM head it maps)");
    return;
  }
  if (out->ne.size() != 2 || out->ne[1] < 1)
    throw Error(f.name() + ": output.weight must be a matrix of [" + std::to_string(c.n_embd) + " cols][draft rows]");
  const int64_t n_draft = out->ne[1];
  if (n_draft > n_vocab)
    throw Error(f.name() + ": output.weight has " + std::to_string(n_draft) + " rows, more than the target's vocabulary of " +
                std::to_string(n_vocab));
  output_ = load_matrix(f, "output.weight", c.n_embd, n_draft, mm_.kernels());
  c.n_draft_vocab = static_cast<int32_t>(n_draft);
  d2t_.resize(size_t(n_draft));
  if (!d2t) {
    if (n_draft != n_vocab)
      throw Error(f.name() + ": output.weight has " + std::to_string(n_draft) + " rows but no d2t maps them to the target's " +
                  std::to_string(n_vocab) + " ids");
    for (int64_t i = 0; i < n_draft; ++i) d2t_[size_t(i)] = static_cast<int32_t>(i);
    return;
  }
  if (d2t->type != static_cast<GgmlType>(27) || d2t->ne.size() != 1 || d2t->ne[0] != n_draft)
    throw Error(f.name() + ": d2t must be I64 [" + std::to_string(n_draft) + "] (one target id per output.weight row), found " +
                type_name(static_cast<uint32_t>(d2t->type)) + " of " + std::to_string(d2t->n_elements()) + " elements");
  std::vector<uint8_t> seen(size_t(n_vocab), 0);
  for (int64_t i = 0; i < n_draft; ++i) {
    int64_t id = 0;
    std::memcpy(&id, d2t->data + 8 * i, 8);
    if (id < 0 || id >= n_vocab)
      throw Error(f.name() + ": d2t[" + std::to_string(i) + "] is target id " + std::to_string(id) +
                  ", outside the target's vocabulary of " + std::to_string(n_vocab) +
                  " (llama.cpp stores absolute ids: offsets + row index)");
    if (seen[size_t(id)]++) throw Error(f.name() + ": d2t maps two rows to target id " + std::to_string(id));
    d2t_[size_t(i)] = static_cast<int32_t>(id);
  }
}

void Eagle3Head::own_logits(const float* normed, int32_t n, const int32_t* rows, int32_t n_rows, float* logits) {
  matmul_rows(mm_, output_, rows, n_rows, normed, n, logits, n_rows);
}

void Eagle3Head::rms_norm(const float* x, const float* w, int32_t n, int32_t dim, float eps, float* y) const {
  const RmsNormFn norm = mm_.kernels().rows.rms_norm;
  for (int32_t r = 0; r < n; ++r) norm(x + size_t(r) * dim, w, dim, eps, y + size_t(r) * dim);
}

void Eagle3Head::rope(float* x, int32_t n, int32_t n_heads, const int32_t* positions) const {
  // NORM style (llama.cpp's LLAMA_ROPE_TYPE_NORM for eagle3): pairs (2j, 2j + 1).
  const int32_t hd = config_.head_dim, half = hd / 2;
  const float theta_scale = std::pow(config_.rope_base, -2.0f / hd);
  for (int32_t t = 0; t < n; ++t) {
    float theta = static_cast<float>(positions[t]);
    for (int32_t j = 0; j < half; ++j, theta *= theta_scale) {
      const float angle = rope_freqs_ ? theta / rope_freqs_[j] : theta;
      const float cs = std::cos(angle), sn = std::sin(angle);
      for (int32_t h = 0; h < n_heads; ++h) {
        float* xh = x + (size_t(t) * n_heads + h) * hd;
        const float a = xh[2 * j], b = xh[2 * j + 1];
        xh[2 * j] = a * cs - b * sn;
        xh[2 * j + 1] = a * sn + b * cs;
      }
    }
  }
}

void Eagle3Head::attention(const Batch& batch, KVCache& kv, const float* q, const float* k, const float* v,
                           float* out) {
  const Eagle3Config& c = config_;
  const int32_t n = batch.size(), hd = c.head_dim, kvd = c.kv_dim(), n_past = kv.n_past();
  const int32_t n_kv = c.n_head_kv, group = c.n_head / n_kv;
  const F16AttentionKernels f16 = mm_.kernels().f16;
  const RowKernels rowk = mm_.kernels().rows;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t slot = n_past + batch.start + i;
    f16.round(k + size_t(i) * kvd, kv.k(0, slot), kvd);
    f16.round(v + size_t(i) * kvd, kv.v(0, slot), kvd);
  }

  // Scratch of each pool thread, grown once to the cache's length.
  ThreadPool& pool = mm_.pool();
  const size_t keys_max = size_t(kv.n_ctx());
  if (act_.scores.size() < size_t(pool.size()) * group * keys_max) {
    act_.scores.assign(size_t(pool.size()) * group * keys_max, 0.0f);
    act_.seen.assign(size_t(pool.size()) * keys_max, 0);
  }

  // One task per (row, KV head): the group's query heads against the keys the row sees, each key
  // and value row read once for the whole group. Row i sees the committed prefix, then of the
  // pending slots [0, batch.start + i] itself and its ancestors (the tree's parent mask).
  const float scale = 1.0f / std::sqrt(float(hd));
  pool.parallel_for(int64_t(n) * n_kv, 1, [&](int64_t begin, int64_t end, int thread) {
    float* scores = act_.scores.data() + size_t(thread) * group * keys_max;  // [group][n_keys]
    uint8_t* seen = act_.seen.data() + size_t(thread) * keys_max;            // [n_keys]
    for (int64_t task = begin; task < end; ++task) {
      const int32_t i = static_cast<int32_t>(task / n_kv), g = static_cast<int32_t>(task % n_kv);
      const int32_t n_pending = batch.start + i + 1, n_keys = n_past + n_pending;
      kv.visible_keys(n_pending - 1, batch.positions[i], /*window=*/0, n_keys, seen);

      const float* q_group = q + (size_t(i) * c.n_head + size_t(g) * group) * hd;  // [group][hd]
      float* out_group = out + (size_t(i) * c.n_head + size_t(g) * group) * hd;    // [group][hd]
      const size_t koff = size_t(g) * hd;
      f16.scores(q_group, hd, group, kv.k(0, 0) + koff, kvd, n_keys, hd, scores, n_keys);
      for (int32_t h = 0; h < group; ++h) rowk.softmax(scores + size_t(h) * n_keys, seen, n_keys, scale);
      f16.weighted_sum(scores, n_keys, group, kv.v(0, 0) + koff, kvd, n_keys, hd, out_group, hd);
    }
  });
}

void Eagle3Head::fuse(const float* features, int32_t n, float* fused) {
  if (n > n_batch_) throw Error("draft head: " + std::to_string(n) + " rows exceed its batch size");
  if (config_.arch == HeadArch::Eagle2) {
    // The target's final norm, with the target's epsilon.
    rms_norm(features, target_norm_, n, config_.n_embd, target_.config().rms_eps, fused);
    return;
  }
  const float* in = features;
  if (config_.norm_before_fc) {
    rms_norm(features, fc_norm_, n, config_.n_features(), config_.rms_eps, act_.features.data());
    in = act_.features.data();
  }
  matmul(mm_, fc_, in, n, fused, fc_.rows);
}

void Eagle3Head::forward(const Batch& batch, const float* g, KVCache& kv, float* prenorm, float* normed) {
  const Eagle3Config& c = config_;
  const int32_t n = batch.size(), H = c.n_embd;
  if (n == 0) throw Error("draft head: empty batch");
  if (n > n_batch_) throw Error("draft head: " + std::to_string(n) + " rows exceed its batch size");
  if (batch.positions.size() != size_t(n) || batch.parents.size() != size_t(n))
    throw Error("draft head: batch positions/parents do not match its tokens");
  if (batch.start < 0 || kv.n_past() + batch.start + n > kv.n_ctx())
    throw Error("draft head: context full (" + std::to_string(kv.n_past() + batch.start + n) + " slots needed, " +
                std::to_string(kv.n_ctx()) + " in the cache)");
  if (kv.n_layer() != 1 || kv.kv_dim() != c.kv_dim()) throw Error("draft head: KV cache was made for another model");
  for (int32_t i = 0; i < n; ++i) {
    const int32_t t = batch.tokens[i], p = batch.parents[i];
    if (t < 0 || t >= token_embd_.rows) throw Error("draft head: token id " + std::to_string(t) + " out of range");
    kv.set_slot_meta(kv.n_past() + batch.start + i, batch.positions[i], p);  // throws unless p is an earlier row
  }

  // Attention input: [attn_norm(embedding) ; attn_norm_2(g)] per row.
  float* embd = act_.embd.data();  // [n][H]
  float* x = act_.x.data();        // [n][2H]
  float* gn = act_.gn.data();      // [n][H]
  for (int32_t i = 0; i < n; ++i)
    dequantize_row(token_embd_.type, token_embd_.data + size_t(batch.tokens[i]) * token_embd_.row_stride,
                   embd + size_t(i) * H, H);
  if (c.arch == HeadArch::Eagle3) {  // [attn_norm(embd) ; attn_norm_2(g)]
    rms_norm(g, hidden_norm_, n, H, config_.rms_eps, gn);
    for (int32_t i = 0; i < n; ++i) {
      rms_norm(embd + size_t(i) * H, embd_norm_, 1, H, config_.rms_eps, x + size_t(i) * 2 * H);
      std::copy_n(gn + size_t(i) * H, H, x + size_t(i) * 2 * H + H);
    }
  } else {  // EAGLE-2: gn = fc([embd ; g]) + bias, the layer's input and residual
    for (int32_t i = 0; i < n; ++i) {
      std::copy_n(embd + size_t(i) * H, H, x + size_t(i) * 2 * H);
      std::copy_n(g + size_t(i) * H, H, x + size_t(i) * 2 * H + H);
    }
    matmul(mm_, fc_, x, n, gn, fc_.rows);
    if (fc_bias_)
      for (int32_t i = 0; i < n; ++i)
        for (int32_t j = 0; j < H; ++j) gn[size_t(i) * H + j] += fc_bias_[j];
  }
  const float* attn_in = c.arch == HeadArch::Eagle3 ? x : gn;  // [n][attn_input()]

  // Attention block, its residual the raw g (or its norm with norm_before_residual).
  float* q = act_.q.data();        // [n][n_head][head_dim]
  float* k = act_.k.data();        // [n][n_head_kv][head_dim]
  float* v = act_.v.data();        // [n][n_head_kv][head_dim]
  float* attn = act_.attn.data();  // [n][q_dim]
  const SharedInputProduct qkv[] = {{&wq_, q, wq_.rows}, {&wk_, k, wk_.rows}, {&wv_, v, wv_.rows}};
  matmul_shared_input(mm_, qkv, attn_in, n);
  rope(q, n, c.n_head, batch.positions.data());
  rope(k, n, c.n_head_kv, batch.positions.data());
  attention(batch, kv, q, k, v, attn);
  matmul(mm_, wo_, attn, n, prenorm, wo_.rows);
  const float* residual = c.arch == HeadArch::Eagle2 ? gn : c.norm_before_residual ? gn : g;
  for (size_t j = 0; j < size_t(n) * H; ++j) prenorm[j] += residual[j];

  // Feed-forward block (SiLU-gated), added onto the stream in prenorm.
  float* rn = act_.rn.data();      // [n][H]
  float* gate = act_.gate.data();  // [n][n_ff]
  float* up = act_.up.data();      // [n][n_ff]
  rms_norm(prenorm, ffn_norm_, n, H, config_.rms_eps, rn);
  const SharedInputProduct gate_up[] = {{&w_gate_, gate, w_gate_.rows}, {&w_up_, up, w_up_.rows}};
  matmul_shared_input(mm_, gate_up, rn, n);
  mm_.kernels().rows.silu_mul(gate, up, int64_t(n) * c.n_ff);
  matmul(mm_, w_down_, gate, n, embd, w_down_.rows);  // embd is free again: the FFN output
  for (size_t j = 0; j < size_t(n) * H; ++j) prenorm[j] += embd[j];

  if (c.arch == HeadArch::Eagle3)
    rms_norm(prenorm, output_norm_, n, H, config_.rms_eps, normed);
  else
    std::copy_n(prenorm, size_t(n) * H, normed);  // EAGLE-2 has no final norm
}

}  // namespace microspec
