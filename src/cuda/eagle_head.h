#pragma once
// An EAGLE-3 draft head on the GPU: draft_head/eagle3_head.h's head (the same metadata, read by
// read_eagle3_config, and the same forward), its weights uploaded once and its cache in device
// memory, for the CUDA backend's device-resident speculative chain (CudaModel::generate_speculative
// with SpecChainOptions::draft_head). The chain step's shape and bookkeeping are chain_state.h's
// (HeadBatch): a catch-up forward over the last verification's rows, then one row per draft.
//
// One row's forward, as on the CPU:
//   g  = fc(norm_fc(features)) (features: the target's residual stream entering its three layers)
//        or the previous row's prenorm output
//   x  = [attn_norm(embed(token)) ; attn_norm_2(g)]                               (2H)
//   r  = Wo attention(rope(Wq x), rope(Wk x), Wv x) + (norm_before_residual ? attn_norm_2(g) : g)
//   h  = r + Wdown(silu(Wgate ffn_norm(r)) * Wup ffn_norm(r))                    (prenorm)
//   normed = output_norm(h), scored by the target's LM head (through the draft vocabulary)
//
// The device runs what this project's heads are: EAGLE-3 without an own LM head (d2t) and without
// rope_freqs; other heads are refused by name (device_head_unsupported) and run on the CPU.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/ops.h"
#include "draft_head/eagle3_head.h"
#include "speculative/chain_state.h"

namespace microspec {
class GgufFile;
}

namespace microspec::cuda {

// Why the device cannot run head file f (empty: it can): an EAGLE-2 head, an own LM head, RoPE
// frequency factors, weights of a type without a device kernel.
std::string device_head_unsupported(const GgufFile& f);

// Which target layers' inputs a forward copies out, and where: [n rows][layers.size()][n_embd].
struct FeatureCapture {
  std::vector<int32_t> layers;  // non-decreasing, in [0, n_layer]; n_layer: the stream after the last layer
  float* rows = nullptr;
};

class DeviceEagleHead {
 public:
  // f: an eagle3 head for a target of target_config whose token embeddings (device) it shares
  // unless it has its own; its shapes are checked (read_eagle3_config) and every weight finite.
  // max_rows: most rows one forward takes (a chain step's depth + 1, a prompt chunk); n_ctx: its
  // cache (the target's context); max_prompt: longest prompt whose features it keeps.
  DeviceEagleHead(const GgufFile& f, const ModelConfig& target_config, const DeviceMatrix& target_embd,
                  int32_t max_rows, int32_t n_ctx, int32_t max_prompt, cudaStream_t stream);
  // A head of config's shapes (EAGLE-3, no own LM head) with weights drawn at random on the device
  // in `type` (BF16 or F16), norms near 1: for benchmarks of real shapes without a file.
  static std::unique_ptr<DeviceEagleHead> random(const Eagle3Config& config, const DeviceMatrix& target_embd,
                                                 GgmlType type, uint64_t seed, int32_t max_rows, int32_t n_ctx,
                                                 int32_t max_prompt, cudaStream_t stream);
  ~DeviceEagleHead();
  DeviceEagleHead(const DeviceEagleHead&) = delete;
  DeviceEagleHead& operator=(const DeviceEagleHead&) = delete;

  const Eagle3Config& config() const { return config_; }
  int32_t max_rows() const { return max_rows_; }
  int32_t max_prompt() const { return max_prompt_; }
  uint64_t serial() const { return serial_; }
  const DeviceKV& kv() const { return kv_; }

  // Runs batch (device arrays; its rows written to the head's pending slots n_past + start + i) on
  // stream: hidden inputs g ([n][H], device), or, with g null, fused from features
  // ([n][n_features], the target's). Leaves prenorm() and normed() ([n][H]).
  void enqueue_forward(const DeviceBatch& batch, const float* features, const float* g, cudaStream_t stream);
  const float* prenorm() const { return prenorm_; }
  const float* normed() const { return normed_; }

  // The prompt's rows (features at i with prompt token i + 1, i < prompt.size() - 1) into an empty
  // cache, committed, from the features the prefill captured (prompt_capture()).
  void begin(std::span<const int32_t> prompt, cudaStream_t stream);
  // Where a prefill leaves the prompt's features ([max_prompt][n_features]) and a verification
  // its rows' ([max_rows][n_features]: the next catch-up's).
  const FeatureCapture& prompt_capture() const { return prompt_capture_; }
  const FeatureCapture& step_capture() const { return step_capture_; }
  // The chain step's arrays (chain_state.h) and what the step passes between its rows.
  HeadBatch batch_arrays() const;
  float* step_g() const { return step_g_; }            // [H] the hidden input of the next draft row
  float* step_hidden() const { return step_hidden_; }  // [H] the normed row the draft LM head scores
  // After begin(): the first catch-up is the prompt's last features (row 0) with the token the
  // prompt's argmax left in first_token (device), its other rows finite placeholders; pred: a
  // chain's catch-up token array ([rows], where the verification's argmax goes; rows <= max_rows()
  // and the array's length). A tree's catch-up reads its own tokens (tree_begin): it passes 1 row.
  void prepare_first_catch_up(int32_t n_prompt, const int32_t* first_token, int32_t* pred, int32_t rows,
                              cudaStream_t stream);

 private:
  DeviceEagleHead(int32_t max_rows, int32_t n_ctx, int32_t max_prompt);
  void upload(const GgufFile& f, const ModelConfig& target_config, const DeviceMatrix& target_embd,
              cudaStream_t stream);
  void allocate(cudaStream_t stream);
  // y = W x for the parts of a stacked matrix (rows of each part after the previous one's).
  void project(const std::vector<DeviceMatrix>& parts, const float* x, int64_t ldx, int32_t n, float* y, int64_t ldy,
               cudaStream_t stream);

  Eagle3Config config_;
  int32_t max_rows_, n_ctx_, max_prompt_;
  DeviceAllocations memory_;

  // Weights (device).
  DeviceMatrix fc_;                       // [H rows][n_features]
  const float* fc_norm_ = nullptr;        // [n_features] (norm_before_fc only)
  DeviceMatrix token_embd_;               // [n_vocab rows][H]: its own or the target's
  const float* embd_norm_ = nullptr;      // [H] attn_norm
  const float* hidden_norm_ = nullptr;    // [H] attn_norm_2
  std::vector<DeviceMatrix> qkv_;         // [q_dim + 2 kv_dim rows][2H], in parts of one type
  DeviceMatrix wo_;                       // [H rows][q_dim]
  const float* ffn_norm_ = nullptr;       // [H]
  std::vector<DeviceMatrix> gate_up_;     // [2 n_ff rows][H], in parts of one type
  DeviceMatrix w_down_;                   // [H rows][n_ff]
  const float* output_norm_ = nullptr;    // [H]

  // Cache and activations (device), sized for max_rows rows.
  DeviceKV kv_;                           // one layer, n_ctx slots
  int32_t qkv_dim_ = 0;
  float* fnorm_ = nullptr;                // [max_rows][n_features] normed features
  float* g_ = nullptr;                    // [max_rows][H] fused hidden inputs
  float* embd_ = nullptr;                 // [max_rows][H]
  float* gn_ = nullptr;                   // [max_rows][H] attn_norm_2(g)
  float* x_ = nullptr;                    // [max_rows][2H] attention input
  float* qkv_buf_ = nullptr;              // [max_rows][qkv_dim]
  float* attn_ = nullptr;                 // [max_rows][q_dim]
  float* prenorm_ = nullptr;              // [max_rows][H]
  float* rn_ = nullptr;                   // [max_rows][H]
  float* gate_up_buf_ = nullptr;          // [max_rows][2 n_ff]
  float* ffn_h_ = nullptr;                // [max_rows][n_ff]
  float* normed_ = nullptr;               // [max_rows][H]
  uint8_t* act_scratch_ = nullptr;        // matmul_scratch_bytes(max_rows, widest)
  FeatureCapture prompt_capture_;         // rows: [max_prompt][n_features]
  FeatureCapture step_capture_;           // rows: [max_rows][n_features]
  // The chain step's arrays (chain_state.h HeadBatch) and its passing rows.
  int32_t* catch_positions_ = nullptr;    // [max_rows]
  int32_t* catch_parents_ = nullptr;      // [max_rows]
  int32_t* draft_positions_ = nullptr;    // [max_rows]
  int32_t* draft_parents_ = nullptr;      // [max_rows]
  int32_t* root_row_ = nullptr;           // [1]
  float* step_g_ = nullptr;               // [H]
  float* step_hidden_ = nullptr;          // [H]
  int32_t* prompt_ids_ = nullptr;         // [max_prompt] the prompt (begin)
  int32_t* prompt_positions_ = nullptr;   // [max_prompt] 0, 1, ... (the prompt rows' positions)
  int32_t* prompt_parents_ = nullptr;     // [max_prompt] i - 1
  uint64_t serial_ = next_object_serial();
};

}  // namespace microspec::cuda
