#pragma once
// The owner of a model's (or draft head's) interleaved weight copies (repack.h).
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <vector>

#include "kernels/matmul.h"
#include "kernels/threadpool.h"

namespace microspec {

class RepackedWeights {
 public:
  // m with an interleaved copy of its rows added (QMatrix::interleaved), written by pool's threads,
  // when m's type has the layout and `kernels` reads it for that type; otherwise m unchanged.
  QMatrix add(QMatrix m, const KernelTable& kernels, ThreadPool& pool);
  // The bytes of all copies made.
  size_t bytes() const { return bytes_; }

 private:
  struct FreeBytes {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::vector<std::unique_ptr<uint8_t, FreeBytes>> copies_;  // 64-byte aligned
  size_t bytes_ = 0;
};

}  // namespace microspec
