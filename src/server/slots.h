#pragma once
// Generation slots of `microspec serve` and the bounded FIFO queue in front of them.
//
// A slot is everything one generation writes: its own Model object (scratch buffers and thread
// pool; the weights are views into the one shared memory mapping of the GGUF file, so they are not
// duplicated), its own Generator (KV cache of n_ctx tokens) and its own Decoders. Model::forward
// uses the model's scratch and pool, so two generations can never share a Model; with one Model per
// slot, slots run truly in parallel and all memory is allocated when the server starts.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "speculative/decoder.h"
#include "speculative/settings.h"
#include "tokenizer/tokenizer.h"

namespace microspec::server {

struct Slot {
  std::unique_ptr<Model> model;      // own scratch + thread pool over the shared weights
  std::unique_ptr<Generator> gen;    // own KV cache
  std::unique_ptr<Decoder> decoder;  // the server's settings (--spec none: plain decoding)
  std::unique_ptr<Decoder> plain;    // no drafter: requests that turn speculation off

  Slot(const GgufFile& file, const Tokenizer& tokenizer, const ModelOptions& options, int32_t n_ctx,
       const SpecConfig& spec_config);
  // speculative: through the server's drafter (which must exist); otherwise plain decoding.
  SpecResult generate(const std::vector<int32_t>& prompt, const GenerateParams& params, bool speculative,
                      const TextCallback& on_text);
};

class SlotPool;

// Holds one slot until destroyed (then the next queued request gets it).
class SlotLease {
 public:
  SlotLease(SlotPool& pool, int index) : pool_(pool), index_(index) {}
  ~SlotLease();
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  Slot& slot();

 private:
  SlotPool& pool_;
  int index_;
};

class SlotPool {
 public:
  // queue_limit: most requests waiting for a slot at once (beyond that, acquire() says QueueFull).
  SlotPool(std::vector<std::unique_ptr<Slot>> slots, int queue_limit);

  enum class Status { Ok, QueueFull, ShuttingDown };
  // Waits (first come, first served) for a free slot. On Ok, *lease holds it.
  Status acquire(std::unique_ptr<SlotLease>* lease, double* waited_seconds);
  // No new leases; waiters return ShuttingDown.
  void shutdown();
  // Blocks until no slot is leased and nobody waits.
  void wait_idle();

  int size() const { return static_cast<int>(slots_.size()); }
  int queue_limit() const { return queue_limit_; }
  int busy() const;
  int waiting() const;

 private:
  friend class SlotLease;
  void release(int index);

  std::vector<std::unique_ptr<Slot>> slots_;
  int queue_limit_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> free_;  // [slots] indices of free slots (capacity reserved at start)
  int busy_ = 0;
  int waiting_ = 0;
  uint64_t next_ticket_ = 0;  // FIFO order: tickets are served in the order they were taken
  uint64_t serving_ = 0;
  bool shutting_down_ = false;
};

}  // namespace microspec::server
