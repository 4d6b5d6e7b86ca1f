// Arithmetic shared by the CPU and CUDA kernels: the stochastic-rounding hash
// and the layout constants. The float formulas themselves are spelled out in
// each backend (the CUDA one with explicit _rn intrinsics so that nvcc does not
// contract a*b+c into an FMA); reference.py is the specification of both.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MPXQ_HD __host__ __device__ __forceinline__
#else
// static: each CPU kernel variant (baseline, AVX2) keeps its own copy, so the
// linker never swaps an AVX2 body into the baseline code.
#define MPXQ_HD static inline
#endif

namespace mpxq {

// Data type codes passed from Python (kernels.py keeps the same table).
enum Dtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Elements per decode/encode chunk: a multiple of 8 (one packing group) and a
// divisor of 2^32, so that a chunk never straddles a change of index_hi.
constexpr int64_t kChunk = 1024;

// murmur3's 32-bit finaliser: a bijection with full avalanche.
MPXQ_HD uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

struct HashKeys {
  uint32_t k1, k2;
};

// Keys for the 2^32 elements sharing index_hi = index >> 32.
MPXQ_HD HashKeys hash_keys(uint64_t seed, uint32_t index_hi) {
  uint32_t seed_lo = static_cast<uint32_t>(seed);
  uint32_t seed_hi = static_cast<uint32_t>(seed >> 32);
  HashKeys k;
  k.k1 = fmix32(seed_lo ^ fmix32(index_hi ^ seed_hi ^ 0x9E3779B9u));
  k.k2 = fmix32(k.k1 ^ 0x85EBCA6Bu);
  return k;
}

// Uniform noise in [0, 1) with 24 random bits: exact in float32.
MPXQ_HD float hash_uniform(HashKeys k, uint32_t index_lo) {
  uint32_t h = fmix32(fmix32(index_lo ^ k.k1) ^ k.k2);
  return static_cast<float>(h >> 8) * 5.9604644775390625e-08f;  // 2^-24
}

}  // namespace mpxq
