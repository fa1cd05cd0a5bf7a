// CUDA benchmark on a random-weight model with real shapes (default: Llama-3-8B, BF16), made
// directly in device memory (no file): decode tok/s with CUDA graphs on and off, LM-head time with
// the full / 32k / ~3k packed heads, one BF16 product on the tensor cores at 1 / 6 / 60 tokens,
// the packed head's row gather on the copy stream, one decoder layer and an EAGLE-3 head layer of
// the same shape on 10 tree rows, a 60-token verification forward, and the draft / whole step
// composed from those as the cost model does (depth 5, 10 rows); then MicroSpec's
// vocabulary on the device (a step's update, the packed draft head) and the device's self-draft
// chain and the EAGLE-3 head's end to end (device-resident) with the full, a fixed 32k and the
// dynamic vocabulary, CUDA graphs on and off; last, the device's EAGLE-2 tree step in the issue's
// setting (top-k 10, five draft forwards, 60 verified tokens) drafted by one layer of the target,
// with the same three vocabularies, graphs on (and off for the dynamic one), then by the EAGLE-3
// head; and last a separate draft model of Llama-3.2-1B's shape drafting the chain and the tree
// with the full and the dynamic vocabulary.
//
//   bench_cuda [--layers N] [--steps N] [--reps N] [--profile-steps N]
// --profile-steps N: only a prompt and N decode steps (graphs off) between cudaProfilerStart/Stop,
// for `ncu --profile-from-start off` to time each kernel of a step.
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/cuda_model.h"
#include "cuda/draft_vocab.h"
#include "cuda/eagle_head.h"
#include "cuda/ops.h"
#include "cuda/packed_head.h"
#include "util/error.h"

using namespace microspec;
using namespace microspec::cuda;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of `reps` runs of fn on `stream`, after two warm-ups, timed with events.
double time_ms(cudaStream_t stream, int reps, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  MS_CUDA(cudaEventCreate(&a));
  MS_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    MS_CUDA(cudaEventRecord(a, stream));
    fn();
    MS_CUDA(cudaEventRecord(b, stream));
    MS_CUDA(cudaEventSynchronize(b));
    float t = 0.0f;
    MS_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(ms);
}

ModelConfig llama3_8b(int32_t n_layer) {
  ModelConfig c;
  c.arch = Arch::Llama;
  c.arch_name = "llama";
  c.n_vocab = 128256;
  c.n_embd = 4096;
  c.n_layer = n_layer;
  c.n_head = 32;
  c.n_head_kv = 8;
  c.head_dim = 128;
  c.n_ff = 14336;
  c.n_rot = 128;
  c.context_length = 8192;
  c.rms_eps = 1e-5f;
  c.rope_base = 500000.0f;
  c.rope_base_local = 500000.0f;
  c.attn_scale = 1.0f / std::sqrt(128.0f);
  c.layer_is_sliding.assign(n_layer, 0);
  return c;
}

// Llama-3.2-1B's shape, the 8B's usual draft model (the same 128,256-token vocabulary; its
// output matrix drawn apart from its embeddings, where the real file ties them).
ModelConfig llama32_1b(int32_t n_layer) {
  ModelConfig c = llama3_8b(n_layer);
  c.n_embd = 2048;
  c.head_dim = 64;
  c.n_ff = 8192;
  c.n_rot = 64;
  c.attn_scale = 1.0f / std::sqrt(64.0f);
  return c;
}

int run(int argc, char** argv) {
  int32_t n_layer = 32, steps = 256, reps = 50, profile_steps = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--layers") n_layer = std::atoi(argv[i + 1]);
    else if (a == "--steps") steps = std::atoi(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--profile-steps") profile_steps = std::atoi(argv[i + 1]);
    else throw Error("unknown option " + a);
  }
  // A line at a time even into a pipe (device_check.sh tees it): a run cut off by its time limit
  // keeps every row it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("device: %s\n", device_description().c_str());
  const ModelConfig cfg = llama3_8b(n_layer);
  CudaModelOptions opt;
  opt.n_batch = 64;
  opt.n_ctx = 1024;
  opt.max_generate = 1024;
  auto model = CudaModel::random(cfg, GgmlType::BF16, 42, opt);
  cudaStream_t s = model->stream();
  std::printf("model: Llama-3-8B shape, %d layers, random BF16 weights made on the device: %.2f GB\n", n_layer,
              model->weight_bytes() / 1e9);

  // Decode: a 64-token prompt, then `steps` greedy steps, three runs each way.
  std::vector<int32_t> prompt(64);
  for (int32_t i = 0; i < 64; ++i) prompt[i] = (i * 7919) % cfg.n_vocab;
  if (profile_steps > 0) {
    model->prefill_for_decode(prompt);
    model->time_decode_steps(2, Graphs::Off);
    MS_CUDA(cudaProfilerStart());
    model->time_decode_steps(profile_steps, Graphs::Off);
    MS_CUDA(cudaProfilerStop());
    return 0;
  }
  double tok_s[2];
  for (Graphs g : {Graphs::Off, Graphs::On}) {
    std::vector<double> runs;
    for (int r = 0; r < 3; ++r) {
      model->prefill_for_decode(prompt);
      model->time_decode_steps(8, g);  // warm-up (and graph capture)
      runs.push_back(steps / model->time_decode_steps(steps, g));
    }
    tok_s[g == Graphs::On] = median(runs);
  }
  // Sampled decoding (top-k 40, top-p 0.95, temperature 0.8), graphs on: the pick's cost over the argmax.
  const SamplingParams sampling{.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .seed = 1};
  std::vector<double> sampled_runs;
  for (int r = 0; r < 3; ++r) {
    model->prefill_for_decode(prompt);
    model->time_decode_steps(8, Graphs::On, sampling);
    sampled_runs.push_back(steps / model->time_decode_steps(steps, Graphs::On, sampling));
  }
  const double tok_s_sampled = median(sampled_runs);
  // What a decode step streams: every weight but the embeddings, of which it gathers one row (the
  // output matrix is drawn apart from them, and read whole).
  const DeviceMatrix embd = model->embedding_matrix();
  const double bytes_per_token = double(model->weight_bytes()) - double(embd.rows - 1) * double(embd.row_stride);
  const double ms_graph = 1000.0 / tok_s[1];

  // LM heads over 1 and 10 hidden rows: the full head, and packed heads of 32k and 3k rows.
  DeviceMatrix full = model->output_matrix();
  float *hidden = nullptr, *logits = nullptr;
  uint8_t* scratch = nullptr;
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&hidden), sizeof(float) * 10 * cfg.n_embd));
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&logits), sizeof(float) * 10 * size_t(cfg.n_vocab)));
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&scratch), matmul_scratch_bytes(10, cfg.n_embd)));
  fill_random_f32(hidden, 10 * cfg.n_embd, 0.0f, 1.0f, 7, s);
  auto head_ms = [&](int32_t rows, int32_t n) {
    return time_ms(s, reps, [&] {
      matmul(full, RowSelection{nullptr, rows}, hidden, cfg.n_embd, n, logits, rows, Store::Overwrite, scratch, s);
    });
  };
  const double full1 = head_ms(cfg.n_vocab, 1), full10 = head_ms(cfg.n_vocab, 10);

  // One BF16 product of the feed-forward's gate shape (n_ff x n_embd) on the tensor cores, for the
  // token counts of a decode step, a chain's verification and the table's 60-token verification:
  // weight bytes per second (the bound at few tokens) and useful TFLOP/s, 2 per weight and token
  // (the bound at many; the two BF16 halves of the activations double the work done).
  const int64_t gate_elems = int64_t(cfg.n_ff) * cfg.n_embd;
  uint8_t* gate_data = nullptr;
  float *gate_x = nullptr, *gate_y = nullptr;
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&gate_data), size_t(gate_elems) * 2));
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&gate_x), sizeof(float) * 60 * cfg.n_embd));
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&gate_y), sizeof(float) * 60 * cfg.n_ff));
  fill_random(GgmlType::BF16, gate_data, gate_elems, 0.02f, 5, s);
  fill_random_f32(gate_x, 60 * int64_t(cfg.n_embd), 0.0f, 1.0f, 6, s);
  const DeviceMatrix gate{GgmlType::BF16, gate_data, cfg.n_ff, cfg.n_embd, size_t(cfg.n_embd) * 2};
  const int32_t gate_tokens[3] = {1, 6, 60};
  double gate_ms[3], gate_cores_ms[3];  // tensor cores (what the model runs), CUDA cores (the peer)
  for (int i = 0; i < 3; ++i) {
    gate_ms[i] = time_ms(s, reps, [&] {
      matmul(gate, RowSelection{nullptr, cfg.n_ff}, gate_x, cfg.n_embd, gate_tokens[i], gate_y, cfg.n_ff,
             Store::Overwrite, scratch, s);
    });
    gate_cores_ms[i] = time_ms(s, reps, [&] {
      matmul_bf16_cuda_cores(gate, RowSelection{nullptr, cfg.n_ff}, gate_x, cfg.n_embd, gate_tokens[i], gate_y,
                             cfg.n_ff, Store::Overwrite, scratch, s);
    });
  }
  cudaFree(gate_data);
  cudaFree(gate_x);
  cudaFree(gate_y);

  auto packed_ms = [&](int32_t rows) {
    DevicePackedHead head(full, rows, s);
    std::vector<int32_t> ids(rows), slots(rows);
    for (int32_t j = 0; j < rows; ++j) ids[j] = int32_t((int64_t(j) * 40503) % cfg.n_vocab), slots[j] = j;
    head.enter(ids, slots);
    return time_ms(s, reps, [&] { head.logits(hidden, 10, rows, logits, rows, scratch); });
  };
  const double p32k = packed_ms(32768), p3k = packed_ms(3000);

  // The gather of newly entered rows on the copy stream (64 rows: a step's worth of churn).
  DevicePackedHead head3k(full, 3000, s);
  std::vector<int32_t> ids(64), slots(64);
  for (int32_t j = 0; j < 64; ++j) ids[j] = (j * 1999) % cfg.n_vocab, slots[j] = j * 40;
  const double gather64 = time_ms(head3k.copy_stream(), reps, [&] { head3k.enter(ids, slots); });

  // One decoder layer on 10 tree rows, and the 60-token verification forward (all layers, logits).
  model->prefill_for_decode(prompt);
  auto tree_batch = [&](int32_t n, std::vector<int32_t>& t, std::vector<int32_t>& p, std::vector<int32_t>& par,
                        std::vector<int32_t>& out) {
    t.resize(n), p.resize(n), par.resize(n), out.resize(n);
    for (int32_t i = 0; i < n; ++i) {
      t[i] = (i * 31337) % cfg.n_vocab;
      par[i] = i == 0 ? -1 : (i - 1) / 2;  // a binary tree
      p[i] = model->n_past() + (i == 0 ? 0 : p[par[i]] - model->n_past() + 1);
      out[i] = i;
    }
  };
  std::vector<int32_t> t10, p10, par10, o10, t60, p60, par60, o60;
  tree_batch(10, t10, p10, par10, o10);
  tree_batch(60, t60, p60, par60, o60);
  const double layer10 = time_ms(s, reps, [&] { model->forward(HostBatch{t10, p10, par10, o10, 0}, {.end_layer = 1}); });

  // An EAGLE-3 head of the Llama-3-8B shape (EAGLE-3's layers: the inputs of 2, L/2 and L-3), random
  // BF16 weights: its layer on a 10-row tree fed its own outputs (the table's "EAGLE layer").
  Eagle3Config hc;
  hc.n_embd = cfg.n_embd;
  hc.n_head = cfg.n_head;
  hc.n_head_kv = cfg.n_head_kv;
  hc.head_dim = cfg.head_dim;
  hc.n_ff = cfg.n_ff;
  hc.rms_eps = cfg.rms_eps;
  hc.rope_base = cfg.rope_base;
  hc.target_layers = {std::min(2, n_layer), n_layer / 2, std::max(n_layer - 3, n_layer / 2)};
  hc.target_hidden = cfg.n_embd;
  hc.norm_before_fc = true;
  auto head = DeviceEagleHead::random(hc, model->embedding_matrix(), GgmlType::BF16, 77, opt.n_batch, opt.n_ctx,
                                      opt.n_ctx, s);
  int32_t *head_tokens = nullptr, *head_positions = nullptr, *head_parents = nullptr;
  float* head_g = nullptr;
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&head_tokens), 10 * 4));
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&head_positions), 10 * 4));
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&head_parents), 10 * 4));
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&head_g), sizeof(float) * 10 * cfg.n_embd));
  cuda::upload(head_tokens, t10.data(), 10 * 4);
  std::vector<int32_t> head_pos10(10);
  for (int32_t i = 0; i < 10; ++i) head_pos10[i] = p10[i] - model->n_past();  // the head's cache is empty
  cuda::upload(head_positions, head_pos10.data(), 10 * 4);
  cuda::upload(head_parents, par10.data(), 10 * 4);
  fill_random_f32(head_g, 10 * int64_t(cfg.n_embd), 0.0f, 1.0f, 9, s);
  const double head10 = time_ms(s, reps, [&] {
    head->enqueue_forward(DeviceBatch{head_tokens, head_positions, head_parents, 10, 0}, nullptr, head_g, s);
  });
  cudaFree(head_tokens);
  cudaFree(head_positions);
  cudaFree(head_parents);
  cudaFree(head_g);
  const double verify60 =
      time_ms(s, std::max(5, reps / 5), [&] { model->forward(HostBatch{t60, p60, par60, o60, 0}, {.logits = true}); });

  // MicroSpec's vocabulary on the device (W_max 3072, K_pre 3, K_ver 3): one step's update (the
  // target's top 3 of 6 verification rows, 60 fresh tree tokens into the window in one device
  // thread, the gather of the entered rows on the copy stream, joined), and the draft head over
  // the 3,072 packed slots with its argmax over the active ones, 10 rows.
  DeviceDraftVocab vocab(full, PrunedVocabSpec{}, {.max_prompt = int32_t(prompt.size()), .max_rows = 10}, s);
  cuda::upload(vocab.prompt_ids(), prompt.data(), prompt.size() * 4);
  std::vector<int32_t> host_ids(size_t(4096) * 60);
  for (size_t i = 0; i < host_ids.size(); ++i) host_ids[i] = int32_t((int64_t(i) * 2654435761LL) % cfg.n_vocab);
  cuda::upload(vocab.prompt_top(), host_ids.data(), prompt.size() * 3 * 4);
  int32_t *tree_ids = nullptr, *best = nullptr;
  VocabUpdate* update = nullptr;
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&tree_ids), host_ids.size() * 4));
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&best), 10 * 4));
  MS_CUDA(cudaMalloc(reinterpret_cast<void**>(&update), sizeof(VocabUpdate)));
  cuda::upload(tree_ids, host_ids.data(), host_ids.size() * 4);
  const VocabUpdate six_rows{.n_tree = 60, .first_row = 0, .n_rows = 6};
  cuda::upload(update, &six_rows, sizeof(six_rows));
  vocab.begin(int32_t(prompt.size()));
  fill_random_f32(logits, 6 * int64_t(cfg.n_vocab), 0.0f, 1.0f, 11, s);
  int32_t round = 0;
  const double vocab_step = time_ms(s, reps, [&] {
    vocab.step(tree_ids + size_t(round++ % 4096) * 60, logits, update, 60, 6);
    vocab.logits(hidden, 1, scratch);  // joins the gather
  });
  const double dyn_head10 = time_ms(s, reps, [&] {
    vocab.logits(hidden, 10, scratch);
    vocab.argmax(10, /*if_empty=*/-1, best);
  });
  cudaFree(tree_ids);
  cudaFree(best);
  cudaFree(update);

  // The cost model: depth 5 of (EAGLE layer + LM head) on 10 rows.
  const double draft_full = 5 * (head10 + full10), draft_32k = 5 * (head10 + p32k), draft_3k = 5 * (head10 + p3k);
  std::printf("\n| measurement | microspec CUDA | issue's table (PyTorch + graphs) |\n|---|---|---|\n");
  std::printf("| decode, CUDA graphs on | %.1f tok/s (%.2f ms/step, %.2f TB/s of weights streamed) | 5.22 ms (191 tok/s) |\n",
              tok_s[1], ms_graph, bytes_per_token / (ms_graph * 1e-3) / 1e12);
  std::printf("| decode, CUDA graphs off | %.1f tok/s (%.2f ms/step) | - |\n", tok_s[0], 1000.0 / tok_s[0]);
  std::printf("| decode sampled (top-k 40, top-p 0.95, T 0.8), CUDA graphs on | %.1f tok/s (%.2f ms/step, %.3f ms over greedy) | - |\n",
              tok_s_sampled, 1000.0 / tok_s_sampled, 1000.0 / tok_s_sampled - ms_graph);
  for (int i = 0; i < 3; ++i)
    std::printf("| BF16 product %d x %d (gate), %d token%s: tensor cores / CUDA cores | %.3f ms (%.2f TB/s of weights, %.0f TFLOP/s) / %.3f ms (%.2fx) | - |\n",
                cfg.n_ff, cfg.n_embd, gate_tokens[i], gate_tokens[i] == 1 ? "" : "s", gate_ms[i],
                2.0 * gate_elems / (gate_ms[i] * 1e-3) / 1e12, 2.0 * gate_elems * gate_tokens[i] / (gate_ms[i] * 1e-3) / 1e12,
                gate_cores_ms[i], gate_cores_ms[i] / gate_ms[i]);
  std::printf("| full-vocab head, 1 row / 10 rows | %.3f / %.3f ms | 0.29 / 0.30 ms |\n", full1, full10);
  std::printf("| 32k packed head, 10 rows | %.3f ms | 0.11 ms |\n", p32k);
  std::printf("| 3k packed head, 10 rows | %.3f ms | 0.033 ms |\n", p3k);
  std::printf("| gather of 64 new rows (copy stream; with enter()'s upload of the ids) | %.4f ms | ~0.01 ms |\n", gather64);
  std::printf("| EAGLE-3 head layer, 10 tree rows | %.3f ms | 0.21 ms |\n", head10);
  std::printf("| one decoder layer of the target, 10 tree rows | %.3f ms | - |\n", layer10);
  std::printf("| draft per step (5 x (EAGLE-3 layer + LM head)): full / 32k / 3k | %.2f / %.2f / %.2f ms | 2.51 / 1.56 / 1.19 ms |\n",
              draft_full, draft_32k, draft_3k);
  std::printf("| verify 60 tokens (one forward, launched kernel by kernel) | %.2f ms | 6.46 ms |\n", verify60);
  std::printf("| whole step (draft + verify): full / 3k | %.2f / %.2f ms | 8.98 / 7.65 ms |\n",
              draft_full + verify60, draft_3k + verify60);
  std::printf("| 3k draft vs full draft | %.2fx | 0.47x |\n", draft_3k / draft_full);
  std::printf("| dynamic vocabulary: one step's update (top 3 of 6 rows, 60 tokens into the window, gather joined by a 1-row draft head) | %.3f ms | - |\n",
              vocab_step);
  std::printf("| dynamic vocabulary: draft head over 3,072 packed slots + argmax, 10 rows | %.3f ms | 0.033 ms (3k head) |\n",
              dyn_head10);
  std::fflush(stdout);

  // The device's self-draft chain end to end (4 of the layers draft a chain of 5, one forward of
  // all layers verifies it; the step resident on the device), full vocabulary against FR-Spec's
  // fixed 32k set and MicroSpec's window, graphs on and off: milliseconds per step, from two
  // generation lengths (the difference drops the prefill). Random weights accept almost nothing,
  // so a step is one chain drafted and verified.
  PrunedVocabSpec freq32k;
  freq32k.kind = PrunedVocabSpec::Kind::Fixed;
  for (int32_t i = 0; i < 32768; ++i) freq32k.pinned.push_back(i);
  // Who drafts: the target's first layers (neither set), an EAGLE-3 head or a separate model.
  struct Drafter {
    DeviceEagleHead* head = nullptr;
    CudaModel* model = nullptr;
  };
  auto step_ms = [&](const std::optional<PrunedVocabSpec>& vocab, Graphs graphs, Drafter drafter,
                     std::optional<TreeShape> tree = std::nullopt, const SamplingParams& sampled = {}) {
    SpecChainOptions so;
    so.draft_layers = tree ? 1 : std::min(4, cfg.n_layer);
    so.draft_head = drafter.head;
    so.draft_model = drafter.model;
    so.depth = 5;
    so.tree = tree;
    so.graphs = graphs;
    so.sync_every = 8;
    so.vocab = vocab;
    so.sampling = sampled;
    auto run_ms = [&](int32_t n_predict, int32_t& steps) {
      so.n_predict = n_predict;
      SpecChainStats st;
      const auto t0 = std::chrono::steady_clock::now();
      model->generate_speculative(prompt, so, &st);
      steps = st.steps;
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    int32_t steps_short = 0, steps_long = 0;
    run_ms(16, steps_short);  // warm-up (and graph capture)
    std::vector<double> per_step;
    for (int r = 0; r < 3; ++r) {
      const double short_ms = run_ms(16, steps_short), long_ms = run_ms(48, steps_long);
      per_step.push_back((long_ms - short_ms) / std::max(steps_long - steps_short, 1));
    }
    return median(per_step);
  };
  double chain[3][2], head_chain[3][2];  // [full, freq 32k, dynamic][graphs off, on]
  const std::optional<PrunedVocabSpec> chain_vocabs[3] = {std::nullopt, freq32k, PrunedVocabSpec{}};
  for (int v = 0; v < 3; ++v)
    for (Graphs g : {Graphs::Off, Graphs::On}) {
      chain[v][g == Graphs::On] = step_ms(chain_vocabs[v], g, {});
      head_chain[v][g == Graphs::On] = step_ms(chain_vocabs[v], g, {.head = head.get()});
    }
  // Speculative sampling on the same chain (MicroSpec's window, graphs on): the draws and the
  // rejection sampling in place of the argmaxes.
  const double chain_sampled = step_ms(PrunedVocabSpec{}, Graphs::On, {}, std::nullopt, sampling);

  std::printf("| self-draft chain step (4 layers draft 5 tokens, all verify; device-resident), CUDA graphs on: full / freq 32k / dynamic vocabulary | %.2f / %.2f / %.2f ms | - |\n",
              chain[0][1], chain[1][1], chain[2][1]);
  std::printf("| the same, CUDA graphs off | %.2f / %.2f / %.2f ms | - |\n", chain[0][0], chain[1][0], chain[2][0]);
  std::printf("| the same chain, dynamic vocabulary, speculative sampling (top-k 40, top-p 0.95, T 0.8), CUDA graphs on | %.2f ms (%.3f ms over greedy) | - |\n",
              chain_sampled, chain_sampled - chain[2][1]);
  std::printf("| EAGLE-3 head chain step (catch-up + 5 drafts, all verify; device-resident), CUDA graphs on: full / freq 32k / dynamic vocabulary | %.2f / %.2f / %.2f ms | - |\n",
              head_chain[0][1], head_chain[1][1], head_chain[2][1]);
  std::printf("| the same, CUDA graphs off | %.2f / %.2f / %.2f ms | - |\n", head_chain[0][0], head_chain[1][0],
              head_chain[2][0]);
  std::fflush(stdout);

  // The EAGLE-2 setting as a device-resident tree step (measured last: the rows above stand if it
  // fails): top-k 10, the root's forward and four levels of 10 rows (five draft forwards, nodes up
  // to depth 5), the 60 best of 410 candidates verified; one layer of the target drafts (the
  // analogue of the paper's one-layer drafter). Its draft part is the step less the 60-token
  // verification measured above.
  const TreeShape eagle2{.top_k = 10, .depth = 4, .total = 60};
  // Graphs on for each vocabulary, off for the dynamic one only (device time is scarce).
  double tree[3];  // [full, freq 32k, dynamic], graphs on
  for (int v = 0; v < 3; ++v) tree[v] = step_ms(chain_vocabs[v], Graphs::On, {}, eagle2);
  const double tree_dynamic_off = step_ms(chain_vocabs[2], Graphs::Off, {}, eagle2);
  std::printf("| tree step, EAGLE-2 setting (1 target layer drafts top-10 x 5 forwards, 60 verified; device-resident), CUDA graphs on: full / freq 32k / dynamic vocabulary | %.2f / %.2f / %.2f ms | 8.98 / - / 7.65 ms |\n",
              tree[0], tree[1], tree[2]);
  std::printf("| the same, dynamic vocabulary, CUDA graphs off | %.2f ms | - |\n", tree_dynamic_off);
  std::printf("| its draft part (step less the 60-token verification), graphs on: full / freq 32k / dynamic | %.2f / %.2f / %.2f ms | 2.51 / 1.56 / 1.19 ms |\n",
              tree[0] - verify60, tree[1] - verify60, tree[2] - verify60);
  std::printf("| dynamic draft part vs full draft part | %.2fx | 0.47x |\n", (tree[2] - verify60) / (tree[0] - verify60));
  std::fflush(stdout);
  // The EAGLE-2 setting with its drafter: the EAGLE-3 head drafts the same tree (its catch-up over
  // the accepted rows, then four levels of 10 rows fed their parents' outputs), for each vocabulary.
  double head_tree[3];  // [full, freq 32k, dynamic], graphs on
  for (int v = 0; v < 3; ++v) head_tree[v] = step_ms(chain_vocabs[v], Graphs::On, {.head = head.get()}, eagle2);
  std::printf("| tree step, EAGLE-2 setting drafted by the EAGLE-3 head (catch-up + top-10 x 5 levels, 60 verified; device-resident), CUDA graphs on: full / freq 32k / dynamic vocabulary | %.2f / %.2f / %.2f ms | 8.98 / - / 7.65 ms |\n",
              head_tree[0], head_tree[1], head_tree[2]);
  std::printf("| its draft part (step less the 60-token verification): full / freq 32k / dynamic | %.2f / %.2f / %.2f ms | 2.51 / 1.56 / 1.19 ms |\n",
              head_tree[0] - verify60, head_tree[1] - verify60, head_tree[2] - verify60);
  std::printf("| head's dynamic draft part vs full draft part | %.2fx | 0.47x |\n",
              (head_tree[2] - verify60) / (head_tree[0] - verify60));
  std::fflush(stdout);
  // Speculative sampling on the same tree (dynamic vocabulary, graphs on): each row's 10 children
  // drawn without replacement and the recursive rejection sampling, in place of the best-first
  // proposals and the argmaxes.
  const double tree_sampled = step_ms(chain_vocabs[2], Graphs::On, {}, eagle2, sampling);
  std::printf("| the same tree, dynamic vocabulary, speculative sampling (top-k 40, top-p 0.95, T 0.8), CUDA graphs on | %.2f ms (%.3f ms over greedy) | - |\n",
              tree_sampled, tree_sampled - tree[2]);
  std::fflush(stdout);

  // A separate draft model of Llama-3.2-1B's shape (half the target's layers, random BF16 weights,
  // its own cache and stream, one token behind the target's): the chain of 5 (its first forward
  // runs the newest accepted token and the root, then one row per draft) and the EAGLE-2 tree
  // (two rows, then four levels of 10), full against MicroSpec's dynamic vocabulary, graphs on.
  auto draft = CudaModel::random(llama32_1b(std::max(1, n_layer / 2)), GgmlType::BF16, 43, opt);
  double dm_chain[2], dm_tree[2];  // [full, dynamic], graphs on
  for (int v = 0; v < 2; ++v) {
    dm_chain[v] = step_ms(chain_vocabs[2 * v], Graphs::On, {.model = draft.get()});
    dm_tree[v] = step_ms(chain_vocabs[2 * v], Graphs::On, {.model = draft.get()}, eagle2);
  }
  std::printf("| draft model of Llama-3.2-1B's shape (%d layers, %.2f GB), chain step (5 drafts, all verify; device-resident), CUDA graphs on: full / dynamic vocabulary | %.2f / %.2f ms | - |\n",
              draft->config().n_layer, draft->weight_bytes() / 1e9, dm_chain[0], dm_chain[1]);
  std::printf("| the same draft model, tree step in the EAGLE-2 setting (top-10 x 5 forwards, 60 verified), CUDA graphs on: full / dynamic vocabulary | %.2f / %.2f ms | 8.98 / 7.65 ms (an EAGLE layer drafting) |\n",
              dm_tree[0], dm_tree[1]);
  std::printf("| its draft part (step less the 60-token verification): full / dynamic; dynamic vs full | %.2f / %.2f ms; %.2fx | 2.51 / 1.19 ms; 0.47x (an EAGLE layer drafting) |\n",
              dm_tree[0] - verify60, dm_tree[1] - verify60, (dm_tree[1] - verify60) / (dm_tree[0] - verify60));
  cudaFree(hidden);
  cudaFree(logits);
  cudaFree(scratch);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda: %s\n", e.what());
    return 1;
  }
}
