// Entry points of the CPU kernels, one set per instruction-set variant.
#pragma once

#include <cstdint>

// Runs fn(ctx, begin, end) over [0, n) in contiguous ranges on up to `threads`
// std::threads (defined in module.cpp).
void mpxq_parallel_for(int64_t n, int threads, void (*fn)(void*, int64_t, int64_t), void* ctx);

#define MPXQ_DECLARE_KERNELS(NS)                                                              \
  namespace NS {                                                                              \
  void quantize(int dtype, int bits, const void* x, int64_t nq, int64_t bs, bool stochastic, \
                uint64_t seed, void* mins, void* units, uint8_t* values, int threads);       \
  void dequantize(int qdtype, int out_dtype, int bits, const uint8_t* values,                \
                  const void* mins, const void* units, int64_t nq, int64_t bs, void* out,    \
                  bool accumulate, int threads);                                             \
  }

MPXQ_DECLARE_KERNELS(mpxq_base)
MPXQ_DECLARE_KERNELS(mpxq_avx2)
