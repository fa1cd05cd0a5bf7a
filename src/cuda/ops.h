#pragma once
// Device kernels of the CUDA backend, as host functions that enqueue them on a stream. Every
// pointer here is device memory. Each kernel's oracle is the CPU path (tests/cuda/): the same
// formulas in the same order of rounding wherever that order decides a bit, so that a device
// forward reproduces the CPU forward up to float summation order.
//
// Numerics: quantized weights are dotted with activations quantized exactly as the CPU does
// (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants; same scales, same
// round-half-even), with the same integer block sums; F32/F16 weights take float activations,
// BF16 weights the activations as two BF16 halves on the tensor cores (float accuracy: ops.cu).
// Only the float accumulation across blocks differs from the CPU, so products agree to ~1e-6
// relative (tests allow 1e-4 of the row's scale).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/types.h"
#include "sampling/ranked_draw.h"
#include "speculative/chain_sampling.h"
#include "speculative/chain_state.h"
#include "speculative/tree_sampling.h"
#include "speculative/tree_state.h"
#include "vocab/window_state.h"

namespace microspec::cuda {

// A weight matrix in device memory in its GGUF format: `rows` rows of `cols` elements, row r at
// data + r * row_stride.
struct DeviceMatrix {
  GgmlType type = GgmlType::F32;
  const uint8_t* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_stride = 0;
};

// Whether the device has a matmul kernel for weights of this type.
bool matmul_supported(GgmlType type);
// Bytes of activation scratch a matmul of n_tokens rows of `cols` elements may need.
size_t matmul_scratch_bytes(int64_t n_tokens, int64_t cols);

enum class Store { Overwrite, Accumulate };  // y = W x, or y += W x (residual add fused)

// Where the rows of a product come from: all rows of w in order, or rows row_ids[j] (device
// array of n_rows ids) for a subset of the vocabulary.
struct RowSelection {
  const int32_t* row_ids = nullptr;  // [n_rows] or null: rows 0..n_rows-1
  int64_t n_rows = 0;
};

// y[t * ldy + j] (=|+=) dot(W row id(j), x[t * ldx ..]) for t < n_tokens, j < rows.n_rows.
// Batch invariant for every weight type: token t's outputs are the same bits whatever n_tokens
// and wherever t is in the batch (a decode step and a verification agree; speculation is lossless).
// act_scratch: matmul_scratch_bytes(n_tokens, w.cols) bytes, used for quantized activations.
void matmul(const DeviceMatrix& w, RowSelection rows, const float* x, int64_t ldx, int32_t n_tokens, float* y,
            int64_t ldy, Store store, uint8_t* act_scratch, cudaStream_t stream);

// The same product for BF16 weights on CUDA cores in float, one warp per row: the tensor-core
// kernel matmul() runs for BF16 (whose batch invariance speculation needs) checked against it and
// timed beside it by bench_cuda. Batch invariant too, but not the same bits as matmul()'s.
void matmul_bf16_cuda_cores(const DeviceMatrix& w, RowSelection rows, const float* x, int64_t ldx, int32_t n_tokens,
                            float* y, int64_t ldy, Store store, uint8_t* act_scratch, cudaStream_t stream);

// Quantizes n_tokens rows of cols floats (row t at x + t * ldx) into the activation format `act`
// (Q8_0, Q8_1 or Q8_K) exactly as the CPU's quantizers do; row t at out + t * row_bytes(act, cols).
void quantize_activations(GgmlType act, const float* x, int64_t ldx, int32_t n_tokens, int64_t cols, uint8_t* out,
                          cudaStream_t stream);

// Dequantizes rows ids[i] of w into out[i * w.cols ..], times scale (token embeddings). An id
// outside w's rows (the -1 argmax_rows writes for a row of NaNs, fed on by a device-resident step)
// reads row 0 instead of stray memory; the host finds the -1 among the emitted tokens and reports it.
void gather_rows_f32(const DeviceMatrix& w, const int32_t* ids, int32_t n, float scale, float* out,
                     cudaStream_t stream);

// A set of rows of equal length inside a buffer: row r of group g starts at
// base + g * group_stride + r * dim (per-head norms inside a q|k|v buffer; plain rows: 1 per group).
struct RowGroups {
  int32_t n_groups = 0;
  int32_t rows_per_group = 1;
  int64_t group_stride = 0;
};
// y = x * (1 / sqrt(mean(x^2) + eps)) * weight per row of `dim` floats (x may equal y).
void rms_norm(const float* x, float* y, RowGroups rows, int32_t dim, const float* weight, float eps,
              cudaStream_t stream);

enum class Activation { GeluTanh, Silu };
// h[t][i] = act(gate[t * ld + i]) * up[t * ld + i] for t < n, i < n_ff; h is [n][n_ff].
void gated_activation(const float* gate, const float* up, int64_t ld, int32_t n, int32_t n_ff, Activation act,
                      float* h, cudaStream_t stream);

// A kernel that does nothing, launched the ordinary way (not as a programmatic dependent): the
// kernels after it start only once everything before it on the stream, including work joined from
// other streams through events, is complete. A programmatic dependent may read memory before it
// waits (a matrix product issues its first weight loads early), so one goes after a join whose
// other stream writes such memory (the packed head's gathered rows).
void stream_barrier(cudaStream_t stream);

// x[i] += o[i] for count floats.
void add_inplace(float* x, const float* o, int64_t count, cudaStream_t stream);
// y[t * ld + i] += bias[i] for t < n, i < dim (Qwen2's projection biases).
void add_bias_rows(float* y, int64_t ld, int32_t n, const float* bias, int32_t dim, cudaStream_t stream);
// out[j] = x[rows[j]] for j < n, rows of dim floats (the batch rows whose hidden state is wanted).
void select_rows(const float* x, int32_t dim, const int32_t* rows, int32_t n, float* out, cudaStream_t stream);

// The KV cache on the device: [n_layer][n_ctx][kv_dim] IEEE halves, plus each slot's position and
// parent pending index. n_past lives in device memory so a captured step reads it there.
struct DeviceKV {
  uint16_t* k = nullptr;      // [n_layer][n_ctx][kv_dim]
  uint16_t* v = nullptr;      // [n_layer][n_ctx][kv_dim]
  int32_t* positions = nullptr;  // [n_ctx]
  int32_t* parents = nullptr;    // [n_ctx] parent pending index of each pending slot, -1 = none
  int32_t* n_past = nullptr;     // [1]
  int32_t n_layer = 0, n_ctx = 0, kv_dim = 0;
};

// A batch as the device sees it: n tokens written to pending slots n_past + start + i.
struct DeviceBatch {
  const int32_t* tokens = nullptr;     // [n]
  const int32_t* positions = nullptr;  // [n]
  const int32_t* parents = nullptr;    // [n] pending index of the parent, -1 = committed prefix only
  int32_t n = 0;
  int32_t start = 0;
};

// Records the batch's positions and parents in the cache's slot metadata.
void set_slot_meta(const DeviceKV& kv, const DeviceBatch& batch, cudaStream_t stream);

struct RopeShape {
  int32_t n_head = 0, n_head_kv = 0, head_dim = 0, n_rot = 0;
  bool neox = false;         // pairs (i, i + n_rot/2) instead of (2i, 2i+1)
  float theta_scale = 1.0f;  // base^(-2 / n_rot), computed on the host as the CPU does
};
// RoPE on the q and k heads of a q | k | v buffer (token t's row at qkv + t * ld: n_head q heads,
// then n_head_kv k heads, then n_head_kv v heads), q rotated in place, the rotated k and the v of
// layer il written into the batch's cache slots as halves. One launch for the three steps.
void rope_and_store_kv(float* qkv, int64_t ld, const DeviceKV& kv, int32_t il, const DeviceBatch& batch,
                       RopeShape shape, cudaStream_t stream);

struct AttentionShape {
  int32_t n_head = 0, n_head_kv = 0, head_dim = 0;
  float scale = 1.0f;
  int32_t window = 0;  // 0: full attention; else keys with qpos - pos >= window are masked
};
// out[t][h] = softmax(q·k * scale) v over the committed prefix and the token's ancestors in the
// pending region (itself included). q of token t at q + t * ldq; out is [n][n_head * head_dim].
// q is rounded to halves before the dot products and the probabilities before weighting the
// values, as the CPU does.
void attention(const DeviceKV& kv, int32_t il, const DeviceBatch& batch, const float* q, int64_t ldq,
               AttentionShape shape, float* out, cudaStream_t stream);
// Largest n_ctx attention() takes (its scores live in shared memory).
int32_t attention_max_ctx();
// Lets attention() over a cache of n_ctx slots have the shared memory it needs (a function
// attribute, raised once per process for the largest n_ctx): done when a model is made, so that
// no attention() inside a graph capture has to.
void attention_prepare(int32_t n_ctx);

// Keeps pending slots idx[0..*n_keep) (strictly increasing; both device memory, so a captured
// step reads each step's own) as the next committed tokens: moves their rows in every layer and
// their positions down behind the prefix and adds *n_keep to n_past. All on the device.
void kv_compact(const DeviceKV& kv, const int32_t* idx, const int32_t* n_keep, cudaStream_t stream);
// n_past += n (a sequential batch kept whole).
void kv_advance(const DeviceKV& kv, int32_t n, cudaStream_t stream);

// Device-resident greedy decoding, one token per step. decode_begin after the prompt: the token
// in tokens[0] (the prompt's argmax) is the first generated one: out_ids[0] = tokens[0],
// *counter = 1, and the one-token batch is set to position n_past, parent -1, output row 0.
// decode_advance after each step's argmax into tokens[0]: commits the token just run
// (n_past += 1), records the new one in out_ids[(*counter)++] and moves the position on.
struct DecodeState {
  int32_t* tokens = nullptr;       // [1] token the next step runs
  int32_t* positions = nullptr;    // [1]
  int32_t* parents = nullptr;      // [1]
  int32_t* output_rows = nullptr;  // [1]
  int32_t* out_ids = nullptr;      // [capacity] generated tokens
  int32_t* counter = nullptr;      // [1] tokens in out_ids
};
void decode_begin(const DeviceKV& kv, const DecodeState& st, cudaStream_t stream);
void decode_advance(const DeviceKV& kv, const DecodeState& st, cudaStream_t stream);

// out[r] = first index of the largest non-NaN value of row r (x is [n_rows][n]); -1 if all NaN.
// scratch: [n_rows] (many blocks per row meet there through atomicMax).
void argmax_rows(const float* x, int32_t n_rows, int64_t n, int32_t* out, uint64_t* scratch, cudaStream_t stream);
// *out = the token sampling/ranked_draw.h's draw_ranked picks from one row's k best (ids [k] and
// values [k] as top_k_rows leaves them: best first, -1 / -inf past the row's non-NaN values) with
// the random bits bits[draw ? *draw : 0] (device: one 64-bit RNG output per generated token);
// -1 when the row has no samplable value (every one NaN or -inf). One device thread.
void draw_top_k(const int32_t* ids, const float* values, int32_t k, const DrawSettings* settings,
                const uint64_t* bits, const int32_t* draw, int32_t* out, cudaStream_t stream);
// Rows [first, first + count) of a matrix, or with a list the rows list[first, first + count)
// (a tree's accepted rows), where first, count and list may live in device memory (so a captured
// step reads them when it runs): null first means 0, null count means max_rows; count must not
// exceed max_rows, which sizes the launch.
struct RowRange {
  const int32_t* first = nullptr;
  const int32_t* count = nullptr;
  int32_t max_rows = 1;
  const int32_t* list = nullptr;  // row r is list[first + r]; null: first + r
};
// For each row r of `rows` (row at x + (first + r) * ld): its k largest of n values, best first
// (ties: lower index first; NaN never; -1 and -inf past the non-NaN values), into ids[r * k ..]
// and values[r * k ..]. k <= 64. One block per row, reading the row once.
void top_k_rows(const float* x, int64_t ld, int64_t n, RowRange rows, int32_t k, int32_t* ids, float* values,
                cudaStream_t stream);

// A draft tree's proposals (speculative/tree_state.h): for each of n_rows logits rows (row r at
// logits + r * ld) its k best of the first n values (n_valid: that count in device memory, null
// for n), best first (ties: lower index), each as a token id (ids[index], null: the index itself)
// and its log-softmax over those n values, as tree.h's top_k_logprobs computes them (NaN and -inf
// never chosen; token -1 and log-probability 0 past the values there are). One block per row,
// reading it three times (its maximum, its normaliser, its k best).
void tree_proposals(const float* logits, int64_t ld, int64_t n, const int32_t* n_valid, const int32_t* ids,
                    int32_t n_rows, int32_t k, int32_t* tokens, float* logprobs, cudaStream_t stream);

// MicroSpec's dynamic draft vocabulary on the device: a DraftVocabState (vocab/window_state.h, the
// CPU's algorithm, shared) whose struct and arrays are in device memory. One device thread advances
// it per step (O(tokens appended)), so the host never waits for the window or the slot map.
// window_pin of ids[0, n) (distinct, in range) in one device thread: tokens always active (before
// the first begin, which enters them).
void vocab_pin(DraftVocabState* st, const int32_t* ids, int32_t n, cudaStream_t stream);
// vocab_state_begin in one device thread.
void vocab_begin(DraftVocabState* st, const int32_t* prompt, int32_t n_prompt, const int32_t* prompt_top, int32_t k,
                 int32_t use_k, cudaStream_t stream);
// vocab_state_step in one device thread, its sizes read on the device: update->n_tree tokens of
// tree, then update->n_rows * k ids of tops (top_k_rows' output for the update's rows).
void vocab_step(DraftVocabState* st, const int32_t* tree, const int32_t* tops, const VocabUpdate* update, int32_t k,
                cudaStream_t stream);
// The gather into a packed LM head: copies[i] for i < *n_copies (device count, at most
// max_copies, which sizes the grid) from rows of `full` (src >= 0) or of the packed buffer itself
// (src < 0, as window_state.h's RowCopy says) into packed rows, all at once: no copy of one update
// reads a row another writes.
void gather_packed_rows(const DeviceMatrix& full, const RowCopy* copies, const int32_t* n_copies, int32_t max_copies,
                        uint8_t* rows, cudaStream_t stream);
// out[r] = token_of_slot[the best of the first *n_rows values of logits row r] (row r at
// logits + r * ld; value descending, then slot ascending, NaN never wins), `if_empty` if none.
void packed_argmax(const float* logits, int64_t ld, int32_t n_out, const int32_t* n_rows, const int32_t* token_of_slot,
                   int32_t if_empty, int32_t* out, cudaStream_t stream);

// top_k_rows over a packed LM head's logits: for each of n_out rows (row r at logits + r * ld) the
// k best of its first *n_rows values (the active slots), best first (ties: lower slot), as
// token_of_slot's ids; -1 and -inf past the non-NaN values. k <= 64. One block per row.
void packed_top_k(const float* logits, int64_t ld, int32_t n_out, const int32_t* n_rows, const int32_t* token_of_slot,
                  int32_t k, int32_t* ids, float* values, cudaStream_t stream);

// A speculative chain's bookkeeping (speculative/chain_state.h) in one device thread: chain_begin
// after the prompt, chain_accept after each verification's argmax.
void chain_begin(const ChainState& st, cudaStream_t stream);
void chain_accept(const ChainState& st, cudaStream_t stream);
// Speculative sampling on the chain (speculative/chain_sampling.h) in one device thread: chain_draw
// after draft d's ranked row, chain_sample_accept (in place of chain_accept) after the
// verification's ranked rows.
void chain_draw(const ChainState& st, const ChainSampling& sampling, int32_t d, cudaStream_t stream);
void chain_sample_accept(const ChainState& st, const ChainSampling& sampling, cudaStream_t stream);
// chain_head_caught_up in one device thread, after an EAGLE-3 head's catch-up forward.
void chain_head_caught_up(const ChainState& st, cudaStream_t stream);

// A tree step's bookkeeping (speculative/tree_state.h) on the device: tree_begin after the
// prompt, tree_absorb after draft forward `forward`'s proposals, tree_finish (tree_rank, one
// thread per candidate, then tree_lay_out_verification) after the last, tree_accept after the
// verification's argmax, tree_lay_out_root after the cache's compaction; each in one thread.
void tree_begin(const TreeState& st, cudaStream_t stream);
void tree_absorb(const TreeState& st, int32_t forward, cudaStream_t stream);
void tree_finish(const TreeState& st, cudaStream_t stream);
void tree_accept(const TreeState& st, cudaStream_t stream);
void tree_lay_out_root(const TreeState& st, cudaStream_t stream);
// tree_head_caught_up in one device thread, after an EAGLE-3 head's catch-up forward of a tree step.
void tree_head_caught_up(const TreeState& st, cudaStream_t stream);
// Speculative sampling on the tree (speculative/tree_sampling.h) in one device thread: tree_draw
// after draft forward `forward`'s ranked rows (in place of its proposals), tree_finish_first
// (tree_keep_first, then tree_lay_out_verification) in place of tree_finish, tree_sample_accept in
// place of tree_accept after the verification's ranked rows.
void tree_draw(const TreeState& st, const TreeSampling& sampling, int32_t forward, cudaStream_t stream);
void tree_finish_first(const TreeState& st, cudaStream_t stream);
void tree_sample_accept(const TreeState& st, const TreeSampling& sampling, cudaStream_t stream);

// Fills n values of a 16-bit float type (BF16 or F16) with uniform(-scale, scale) from a hash of
// (seed, index): random weights made on the device for benchmarks.
void fill_random(GgmlType type, void* data, int64_t n, float scale, uint64_t seed, cudaStream_t stream);
void fill_random_f32(float* data, int64_t n, float base, float scale, uint64_t seed, cudaStream_t stream);

}  // namespace microspec::cuda
