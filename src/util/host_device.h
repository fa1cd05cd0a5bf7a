#pragma once
// MS_HOST_DEVICE marks a function that one piece of code runs on both sides: compiled for the host
// everywhere, and also for the device when nvcc compiles the including file (vocab/window_state.h,
// speculative/chain_state.h). Such functions take plain arrays, allocate nothing, throw nothing and
// use no standard library.
#if defined(__CUDACC__)
#define MS_HOST_DEVICE __host__ __device__
#else
#define MS_HOST_DEVICE
#endif
