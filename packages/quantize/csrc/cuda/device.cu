// mpx-quantize CUDA kernels: the same packed layout and float formulas as the
// CPU kernels and reference.py. Every float operation is an explicit _rn
// intrinsic (and the build passes --fmad=false), so nvcc cannot fuse a*b+c
// into an FMA: nearest rounding is bit-identical to the CPU.
//
// The fast path (aligned buffers; buckets of 512 or 1024 values to quantize,
// any multiple of 8 from 128 to 64Ki to decode: what training uses) reads the
// input once and moves 4 values per vector load and store:
//
//   bucket kernel   one warp per bucket, held in registers: min, max,
//                   non-finite scan (shuffle reduction, lane 0 writes min and
//                   unit), then the same warp encodes it: each lane 4 values,
//                   two lanes' codes (shuffle) -> one group's `bits` bytes
//   quad decode     one thread per 4 values: its half of a group's bytes ->
//                   one 16-byte (float32) or 8-byte (16-bit) store
//
// Any other layout takes the general kernels, one thread per group of 8:
//
//   meta kernel     one warp per bucket: as above, min, max and unit only
//   encode kernel   one thread per group of 8 values: 8 codes -> `bits` bytes
//   decode kernel   one thread per group of 8 values: `bits` bytes -> 8 values
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>

#include "../common/qmath.h"
#include "device.h"

namespace mpx_quantize {

int device_count(int* error) {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  *error = static_cast<int>(status);
  return status == cudaSuccess ? count : 0;
}

const char* error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

int runtime_version() {
  int version = 0;
  cudaRuntimeGetVersion(&version);
  return version;
}

namespace {

struct F32 {
  using storage = float;
  __device__ static float load(float v) { return v; }
  __device__ static float store(float f) { return f; }
  static constexpr float kMax = 3.40282347e38f;  // the largest finite value
};
struct F16 {
  using storage = __half;
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float f) { return __float2half_rn(f); }
  static constexpr float kMax = 65504.0f;
};
struct BF16 {
  using storage = __nv_bfloat16;
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float f) { return __float2bfloat16_rn(f); }
  static constexpr float kMax = 3.38953139e38f;
};

constexpr unsigned kNanF32 = 0x7FC00000u;
constexpr unsigned short kNanF16 = 0x7E00u;
constexpr int kThreads = 256;

__device__ __forceinline__ float load_meta(const void* p, int64_t i, bool fp16) {
  return fp16 ? __half2float(static_cast<const __half*>(p)[i]) : static_cast<const float*>(p)[i];
}

// A bucket's stored min and unit from its reduced min, max and non-finite sum
// (NaN when a NaN or an infinity was seen); every path computes them here.
struct BucketMeta {
  float min, unit;  // as stored: rounded to float16 for 16-bit inputs, NaN when flagged
};

__device__ __forceinline__ BucketMeta bucket_meta(float mn, float mx, float z, int bits,
                                                  bool fp16_meta) {
  mn = __fadd_rn(mn, 0.0f);  // -0 -> +0
  const float levels = static_cast<float>((1 << bits) - 1);
  float rng = __fsub_rn(mx, mn);
  // A range past float32 (finite values): at half scale (qmath.h's is_wide).
  float unit = isfinite(rng) ? __fdiv_rn(rng, levels)
                             : __fmul_rn(__fdiv_rn(__fsub_rn(__fmul_rn(mx, 0.5f),
                                                             __fmul_rn(mn, 0.5f)),
                                                   levels),
                                         2.0f);
  if (fp16_meta) {
    unsigned short u16 = __half_as_ushort(__float2half_rn(unit));
    if (__half2float(__ushort_as_half(u16)) < unit) ++u16;  // round the unit up
    unit = __half2float(__ushort_as_half(u16));
  }
  float recip = __fdiv_rn(1.0f, unit);
  if (!isfinite(recip)) unit = 0.0f;
  const bool flagged = isnan(z) || !isfinite(unit);
  const float nan = __uint_as_float(kNanF32);
  if (flagged) return {nan, nan};
  if (fp16_meta) return {__half2float(__float2half_rn(mn)), __half2float(__float2half_rn(unit))};
  return {mn, unit};
}

__device__ __forceinline__ void store_meta(BucketMeta m, bool fp16_meta, void* mins, void* units,
                                           int64_t b) {
  if (fp16_meta) {
    // NaN stays the canonical float16 NaN; the rest is exact in float16 already.
    static_cast<__half*>(mins)[b] = isnan(m.min) ? __ushort_as_half(kNanF16)
                                                 : __float2half_rn(m.min);
    static_cast<__half*>(units)[b] = isnan(m.unit) ? __ushort_as_half(kNanF16)
                                                   : __float2half_rn(m.unit);
  } else {
    static_cast<float*>(mins)[b] = m.min;
    static_cast<float*>(units)[b] = m.unit;
  }
}

// What encoding a bucket needs, from its stored min and unit.
struct EncodeParams {
  float min, recip, scale;
  bool flagged;
};

__device__ __forceinline__ EncodeParams encode_params(float mn, float unit, float levels) {
  EncodeParams p;
  p.flagged = isnan(unit);
  // A wide bucket is encoded at half scale (qmath.h); x * 1 is x exactly.
  p.scale = !p.flagged && mpxq::is_wide(unit, levels) ? 0.5f : 1.0f;
  p.min = __fmul_rn(mn, p.scale);
  p.recip = __fdiv_rn(1.0f, __fmul_rn(unit, p.scale));
  if (p.flagged || !isfinite(p.recip)) p.recip = 0.0f;
  return p;
}

__device__ __forceinline__ unsigned encode_one(float v, const EncodeParams& p, float levels,
                                               float r) {
  float t = __fadd_rn(__fmul_rn(__fsub_rn(__fmul_rn(v, p.scale), p.min), p.recip), r);
  t = t < levels ? t : levels;
  t = t > 0.0f ? t : 0.0f;
  return static_cast<unsigned>(__float2int_rz(t));
}

// Four consecutive values as floats: one 16-byte (float32) or 8-byte load.
template <class T>
__device__ __forceinline__ void load4(const typename T::storage* p, float (&v)[4]) {
  if constexpr (sizeof(typename T::storage) == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
    const uint2 q = *reinterpret_cast<const uint2*>(p);
    typename T::storage h[4];
    memcpy(h, &q, sizeof(q));
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = T::load(h[k]);
  }
}

template <class T>
__device__ __forceinline__ void store4(typename T::storage* p, const float (&v)[4]) {
  if constexpr (sizeof(typename T::storage) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    typename T::storage h[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = T::store(v[k]);
    uint2 q;
    memcpy(&q, h, sizeof(q));
    *reinterpret_cast<uint2*>(p) = q;
  }
}

// One value into a bucket's running min, max and non-finite sum (NaN once a
// NaN or an infinity is seen); then the warp's 32 partial results combined.
__device__ __forceinline__ void scan_value(float v, float& mn, float& mx, float& z) {
  mn = v < mn ? v : mn;
  mx = v > mx ? v : mx;
  z = __fadd_rn(z, __fsub_rn(v, v));
}

__device__ __forceinline__ void warp_combine(float& mn, float& mx, float& z) {
  for (int off = 16; off > 0; off >>= 1) {
    float omn = __shfl_xor_sync(0xFFFFFFFFu, mn, off);
    float omx = __shfl_xor_sync(0xFFFFFFFFu, mx, off);
    float oz = __shfl_xor_sync(0xFFFFFFFFu, z, off);
    mn = omn < mn ? omn : mn;
    mx = omx > mx ? omx : mx;
    z = __fadd_rn(z, oz);
  }
}

template <class T>
__global__ void meta_kernel(const typename T::storage* __restrict__ x, int64_t nq, int64_t bs,
                            int bits, bool fp16_meta, void* mins, void* units) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t nb = (nq + bs - 1) / bs;
  for (int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; b < nb;
       b += warps) {
    const int64_t a = b * bs, e = min(nq, a + bs);
    float first = T::load(x[a]);
    float mn = first, mx = first, z = 0.0f;
    for (int64_t i = a + lane; i < e; i += 32) scan_value(T::load(x[i]), mn, mx, z);
    warp_combine(mn, mx, z);
    if (lane == 0) store_meta(bucket_meta(mn, mx, z, bits, fp16_meta), fp16_meta, mins, units, b);
  }
}

template <class T, int B>
__global__ void encode_kernel(const typename T::storage* __restrict__ x, int64_t nq, int64_t bs,
                              bool stochastic, uint64_t seed, bool fp16_meta,
                              const void* __restrict__ mins, const void* __restrict__ units,
                              uint8_t* __restrict__ values) {
  const int64_t groups = (nq + 7) / 8;
  const float levels = static_cast<float>((1 << B) - 1);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const int64_t e0 = g * 8;
    const mpxq::HashKeys keys = mpxq::hash_keys(seed, static_cast<uint32_t>(e0 >> 32));
    int64_t next = e0;  // where the next bucket starts
    EncodeParams p{0.0f, 0.0f, 1.0f, false};
    uint64_t acc = 0;
    for (int j = 0; j < 8; ++j) {
      const int64_t e = e0 + j;
      if (e >= nq) break;
      if (e >= next) {
        const int64_t b = e / bs;
        next = (b + 1) * bs;
        p = encode_params(load_meta(mins, b, fp16_meta), load_meta(units, b, fp16_meta), levels);
      }
      unsigned code = 0;
      if (!p.flagged) {
        float r = stochastic ? mpxq::hash_uniform(keys, static_cast<uint32_t>(e)) : 0.5f;
        code = encode_one(T::load(x[e]), p, levels, r);
      }
      acc |= static_cast<uint64_t>(code) << (j * B);
    }
    uint8_t* out = values + g * B;
#pragma unroll
    for (int k = 0; k < B; ++k) out[k] = static_cast<uint8_t>(acc >> (8 * k));
  }
}

template <class O, int B>
__global__ void decode_kernel(const uint8_t* __restrict__ values, const void* __restrict__ mins,
                              const void* __restrict__ units, bool fp16_meta, int64_t nq,
                              int64_t bs, typename O::storage* __restrict__ out,
                              bool accumulate) {
  const int64_t groups = (nq + 7) / 8;
  const float levels = static_cast<float>((1 << B) - 1);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const uint8_t* in = values + g * B;
    uint64_t acc = 0;
#pragma unroll
    for (int k = 0; k < B; ++k) acc |= static_cast<uint64_t>(in[k]) << (8 * k);
    const int64_t e0 = g * 8;
    int64_t next = e0;
    float mn = 0.0f, unit = 0.0f, post = 1.0f;
    for (int j = 0; j < 8; ++j) {
      const int64_t e = e0 + j;
      if (e >= nq) break;
      if (e >= next) {
        const int64_t b = e / bs;
        next = (b + 1) * bs;
        mn = load_meta(mins, b, fp16_meta);
        unit = load_meta(units, b, fp16_meta);
        // A wide bucket decodes at half scale, then doubles (qmath.h); NaN is never wide.
        const bool wide = mpxq::is_wide(unit, levels);
        post = wide ? 2.0f : 1.0f;
        if (wide) {
          mn = __fmul_rn(mn, 0.5f);
          unit = __fmul_rn(unit, 0.5f);
        }
      }
      const float code = static_cast<float>((acc >> (j * B)) & ((1u << B) - 1u));
      float y = __fmul_rn(__fadd_rn(mn, __fmul_rn(code, unit)), post);
      // As the CPU kernel: an overshoot past O's largest finite value is
      // clamped (a comparison, not fminf, so that NaN passes through).
      y = y > O::kMax ? O::kMax : y;
      out[e] = accumulate ? O::store(__fadd_rn(O::load(out[e]), y)) : O::store(y);
    }
  }
}

// Writes one group's `B` bytes; `out` is aligned to 8 bytes (launch_quantize checks).
template <int B>
__device__ __forceinline__ void store_group(uint8_t* out, uint64_t group) {
  if constexpr (B == 1) *out = static_cast<uint8_t>(group);
  else if constexpr (B == 2) *reinterpret_cast<uint16_t*>(out) = static_cast<uint16_t>(group);
  else if constexpr (B == 4) *reinterpret_cast<uint32_t*>(out) = static_cast<uint32_t>(group);
  else if constexpr (B == 8) *reinterpret_cast<uint64_t*>(out) = group;
  else {
#pragma unroll
    for (int k = 0; k < B; ++k) out[k] = static_cast<uint8_t>(group >> (8 * k));
  }
}

template <int B>
__device__ __forceinline__ uint64_t load_group(const uint8_t* in) {
  if constexpr (B == 1) return *in;
  else if constexpr (B == 2) return *reinterpret_cast<const uint16_t*>(in);
  else if constexpr (B == 4) return *reinterpret_cast<const uint32_t*>(in);
  else if constexpr (B == 8) return *reinterpret_cast<const uint64_t*>(in);
  else {
    uint64_t acc = 0;
#pragma unroll
    for (int k = 0; k < B; ++k) acc |= static_cast<uint64_t>(in[k]) << (8 * k);
    return acc;
  }
}

// The fast path's quantize: one warp per bucket reduces and encodes it
// (bucket_size % 8 == 0, so a bucket starts at a group and a 4-value quad
// never straddles two; x aligned to 16 bytes, values to 8). Lane l takes the
// quads l, l + 32, ... (bucket_size == 128 * Q) and keeps them in registers
// between the two passes.
template <class T, int B, int Q>
__global__ void bucket_quantize_kernel(const typename T::storage* __restrict__ x, int64_t nq,
                                       int64_t bs, bool stochastic, uint64_t seed,
                                       bool fp16_meta, void* __restrict__ mins,
                                       void* __restrict__ units, uint8_t* __restrict__ values) {
  static_assert(Q > 0, "a bucket of 128 * Q values");
  const int lane = threadIdx.x & 31;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t nb = (nq + bs - 1) / bs;
  const float levels = static_cast<float>((1 << B) - 1);
  for (int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; b < nb;
       b += warps) {
    const int64_t a = b * bs, n = min(nq, a + bs) - a;
    const typename T::storage* xb = x + a;
    const int64_t quads = (n + 3) >> 2;
    float first = T::load(xb[0]);
    float mn = first, mx = first, z = 0.0f;
    float held[Q][4];
#pragma unroll
    for (int k = 0; k < Q; ++k) {
      const int64_t i = 4 * (lane + 32 * k);
      if (i + 4 <= n) {
        load4<T>(xb + i, held[k]);
      } else {
        // Past the bucket's end: its first value, which moves neither min
        // nor max, and whose non-finiteness the sum sees anyway.
#pragma unroll
        for (int j = 0; j < 4; ++j) held[k][j] = i + j < n ? T::load(xb[i + j]) : first;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) scan_value(held[k][j], mn, mx, z);
    }
    warp_combine(mn, mx, z);
    // Every lane holds the same reduction, so the same stored meta.
    const BucketMeta m = bucket_meta(mn, mx, z, B, fp16_meta);
    if (lane == 0) store_meta(m, fp16_meta, mins, units, b);
    const EncodeParams p = encode_params(m.min, m.unit, levels);
    // The hash keys change every 2^32 elements: once per bucket, but for the
    // rare bucket across such a line.
    const bool one_key = (a >> 32) == ((a + n - 1) >> 32);
    const mpxq::HashKeys bucket_keys = mpxq::hash_keys(seed, static_cast<uint32_t>(a >> 32));
    // Whole rounds of 32 quads, so every lane reaches each shuffle.
    for (int64_t round = 0; round < Q; ++round) {
      const int64_t q = 32 * round + lane;
      uint32_t codes = 0;  // this quad's 4 codes, B bits each
      if (q < quads && !p.flagged) {
        const int64_t e0 = a + 4 * q;
        const int count = n - 4 * q < 4 ? static_cast<int>(n - 4 * q) : 4;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < Q; ++k) {
          if (k == round) {
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] = held[k][j];
          }
        }
        const mpxq::HashKeys keys =
            one_key ? bucket_keys : mpxq::hash_keys(seed, static_cast<uint32_t>(e0 >> 32));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (k >= count) break;  // past the end: code 0, as the general kernel
          const float r =
              stochastic ? mpxq::hash_uniform(keys, static_cast<uint32_t>(e0 + k)) : 0.5f;
          codes |= encode_one(v[k], p, levels, r) << (k * B);
        }
      }
      // A group is two quads: the even lane joins its odd neighbour's codes.
      const uint32_t upper = __shfl_down_sync(0xFFFFFFFFu, codes, 1);
      if ((lane & 1) == 0 && q < quads) {
        const uint64_t group = codes | (static_cast<uint64_t>(upper) << (4 * B));
        store_group<B>(values + ((a >> 3) + (q >> 1)) * B, group);
      }
    }
  }
}

// The fast path's decode: one thread per 4 values (bucket_size % 8 == 0;
// out aligned to 16 bytes, values to 8).
template <class O, int B>
__global__ void quad_decode_kernel(const uint8_t* __restrict__ values,
                                   const void* __restrict__ mins, const void* __restrict__ units,
                                   bool fp16_meta, int64_t nq, int64_t bs,
                                   typename O::storage* __restrict__ out, bool accumulate) {
  const int64_t quads = (nq + 3) / 4;
  const float levels = static_cast<float>((1 << B) - 1);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // 32-bit division where the indices fit: a 64-bit one costs several times more.
  const bool narrow = nq <= 0xFFFFFFFFll;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < quads;
       q += stride) {
    const int64_t e0 = 4 * q;
    const int64_t b = narrow ? static_cast<int64_t>(static_cast<uint32_t>(e0) /
                                                    static_cast<uint32_t>(bs))
                             : e0 / bs;
    float mn = load_meta(mins, b, fp16_meta);
    float unit = load_meta(units, b, fp16_meta);
    // A wide bucket decodes at half scale, then doubles (qmath.h); NaN is never wide.
    const bool wide = mpxq::is_wide(unit, levels);
    const float post = wide ? 2.0f : 1.0f;
    if (wide) {
      mn = __fmul_rn(mn, 0.5f);
      unit = __fmul_rn(unit, 0.5f);
    }
    const uint64_t group = load_group<B>(values + (e0 >> 3) * B);
    const int shift = static_cast<int>((e0 >> 2) & 1) * 4 * B;
    float y[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float code = static_cast<float>((group >> (shift + k * B)) & ((1u << B) - 1u));
      float v = __fmul_rn(__fadd_rn(mn, __fmul_rn(code, unit)), post);
      y[k] = v > O::kMax ? O::kMax : v;  // as the general kernel: NaN passes through
    }
    typename O::storage* o = out + e0;
    if (e0 + 4 <= nq) {
      if (accumulate) {
        float old[4];
        load4<O>(o, old);
#pragma unroll
        for (int k = 0; k < 4; ++k) y[k] = __fadd_rn(old[k], y[k]);
      }
      store4<O>(o, y);
    } else {
      for (int k = 0; e0 + k < nq; ++k)
        o[k] = accumulate ? O::store(__fadd_rn(O::load(o[k]), y[k])) : O::store(y[k]);
    }
  }
}

unsigned blocks_for(int64_t threads_needed) {
  int64_t blocks = (threads_needed + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks > (1 << 20) ? (1 << 20) : blocks);
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The fast path takes buckets of whole groups, small enough that a warp per
// bucket leaves work for every multiprocessor, and aligned buffers.
bool fast_layout(int64_t bs, const void* data, const uint8_t* values) {
  return bs % 8 == 0 && bs >= 128 && bs <= (int64_t{1} << 16) && aligned(data, 16) &&
         aligned(values, 8);
}

template <class T, int B>
void launch_quantize(const void* x, int64_t nq, int64_t bs, bool stochastic, uint64_t seed,
                     bool fp16_meta, void* mins, void* units, uint8_t* values, cudaStream_t s) {
  auto px = static_cast<const typename T::storage*>(x);
  const int64_t nb = (nq + bs - 1) / bs;
  // CGX's and DDP's usual buckets keep their values in registers; other sizes
  // take the general kernels (a variant that read the bucket twice gained
  // only ~5 % on the H200: not worth its compile time).
  if ((bs == 512 || bs == 1024) && fast_layout(bs, x, values)) {
    const unsigned blocks = blocks_for(nb * 32);
    if (bs == 512)
      bucket_quantize_kernel<T, B, 4><<<blocks, kThreads, 0, s>>>(
          px, nq, bs, stochastic, seed, fp16_meta, mins, units, values);
    else
      bucket_quantize_kernel<T, B, 8><<<blocks, kThreads, 0, s>>>(
          px, nq, bs, stochastic, seed, fp16_meta, mins, units, values);
    return;
  }
  meta_kernel<T><<<blocks_for(nb * 32), kThreads, 0, s>>>(px, nq, bs, B, fp16_meta, mins, units);
  encode_kernel<T, B><<<blocks_for((nq + 7) / 8), kThreads, 0, s>>>(
      px, nq, bs, stochastic, seed, fp16_meta, mins, units, values);
}

template <class T>
void quantize_bits(int bits, const void* x, int64_t nq, int64_t bs, bool stochastic,
                   uint64_t seed, bool fp16_meta, void* mins, void* units, uint8_t* values,
                   cudaStream_t s) {
  switch (bits) {
#define MPXQ_CASE(BITS)                                                                      \
  case BITS:                                                                                 \
    return launch_quantize<T, BITS>(x, nq, bs, stochastic, seed, fp16_meta, mins, units, \
                                    values, s);
    MPXQ_CASE(1) MPXQ_CASE(2) MPXQ_CASE(3) MPXQ_CASE(4)
    MPXQ_CASE(5) MPXQ_CASE(6) MPXQ_CASE(7) MPXQ_CASE(8)
#undef MPXQ_CASE
  }
}

template <class O>
void dequantize_bits(int bits, const uint8_t* values, const void* mins, const void* units,
                     bool fp16_meta, int64_t nq, int64_t bs, void* out, bool accumulate,
                     cudaStream_t s) {
  auto po = static_cast<typename O::storage*>(out);
  if (fast_layout(bs, out, values)) {
    const unsigned quad_blocks = blocks_for((nq + 3) / 4);
    switch (bits) {
#define MPXQ_CASE(BITS)                                                                        \
  case BITS:                                                                                   \
    quad_decode_kernel<O, BITS><<<quad_blocks, kThreads, 0, s>>>(values, mins, units,          \
                                                                 fp16_meta, nq, bs, po,        \
                                                                 accumulate);                  \
    return;
      MPXQ_CASE(1) MPXQ_CASE(2) MPXQ_CASE(3) MPXQ_CASE(4)
      MPXQ_CASE(5) MPXQ_CASE(6) MPXQ_CASE(7) MPXQ_CASE(8)
#undef MPXQ_CASE
    }
  }
  const unsigned blocks = blocks_for((nq + 7) / 8);
  switch (bits) {
#define MPXQ_CASE(BITS)                                                                       \
  case BITS:                                                                                  \
    decode_kernel<O, BITS><<<blocks, kThreads, 0, s>>>(values, mins, units, fp16_meta, nq, bs, \
                                                      po, accumulate);                        \
    return;
    MPXQ_CASE(1) MPXQ_CASE(2) MPXQ_CASE(3) MPXQ_CASE(4)
    MPXQ_CASE(5) MPXQ_CASE(6) MPXQ_CASE(7) MPXQ_CASE(8)
#undef MPXQ_CASE
  }
}

}  // namespace

int quantize(const void* x, int dtype, int64_t nq, int bits, int64_t bs, bool stochastic,
             uint64_t seed, void* mins, void* units, uint8_t* values, int device,
             uintptr_t stream) {
  if (nq == 0) return 0;
  cudaError_t status = cudaSetDevice(device);
  if (status != cudaSuccess) return static_cast<int>(status);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const bool fp16_meta = dtype == mpxq::kFloat16;
  if (dtype == mpxq::kFloat32)
    quantize_bits<F32>(bits, x, nq, bs, stochastic, seed, fp16_meta, mins, units, values, s);
  else if (dtype == mpxq::kFloat16)
    quantize_bits<F16>(bits, x, nq, bs, stochastic, seed, fp16_meta, mins, units, values, s);
  else
    quantize_bits<BF16>(bits, x, nq, bs, stochastic, seed, fp16_meta, mins, units, values, s);
  return static_cast<int>(cudaGetLastError());
}

int dequantize(const uint8_t* values, const void* mins, const void* units, int qdtype,
               int64_t nq, int bits, int64_t bs, void* out, int out_dtype, bool accumulate,
               int device, uintptr_t stream) {
  if (nq == 0) return 0;
  cudaError_t status = cudaSetDevice(device);
  if (status != cudaSuccess) return static_cast<int>(status);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const bool fp16_meta = qdtype == mpxq::kFloat16;
  if (out_dtype == mpxq::kFloat32)
    dequantize_bits<F32>(bits, values, mins, units, fp16_meta, nq, bs, out, accumulate, s);
  else if (out_dtype == mpxq::kFloat16)
    dequantize_bits<F16>(bits, values, mins, units, fp16_meta, nq, bs, out, accumulate, s);
  else
    dequantize_bits<BF16>(bits, values, mins, units, fp16_meta, nq, bs, out, accumulate, s);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace mpx_quantize
