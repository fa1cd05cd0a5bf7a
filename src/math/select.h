#pragma once
// Selection over one row of floats (a logits row): its maximum, the index of its maximum, the
// indices of its k largest elements. NaN is never selected; ties go to the lower index.
//
// Sampling (greedy and the sampler's filters), the engine's prefill top-k and the draft
// vocabulary's candidate stream all select over logits rows, so these live below all of them in a
// folder of their own. They are not kernels: there is no per-ISA table, they are written once for
// the AVX2 baseline the whole binary targets (tests/test_sampler.cpp checks them against scalar
// loops and full sorts).
#include <cstdint>

namespace microspec {

// Largest non-NaN element of x[0, n); -inf if there is none.
float max_ignoring_nan(const float* x, int64_t n);

// Index of the largest non-NaN element, the first one on ties; -1 if n <= 0 or all are NaN.
// AVX2: one vectorised max pass, then a vectorised search for the first index holding it.
int32_t argmax(const float* x, int64_t n);

// The k largest non-NaN elements' indices, best first, ties to the lower index, into out[0, k);
// fewer when fewer are non-NaN (the rest of out is set to -1). One pass, no allocation; meant for
// small k (the draft-vocabulary candidates take k = 3).
void top_k_indices(const float* x, int64_t n, int32_t k, int32_t* out);

}  // namespace microspec
