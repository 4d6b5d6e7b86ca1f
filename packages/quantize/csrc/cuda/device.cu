// mpx-quantize CUDA kernels: the same packed layout and float formulas as the
// CPU kernels and reference.py. Every float operation is an explicit _rn
// intrinsic (and the build passes --fmad=false), so nvcc cannot fuse a*b+c
// into an FMA: nearest rounding is bit-identical to the CPU.
//
//   meta kernel     one warp per bucket: min, max, non-finite scan (shuffle
//                   reduction), then lane 0 writes the bucket's min and unit
//   encode kernel   one thread per group of 8 values: 8 codes -> `bits` bytes
//   decode kernel   one thread per group of 8 values: `bits` bytes -> 8 values
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

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
    for (int64_t i = a + lane; i < e; i += 32) {
      float v = T::load(x[i]);
      mn = v < mn ? v : mn;
      mx = v > mx ? v : mx;
      z = __fadd_rn(z, __fsub_rn(v, v));  // NaN once a NaN or an infinity is seen
    }
    for (int off = 16; off > 0; off >>= 1) {
      float omn = __shfl_xor_sync(0xFFFFFFFFu, mn, off);
      float omx = __shfl_xor_sync(0xFFFFFFFFu, mx, off);
      float oz = __shfl_xor_sync(0xFFFFFFFFu, z, off);
      mn = omn < mn ? omn : mn;
      mx = omx > mx ? omx : mx;
      z = __fadd_rn(z, oz);
    }
    if (lane == 0) {
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
      bool flagged = isnan(z) || !isfinite(unit);
      if (fp16_meta) {
        static_cast<__half*>(mins)[b] =
            flagged ? __ushort_as_half(kNanF16) : __float2half_rn(mn);
        static_cast<__half*>(units)[b] =
            flagged ? __ushort_as_half(kNanF16) : __float2half_rn(unit);
      } else {
        static_cast<float*>(mins)[b] = flagged ? __uint_as_float(kNanF32) : mn;
        static_cast<float*>(units)[b] = flagged ? __uint_as_float(kNanF32) : unit;
      }
    }
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
    int64_t b = -1, next = e0;  // current bucket and where the next one starts
    float mn = 0.0f, recip = 0.0f, scale = 1.0f;
    bool flagged = false;
    uint64_t acc = 0;
    for (int j = 0; j < 8; ++j) {
      const int64_t e = e0 + j;
      if (e >= nq) break;
      if (e >= next) {
        b = e / bs;
        next = (b + 1) * bs;
        mn = load_meta(mins, b, fp16_meta);
        float unit = load_meta(units, b, fp16_meta);
        flagged = isnan(unit);
        // A wide bucket is encoded at half scale (qmath.h); x * 1 is x exactly.
        scale = !flagged && mpxq::is_wide(unit, levels) ? 0.5f : 1.0f;
        mn = __fmul_rn(mn, scale);
        recip = __fdiv_rn(1.0f, __fmul_rn(unit, scale));
        if (flagged || !isfinite(recip)) recip = 0.0f;
      }
      unsigned code = 0;
      if (!flagged) {
        float r = stochastic ? mpxq::hash_uniform(keys, static_cast<uint32_t>(e)) : 0.5f;
        float t = __fadd_rn(__fmul_rn(__fsub_rn(__fmul_rn(T::load(x[e]), scale), mn), recip), r);
        t = t < levels ? t : levels;
        t = t > 0.0f ? t : 0.0f;
        code = static_cast<unsigned>(__float2int_rz(t));
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

unsigned blocks_for(int64_t threads_needed) {
  int64_t blocks = (threads_needed + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks > (1 << 20) ? (1 << 20) : blocks);
}

template <class T, int B>
void launch_quantize(const void* x, int64_t nq, int64_t bs, bool stochastic, uint64_t seed,
                     bool fp16_meta, void* mins, void* units, uint8_t* values, cudaStream_t s) {
  auto px = static_cast<const typename T::storage*>(x);
  const int64_t nb = (nq + bs - 1) / bs;
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
