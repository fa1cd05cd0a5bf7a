#include "model/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "gguf/gguf.h"
#include "kernels/repack.h"
#include "model/architectures.h"
#include "util/error.h"

namespace microspec {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline float round_f16(float x) {
  return fp16_to_fp32(fp32_to_fp16(x));
}

}  // namespace

void Batch::set_sequence(std::span<const int32_t> toks, int32_t pos0, bool output_all) {
  clear();
  const int32_t n = static_cast<int32_t>(toks.size());
  tokens.assign(toks.begin(), toks.end());
  for (int32_t i = 0; i < n; ++i) {
    positions.push_back(pos0 + i);
    parents.push_back(i - 1);
    if (output_all) output_rows.push_back(i);
  }
  if (!output_all && n > 0) output_rows.push_back(n - 1);
}

std::unique_ptr<Model> Model::load(const GgufFile& file, const ModelOptions& options) {
  ModelConfig config = read_model_config(file);
  switch (config.arch) {
    case Arch::Gemma2:
      return make_gemma2(file, options);
    case Arch::Gemma3:
      return make_gemma3(file, options);
    case Arch::Llama:
    case Arch::Qwen2:
      return make_llama(file, options);
    case Arch::Phi3:
      return make_phi3(file, options);
    case Arch::Qwen3:
      return make_qwen3(file, options);
  }
  throw Error(file.name() + ": unsupported architecture");
}

Model::Model(const GgufFile& file, const ModelOptions& options)
    : config_(read_model_config(file)),
      n_batch_(options.n_batch),
      pool_(options.n_threads),
      mm_(pool_, kernels_by_name(options.kernels)),
      repack_(options.repack) {
  if (options.n_threads < 1) throw Error("thread count must be >= 1");
  if (n_batch_ < 1) throw Error("batch size must be >= 1");
  if (config_.head_dim % 8 != 0)
    throw Error(file.name() + ": head dimension " + std::to_string(config_.head_dim) +
                " is not a multiple of 8");
  token_embd_ = load_matrix(file, "token_embd.weight", config_.n_embd, config_.n_vocab, mm_.kernels());
  output_ = file.find_tensor("output.weight") ? matrix(file, "output.weight", config_.n_embd, config_.n_vocab)
                                              : repacked(token_embd_);
  output_norm_ = vector(file, "output_norm.weight", config_.n_embd);

  const int32_t d = config_.n_embd;
  const size_t B = n_batch_;
  act_.x.assign(B * d, 0.0f);
  act_.xn.assign(B * d, 0.0f);
  act_.q.assign(B * config_.q_dim(), 0.0f);
  act_.k.assign(B * config_.kv_dim(), 0.0f);
  act_.v.assign(B * config_.kv_dim(), 0.0f);
  act_.attn.assign(B * config_.q_dim(), 0.0f);
  act_.o.assign(B * d, 0.0f);
  act_.gate.assign(B * config_.n_ff, 0.0f);
  act_.up.assign(B * config_.n_ff, 0.0f);
  act_.positions.assign(B, 0);
  act_.row_seq.assign(B, 0);
  act_.seq_first_row.assign(B, 0);
  act_.x_fresh.assign(B * d, 0.0f);
  act_.fresh_positions.assign(B, 0);
  act_.fresh_row_seq.assign(B, 0);
  act_.fresh_first_row.assign(B, 0);
  act_.seq_skip.assign(B, 0);
  q16_.assign(size_t(pool_.size()) * config_.head_dim, 0);
  q_rows_.assign(size_t(pool_.size()) * kAttentionRows * config_.head_dim, 0.0f);
  head_out_.assign(size_t(pool_.size()) * kAttentionRows * config_.head_dim, 0.0f);
  attn_blocks_.assign(B + 1, 0);
  mm_.reserve(n_batch_, std::max(config_.n_ff, std::max(config_.q_dim(), d)));
}

KVCache Model::make_cache(int32_t n_ctx) const {
  if (n_ctx < 1) throw Error("context size must be >= 1");
  KVCache kv(config_.n_layer, n_ctx, config_.kv_dim());
  return kv;
}

namespace {

// "[a, b]" for a tensor's dimensions, as the shape errors print them.
std::string shape_text(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

}  // namespace

QMatrix load_matrix(const GgufFile& f, const std::string& name, int64_t cols, int64_t rows,
                    const KernelTable& kernels) {
  const GgufTensor* t = f.find_tensor(name);
  if (!t) throw Error(f.name() + ": missing tensor '" + name + "'");
  if (t->ne.size() != 2 || t->ne[0] != cols || t->ne[1] != rows)
    throw Error(f.name() + ": tensor '" + name + "' has shape " + shape_text(t->ne) + ", expected [" +
                std::to_string(cols) + ", " + std::to_string(rows) + "]");
  if (!kernels.vec_dot[static_cast<uint32_t>(t->type)])
    throw Error(f.name() + ": tensor '" + name + "' has type " + type_name(static_cast<uint32_t>(t->type)) +
                ", which has no matmul kernel");
  QMatrix m;
  m.type = t->type;
  m.data = t->data;
  m.rows = rows;
  m.cols = cols;
  m.row_stride = row_bytes(t->type, cols);
  return m;
}

QMatrix Model::matrix(const GgufFile& f, const std::string& name, int64_t cols, int64_t rows) {
  return repacked(load_matrix(f, name, cols, rows, mm_.kernels()));
}

QMatrix Model::repacked(QMatrix m) {
  return repack_ ? repacked_.add(m, mm_.kernels(), pool_) : m;
}

const float* load_vector(const GgufFile& f, const std::string& name, int64_t n) {
  const GgufTensor* t = f.find_tensor(name);
  if (!t) throw Error(f.name() + ": missing tensor '" + name + "'");
  if (t->type != GgmlType::F32)
    throw Error(f.name() + ": tensor '" + name + "' has type " + type_name(static_cast<uint32_t>(t->type)) +
                ", expected F32");
  if (t->ne.size() != 1 || t->ne[0] != n)
    throw Error(f.name() + ": tensor '" + name + "' has shape " + shape_text(t->ne) + ", expected [" +
                std::to_string(n) + "]");
  // The data section is aligned (>= 32 bytes, checked by the reader), so f32 access is aligned.
  return reinterpret_cast<const float*>(t->data);
}

QMatrix matrix_rows(const QMatrix& m, int64_t first, int64_t count) {
  if (first < 0 || count < 0 || first + count > m.rows)
    throw Error("matrix_rows: rows [" + std::to_string(first) + ", " + std::to_string(first + count) +
                ") outside a matrix of " + std::to_string(m.rows) + " rows");
  QMatrix v = m;
  v.data = m.data + size_t(first) * m.row_stride;
  v.rows = count;
  // The interleaved copy serves the view when the view starts a tile (its last tile may hold rows
  // past it: the kernels store only the rows asked for).
  const bool tile_start = m.interleaved && m.interleaved_of == m.data && first % kInterleavedRows == 0;
  v.interleaved =
      tile_start ? m.interleaved + size_t(first / kInterleavedRows) * interleaved_tile_bytes(m.type, m.cols)
                 : nullptr;
  v.interleaved_of = tile_start ? v.data : nullptr;
  return v;
}

const float* Model::vector(const GgufFile& f, const std::string& name, int64_t n, bool required) const {
  if (!required && !f.find_tensor(name)) return nullptr;
  return load_vector(f, name, n);
}

void Model::matmul(const QMatrix& w, const float* x, int32_t n, float* y) {
  microspec::matmul(mm_, w, x, n, y, w.rows);
}

void Model::project_qkv(const QMatrix& wq, const QMatrix& wk, const QMatrix& wv, const float* xn, int32_t n,
                        float* q, float* k, float* v) {
  const SharedInputProduct qkv[] = {{&wq, q, wq.rows}, {&wk, k, wk.rows}, {&wv, v, wv.rows}};
  matmul_shared_input(mm_, qkv, xn, n);
}

template <class F>
void Model::for_rows(int64_t n_rows, int64_t row_elems, F&& f) {
  // Per-element work: on the pool only when there is enough of it to pay for the wakeup.
  constexpr int64_t kParallelElems = 1 << 15;
  if (n_rows < 2 || n_rows * row_elems < kParallelElems) return f(0, n_rows);
  pool_.parallel_for(n_rows, 1, [&](int64_t begin, int64_t end, int) { f(begin, end); });
}

void Model::gated_ffn(const QMatrix& w_gate, const QMatrix& w_up, const QMatrix& w_down, Activation act,
                      const float* xn, int32_t n, float* gate, float* up, float* out) {
  const SharedInputProduct gate_up[] = {{&w_gate, gate, w_gate.rows}, {&w_up, up, w_up.rows}};
  matmul_shared_input(mm_, gate_up, xn, n);
  const size_t n_ff = config_.n_ff;
  const GatedActivationFn activate =
      act == Activation::GeluTanh ? mm_.kernels().rows.gelu_tanh_mul : mm_.kernels().rows.silu_mul;
  for_rows(n, n_ff, [&](int64_t begin, int64_t end) {
    activate(gate + size_t(begin) * n_ff, up + size_t(begin) * n_ff, (end - begin) * int64_t(n_ff));
  });
  matmul(w_down, gate, n, out);
}

void Model::add_block_output(const float* block_out, int32_t n, float* x) const {
  const size_t count = size_t(n) * config_.n_embd;
  for (size_t i = 0; i < count; ++i) x[i] += block_out[i];
}

void Model::rms_norm(const float* x, const float* weight, int32_t n_rows, int32_t dim, float* y) {
  const RmsNormFn norm = mm_.kernels().rows.rms_norm;
  for_rows(n_rows, dim, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm(x + size_t(r) * dim, weight, dim, config_.rms_eps, y + size_t(r) * dim);
  });
}

Model::RopeSpec Model::rope_spec(int32_t il, const float* freq_factors) const {
  const bool sliding = config_.layer_is_sliding[il];
  return RopeSpec{.base = sliding ? config_.rope_base_local : config_.rope_base,
                  .freq_scale = sliding ? config_.rope_freq_scale_local : config_.rope_freq_scale,
                  .freq_factors = freq_factors,
                  .attn_factor = config_.rope_attn_factor};
}

void Model::rope(float* x, int32_t n, int32_t n_heads, const int32_t* positions, const RopeSpec& spec) {
  const int32_t hd = config_.head_dim, half = config_.n_rot / 2;
  const bool neox = config_.rope_style == RopeStyle::Neox;
  // theta_j = pos * base^(-2j / n_rot), built up by repeated multiplication as ggml does, then
  // divided by the frequency factor and multiplied by the linear scale.
  const float theta_scale = std::pow(spec.base, -2.0f / config_.n_rot);
  for_rows(n, int64_t(n_heads) * hd, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float theta_base = static_cast<float>(positions[t]);
      for (int32_t j = 0; j < half; ++j, theta_base *= theta_scale) {
        const float theta =
            (spec.freq_factors ? theta_base / spec.freq_factors[j] : theta_base) * spec.freq_scale;
        const float c = std::cos(theta) * spec.attn_factor, s = std::sin(theta) * spec.attn_factor;
        for (int32_t h = 0; h < n_heads; ++h) {
          float* xh = x + (size_t(t) * n_heads + h) * hd;
          const int32_t i0 = neox ? j : 2 * j, i1 = neox ? j + half : 2 * j + 1;
          const float a = xh[i0], b = xh[i1];
          xh[i0] = a * c - b * s;
          xh[i1] = a * s + b * c;
        }
      }
    }
  });
}

void Model::soft_cap(float* x, size_t count, float cap) {
  if (cap == 0.0f) return;
  const float inv = 1.0f / cap;
  for (size_t i = 0; i < count; ++i) x[i] = cap * std::tanh(x[i] * inv);
}

void Model::attention(int32_t il, const ForwardRows& rows, const float* q, const float* k, const float* v,
                      float* out) {
  const int32_t n = rows.n, hd = config_.head_dim, kvd = config_.kv_dim();
  const int32_t n_kv = config_.n_head_kv, group = config_.n_head / n_kv;
  const F16AttentionKernels f16 = mm_.kernels().f16;
  const RowKernels rowk = mm_.kernels().rows;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t s = rows.row_seq[i];
    const SequenceForward& seq = rows.seqs[s];
    const int32_t slot = seq.kv->n_past() + seq.batch->start + rows.local(i);
    f16.round(k + size_t(i) * kvd, seq.kv->k(il, slot), kvd);
    f16.round(v + size_t(i) * kvd, seq.kv->v(il, slot), kvd);
  }

  // The tasks: blocks of up to max_queries consecutive rows of one sequence, times the KV heads,
  // times parts of a group's heads. Blocks shrink to one query, and groups split, until there are
  // two tasks per pool thread where the rows allow it (a decode step: one task per part).
  const int32_t threads = pool_.size();
  const int32_t heads_per_part_max = std::min(group, kAttentionRows);
  const int32_t max_queries = std::clamp(n * n_kv / (2 * threads), 1, kAttentionRows / heads_per_part_max);
  int32_t n_blocks = 0;
  for (int32_t i = 0; i < n; ++i)
    if (i == 0 || rows.row_seq[i] != rows.row_seq[i - 1] || i - attn_blocks_[n_blocks - 1] == max_queries)
      attn_blocks_[n_blocks++] = i;
  attn_blocks_[n_blocks] = n;
  const int32_t min_parts = (group + heads_per_part_max - 1) / heads_per_part_max;
  const int32_t parts_wanted =
      std::clamp((2 * threads + n_blocks * n_kv - 1) / (n_blocks * n_kv), min_parts, group);
  const int32_t heads_per_part = (group + parts_wanted - 1) / parts_wanted;
  const int32_t parts = (group + heads_per_part - 1) / heads_per_part;  // none of them empty

  const int32_t window = config_.layer_is_sliding[il] ? config_.sliding_window : 0;
  const size_t scores_per_thread = scores_.size() / pool_.size();
  const size_t seen_per_thread = seen_.size() / pool_.size();
  const size_t weights16_per_thread = weights16_.size() / pool_.size();
  const float cap = config_.attn_softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;

  pool_.parallel_for(int64_t(n_blocks) * n_kv * parts, 1, [&](int64_t begin, int64_t end, int thread) {
    float* scores = scores_.data() + size_t(thread) * scores_per_thread;
    uint8_t* seen_keys = seen_.data() + size_t(thread) * seen_per_thread;
    uint16_t* q16 = q16_.data() + size_t(thread) * hd;
    uint16_t* weights16 = weights16_.data() + size_t(thread) * weights16_per_thread;
    float* q_rows = q_rows_.data() + size_t(thread) * kAttentionRows * hd;
    float* head_out = head_out_.data() + size_t(thread) * kAttentionRows * hd;
    for (int64_t task = begin; task < end; ++task) {
      const int32_t block = static_cast<int32_t>(task / (n_kv * parts));
      const int32_t g = static_cast<int32_t>(task / parts % n_kv), part = static_cast<int32_t>(task % parts);
      const int32_t h0 = g * group + part * heads_per_part;
      const int32_t nh = std::min(heads_per_part, group - part * heads_per_part);
      const int32_t i0 = attn_blocks_[block], nq = attn_blocks_[block + 1] - i0, nr = nq * nh;
      // Rows i0.. are tokens local0.. of one sequence, which attend to its own cache only.
      const SequenceForward& seq = rows.seqs[rows.row_seq[i0]];
      const KVCache& kv = *seq.kv;
      const int32_t n_past = kv.n_past(), pending0 = seq.batch->start + rows.local(i0);
      const int32_t n_pending = pending0 + nq;  // pending slots [0, n_pending) may be seen
      const int32_t n_keys = n_past + n_pending;

      // 1. Which keys each query sees: the committed ones within its window, then of the pending
      // ones itself and its chain of ancestors (within its window too).
      for (int32_t j = 0; j < nq; ++j)
        kv.visible_keys(pending0 + j, rows.positions[i0 + j], window, n_keys, seen_keys + size_t(j) * n_keys);
      // Keys before the first one some query sees are left out (they weigh nothing for anyone).
      int32_t first = n_keys;
      for (int32_t j = 0; j < nq; ++j) {
        const uint8_t* seen = seen_keys + size_t(j) * n_keys;
        first = int32_t(std::find(seen, seen + first, uint8_t(1)) - seen);  // every query sees itself
      }
      const int32_t keys = n_keys - first;

      // 2. The task's query heads, row r = (query r / nh, head h0 + r % nh), rounded to half floats
      // for the dot products with the half-float keys, as llama.cpp does.
      for (int32_t r = 0; r < nr; ++r) {
        f16.round(q + (size_t(i0 + r / nh) * config_.n_head + h0 + r % nh) * hd, q16, hd);
        f16.widen(q16, q_rows + size_t(r) * hd, hd);
      }
      const int32_t koff = (h0 / group) * hd;
      f16.scores(q_rows, hd, nr, kv.k(il, first) + koff, kvd, keys, hd, scores, keys);

      // 3. Softmax per row over the keys it sees, in key order; the weights are rounded to half
      // floats before weighting the half-float values (llama.cpp's order of rounding), and the
      // keys a row does not see weigh exactly 0, which the weighted sum skips.
      for (int32_t r = 0; r < nr; ++r) {
        float* row = scores + size_t(r) * keys;
        const uint8_t* seen = seen_keys + size_t(r / nh) * n_keys + first;
        if (cap > 0.0f) {  // Gemma 2's attention soft-capping, before the softmax (then of scale 1)
          for (int32_t j = 0; j < keys; ++j)
            if (seen[j]) row[j] = cap * std::tanh(row[j] * config_.attn_scale * inv_cap);
        }
        rowk.softmax(row, seen, keys, cap > 0.0f ? 1.0f : config_.attn_scale);
        const int32_t whole = keys / 8 * 8;  // the kernels' multiple of 8; the rest one by one
        f16.round(row, weights16, whole);
        f16.widen(weights16, row, whole);
        for (int32_t j = whole; j < keys; ++j) row[j] = round_f16(row[j]);
      }
      f16.weighted_sum(scores, keys, nr, kv.v(il, first) + koff, kvd, keys, hd, head_out, hd);
      for (int32_t r = 0; r < nr; ++r)
        std::memcpy(out + (size_t(i0 + r / nh) * config_.n_head + h0 + r % nh) * hd,
                    head_out + size_t(r) * hd, sizeof(float) * hd);
    }
  });
}

void Model::forward(const Batch& batch, KVCache& kv, ForwardOutput& out, const ForwardOptions& options) {
  const SequenceForward seq{.batch = &batch, .kv = &kv, .out = &out};
  forward(std::span<const SequenceForward>(&seq, 1), options);
}

// Checks one sequence of a forward call against its cache and records its tokens' slot metadata.
void Model::check_sequence(const SequenceForward& seq) const {
  if (!seq.batch || !seq.kv || !seq.out) throw Error("forward: a sequence lacks its batch, cache or output");
  const Batch& batch = *seq.batch;
  KVCache& kv = *seq.kv;
  const int32_t n = batch.size();
  if (seq.resumed_rows < 0 || seq.resumed_rows > batch.size() || (seq.resumed_rows > 0 && !seq.resumed))
    throw Error("forward: resumed rows " + std::to_string(seq.resumed_rows) + " of a sequence of " +
                std::to_string(batch.size()) + " tokens, or without their streams");
  if (seq.resumed_rows > 0 && (seq.resumed_layer < 1 || seq.resumed_layer > config_.n_layer))
    throw Error("forward: resumed rows need a call from layer 0 and a resumed layer in [1, " +
                std::to_string(config_.n_layer) + "], got " + std::to_string(seq.resumed_layer));
  if (n == 0) throw Error("forward: empty batch");
  if (batch.positions.size() != size_t(n) || batch.parents.size() != size_t(n))
    throw Error("forward: batch positions/parents do not match its tokens");
  if (batch.start < 0 || kv.n_past() + batch.start + n > kv.n_ctx())
    throw Error("context full: " + std::to_string(kv.n_past() + batch.start + n) +
                " tokens needed, context size is " + std::to_string(kv.n_ctx()));
  if (kv.n_layer() != config_.n_layer || kv.kv_dim() != config_.kv_dim())
    throw Error("forward: KV cache was made for another model");
  for (int32_t i = 0; i < n; ++i) {
    const int32_t t = batch.tokens[i], p = batch.parents[i];
    if (t < 0 || t >= config_.n_vocab)
      throw Error("forward: token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                  std::to_string(config_.n_vocab - 1) + ")");
    if (p < -1 || p >= batch.start + i)
      throw Error("forward: parent of token " + std::to_string(i) + " is not written yet");
    if (batch.positions[i] < 0) throw Error("forward: negative position");
  }
  for (int32_t r : batch.output_rows)
    if (r < 0 || r >= n) throw Error("forward: output row out of range");
  if (seq.logits_from < 0 || seq.logits_from > int32_t(batch.output_rows.size()))
    throw Error("forward: logits from output row " + std::to_string(seq.logits_from) + " of " +
                std::to_string(batch.output_rows.size()));
}

void Model::forward(std::span<const SequenceForward> seqs, const ForwardOptions& options) {
  const ForwardCall call = check_call(seqs, options);  // every check before anything is written
  const RowTables tables{.positions = act_.positions.data(),
                         .row_seq = act_.row_seq.data(),
                         .seq_first_row = act_.seq_first_row.data()};
  lay_out_rows(seqs, tables);
  reserve_attention_scratch(seqs);
  float* x = act_.x.data();
  embed_tokens(seqs, tables.seq_first_row, x);
  const ForwardRows rows{.n = call.n_rows,
                         .positions = tables.positions,
                         .seqs = seqs,
                         .row_seq = tables.row_seq,
                         .seq_first_row = tables.seq_first_row};
  if (call.resumed_layer > 0) run_fresh_rows(seqs, call.resumed_layer, x);
  run_layers_capturing(rows, call.resumed_layer, call.end_layer, options.capture_layers, x);
  write_outputs(rows, x);
  if (options.logits) logits_of_outputs(seqs, head_hidden_, head_logits_);
}

Model::ForwardCall Model::check_call(std::span<const SequenceForward> seqs,
                                     const ForwardOptions& options) const {
  if (seqs.empty()) throw Error("forward: no sequence");
  ForwardCall call;
  call.end_layer =
      options.end_layer < 0 || options.end_layer > config_.n_layer ? config_.n_layer : options.end_layer;
  int64_t n_total = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    check_sequence(seqs[s]);
    if (seqs[s].resumed_rows > 0) {
      if (call.resumed_layer != 0 && seqs[s].resumed_layer != call.resumed_layer)
        throw Error("forward: the sequences of one call resume at different layers (" +
                    std::to_string(call.resumed_layer) + " and " + std::to_string(seqs[s].resumed_layer) +
                    ")");
      call.resumed_layer = seqs[s].resumed_layer;
    }
    for (size_t t = 0; t < s; ++t)
      if (seqs[t].kv == seqs[s].kv) throw Error("forward: two sequences of one call share a KV cache");
    n_total += seqs[s].batch->size();
  }
  if (call.resumed_layer > call.end_layer)
    throw Error("forward: rows resumed after layer " + std::to_string(call.resumed_layer) +
                ", past the call's last layer " + std::to_string(call.end_layer));
  if (call.resumed_layer > 0 && !options.capture_layers.empty() &&
      options.capture_layers.front() < call.resumed_layer)
    throw Error("forward: a capture layer before the resumed layer " + std::to_string(call.resumed_layer));
  if (n_total > n_batch_)
    throw Error("forward: batch of " + std::to_string(n_total) + " tokens exceeds n_batch " +
                std::to_string(n_batch_));
  call.n_rows = static_cast<int32_t>(n_total);
  return call;
}

void Model::lay_out_rows(std::span<const SequenceForward> seqs, const RowTables& tables) {
  int32_t row = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const Batch& batch = *seqs[s].batch;
    KVCache& kv = *seqs[s].kv;
    tables.seq_first_row[s] = row;
    for (int32_t i = 0; i < batch.size(); ++i, ++row) {
      kv.set_slot_meta(kv.n_past() + batch.start + i, batch.positions[i], batch.parents[i]);
      tables.positions[row] = batch.positions[i];
      tables.row_seq[row] = static_cast<int32_t>(s);
    }
  }
}

void Model::reserve_attention_scratch(std::span<const SequenceForward> seqs) {
  size_t need_scores = 0, need_seen = 0;
  for (const SequenceForward& seq : seqs) {
    need_scores = std::max(need_scores, size_t(seq.kv->n_ctx()) + n_batch_);
    need_seen = std::max(need_seen, size_t(seq.kv->n_ctx()));
  }
  // Attention scratch grows once to the largest cache seen (caches are made once per session).
  if (scores_.size() < pool_.size() * kAttentionRows * need_scores)
    scores_.assign(pool_.size() * kAttentionRows * need_scores, 0.0f);
  if (weights16_.size() < pool_.size() * need_scores) weights16_.assign(pool_.size() * need_scores, 0);
  if (seen_.size() < pool_.size() * kAttentionRows * need_seen)
    seen_.assign(pool_.size() * kAttentionRows * need_seen, 0);
}

void Model::embed_tokens(std::span<const SequenceForward> seqs, const int32_t* seq_first_row,
                         float* x) const {
  const int32_t d = config_.n_embd;
  const QMatrix& e = token_embd_;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const Batch& batch = *seqs[s].batch;
    float* xs = x + size_t(seq_first_row[s]) * d;
    for (int32_t i = 0; i < batch.size(); ++i) {
      dequantize_row(e.type, e.data + size_t(batch.tokens[i]) * e.row_stride, xs + size_t(i) * d, d);
      if (config_.embed_scale != 1.0f)
        for (int32_t j = 0; j < d; ++j) xs[size_t(i) * d + j] *= config_.embed_scale;
    }
  }
}

void Model::write_outputs(const ForwardRows& rows, const float* x) {
  const int32_t d = config_.n_embd;
  for (size_t s = 0; s < rows.seqs.size(); ++s) {
    const Batch& batch = *rows.seqs[s].batch;
    ForwardOutput& out = *rows.seqs[s].out;
    const int32_t n_out = static_cast<int32_t>(batch.output_rows.size());
    const float* xs = x + size_t(rows.seq_first_row[s]) * d;
    out.n_rows = n_out;
    out.residual.resize(size_t(n_out) * d);
    out.hidden.resize(size_t(n_out) * d);
    for (int32_t j = 0; j < n_out; ++j)
      std::memcpy(out.residual.data() + size_t(j) * d, xs + size_t(batch.output_rows[j]) * d,
                  sizeof(float) * d);
    rms_norm(out.residual.data(), output_norm_, n_out, d, out.hidden.data());
  }
}

void Model::logits_of_outputs(std::span<const SequenceForward> seqs, std::vector<float>& head_hidden,
                              std::vector<float>& head_logits) {
  const int32_t d = config_.n_embd;
  const size_t V = config_.n_vocab;
  // The rows that get logits: each sequence's output rows from its logits_from on.
  int32_t n_total = 0;
  for (const SequenceForward& seq : seqs) n_total += seq.out->n_rows - seq.logits_from;
  if (seqs.size() == 1) {  // straight into the sequence's output
    ForwardOutput& out = *seqs[0].out;
    out.logits.resize(size_t(n_total) * V);
    if (n_total > 0) lm_head(out.hidden.data() + size_t(seqs[0].logits_from) * d, n_total, out.logits.data());
    return;
  }
  head_hidden.resize(size_t(n_total) * d);
  head_logits.resize(size_t(n_total) * V);
  int32_t at = 0;
  for (const SequenceForward& seq : seqs) {
    const int32_t n = seq.out->n_rows - seq.logits_from;
    std::memcpy(head_hidden.data() + size_t(at) * d, seq.out->hidden.data() + size_t(seq.logits_from) * d,
                sizeof(float) * size_t(n) * d);
    at += n;
  }
  if (n_total > 0) lm_head(head_hidden.data(), n_total, head_logits.data());
  at = 0;
  for (const SequenceForward& seq : seqs) {
    const int32_t n = seq.out->n_rows - seq.logits_from;
    seq.out->logits.assign(head_logits.data() + size_t(at) * V, head_logits.data() + size_t(at + n) * V);
    at += n;
  }
}

void Model::run_fresh_rows(std::span<const SequenceForward> seqs, int32_t layer, float* x) {
  // The fresh rows (every row but the resumed ones), packed, through layers [0, layer).
  const int32_t d = config_.n_embd;
  int32_t n_fresh = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int32_t skip = seqs[s].resumed_rows, n_s = seqs[s].batch->size();
    act_.seq_skip[s] = skip;
    act_.fresh_first_row[s] = n_fresh;
    const int32_t first = act_.seq_first_row[s];
    for (int32_t i = skip; i < n_s; ++i, ++n_fresh) {
      std::memcpy(act_.x_fresh.data() + size_t(n_fresh) * d, x + size_t(first + i) * d, sizeof(float) * d);
      act_.fresh_positions[n_fresh] = act_.positions[first + i];
      act_.fresh_row_seq[n_fresh] = static_cast<int32_t>(s);
    }
  }
  if (n_fresh > 0) {
    const ForwardRows fresh{.n = n_fresh,
                            .positions = act_.fresh_positions.data(),
                            .seqs = seqs,
                            .row_seq = act_.fresh_row_seq.data(),
                            .seq_first_row = act_.fresh_first_row.data(),
                            .seq_skip = act_.seq_skip.data()};
    run_layers(fresh, 0, layer, act_.x_fresh.data());
  }
  // Every row's stream after `layer` layers, in the call's layout: resumed ones, then fresh ones.
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int32_t skip = seqs[s].resumed_rows, n_s = seqs[s].batch->size(), first = act_.seq_first_row[s];
    if (skip > 0) std::memcpy(x + size_t(first) * d, seqs[s].resumed, sizeof(float) * size_t(skip) * d);
    if (n_s > skip)
      std::memcpy(x + size_t(first + skip) * d, act_.x_fresh.data() + size_t(act_.fresh_first_row[s]) * d,
                  sizeof(float) * size_t(n_s - skip) * d);
  }
}

void Model::run_layers_capturing(const ForwardRows& rows, int32_t first, int32_t end,
                                 std::span<const int32_t> capture, float* x) {
  const int32_t d = config_.n_embd, n_capture = static_cast<int32_t>(capture.size());
  int32_t at = first;
  for (int32_t c = 0; c < n_capture; ++c)
    if (capture[c] < at || capture[c] > end)
      throw Error("forward: capture layer " + std::to_string(capture[c]) + " outside [" + std::to_string(at) +
                  ", " + std::to_string(end) +
                  "] (capture layers must be non-decreasing within the layers run)");
    else
      at = capture[c];
  for (const SequenceForward& seq : rows.seqs)
    seq.out->layer_inputs.resize(seq.batch->output_rows.size() * size_t(n_capture) * d);
  // Layers are per token, so running them in segments gives bitwise the same stream.
  at = first;
  for (int32_t c = 0; c < n_capture; ++c) {
    run_layers(rows, at, capture[c], x);
    at = capture[c];
    for (size_t s = 0; s < rows.seqs.size(); ++s) {
      const std::vector<int32_t>& out_rows = rows.seqs[s].batch->output_rows;
      const float* xs = x + size_t(rows.seq_first_row[s]) * d;
      for (size_t j = 0; j < out_rows.size(); ++j)
        std::memcpy(rows.seqs[s].out->layer_inputs.data() + (j * n_capture + c) * d,
                    xs + size_t(out_rows[j]) * d, sizeof(float) * d);
    }
  }
  run_layers(rows, at, end, x);
}

void Model::lm_head(const float* hidden, int32_t n, float* logits) {
  const auto t0 = Clock::now();
  microspec::matmul(mm_, output_, hidden, n, logits, output_.rows);
  soft_cap(logits, size_t(n) * output_.rows, config_.final_softcap);
  timings_.lm_head_seconds += seconds_since(t0);
}

void Model::lm_head_rows(const float* hidden, int32_t n, const int32_t* rows, int32_t n_rows, float* logits) {
  for (int32_t j = 0; j < n_rows; ++j)
    if (rows[j] < 0 || rows[j] >= config_.n_vocab) throw Error("lm_head_rows: row id out of range");
  const auto t0 = Clock::now();
  microspec::matmul_rows(mm_, output_, rows, n_rows, hidden, n, logits, n_rows);
  soft_cap(logits, size_t(n) * n_rows, config_.final_softcap);  // as lm_head, so drafts see the same logits
  timings_.lm_head_seconds += seconds_since(t0);
}

void Model::lm_head_packed(const float* hidden, int32_t n, const QMatrix& packed, float* logits) {
  if (packed.type != output_.type || packed.cols != output_.cols || packed.row_stride != output_.row_stride)
    throw Error("lm_head_packed: rows are not in the LM head's format");
  const auto t0 = Clock::now();
  microspec::matmul(mm_, packed, hidden, n, logits, packed.rows);
  soft_cap(logits, size_t(n) * packed.rows, config_.final_softcap);
  timings_.lm_head_seconds += seconds_since(t0);
}

}  // namespace microspec
