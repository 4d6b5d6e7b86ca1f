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

// The largest finite float32.
constexpr float kMaxFloat = 3.40282347e38f;

// Bucket sizes the kernels accept: 1 .. 2^60, so that a span of 8 buckets
// (bucket_size * 8) still fits int64 (format.py's MAX_BUCKET_SIZE).
constexpr int64_t kMaxBucketSize = int64_t{1} << 60;

// A "wide" bucket: its range max - min exceeds float32 (values such as -3e38
// and 3e38), so x - min and min + code * unit may overflow although every
// value and the unit are finite. Such a bucket is encoded and decoded at half
// scale, where nothing overflows (halving is exact for values that large):
//     encode  q = floor((x * 0.5 - min * 0.5) / (unit * 0.5) + r)
//     decode  (min * 0.5 + q * (unit * 0.5)) * 2
// Decided from the stored unit alone, so the encoder, the decoder and every
// backend agree: levels * unit past float32's largest value.
MPXQ_HD bool is_wide(float unit, float levels) { return unit * levels > kMaxFloat; }

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
