// mpx-quantize CPU kernels, compiled twice (kernels_base.cpp for any x86-64 /
// other CPU, kernels_avx2.cpp with -mavx2 where the compiler targets x86-64);
// module.cpp picks one at run time. Both are plain IEEE float32 code without
// FMA contraction, so they give the same bits.
//
// The formulas are those of reference.py, evaluated in float32 in the same
// order (the build passes -ffp-contract=off: no FMA contraction), so nearest
// rounding is bit-identical to the torch reference and stochastic rounding
// draws the same noise from the counter hash in qmath.h.
//
// Work is split over std::threads by spans of whole buckets that also start on
// a packing group (8 codes), so no two threads write the same output byte:
//
//   bucket_size % 8 == 0:  span = 1 bucket      |b0|b1|b2|...
//   otherwise:             span = 8/gcd(bs, 8) buckets, a multiple of 8 values
//
// Within a span each bucket's min/max is one pass (16 float lanes the compiler
// vectorises), then chunks of 1024 values are encoded and packed.
// Include once per translation unit, with MPXQ_KERNEL_NS defined.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>

#if defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#include "../common/qmath.h"
#include "kernels.h"

namespace MPXQ_KERNEL_NS {
namespace {

using mpxq::kChunk;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 <-> binary32, round to nearest even (as torch's conversions).
inline float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;  // mant * 2^-24, exact
    return float_of(bits_of(mag) | sign);
  }
  if (exp == 31) return float_of(sign | 0x7F800000u | (mant << 13));
  return float_of(sign | ((exp + 112) << 23) | (mant << 13));
}

inline uint16_t float_to_half(float f) {
  uint32_t x = bits_of(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u);
  if (ax >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {                         // below 2^-14: subnormal half
    // a * 2^24 is exact; adding and removing 2^23 rounds it to an integer (RNE).
    float scaled = float_of(ax) * 16777216.0f;
    float rounded = (scaled + 8388608.0f) - 8388608.0f;
    return sign | static_cast<uint16_t>(rounded);
  }
  uint32_t odd = (ax >> 13) & 1u;
  ax += 0xC8000FFFu + odd;  // exponent bias 127 -> 15, plus the round-to-even bias
  return sign | static_cast<uint16_t>(ax >> 13);
}

inline float bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct F32 {
  using storage = float;
  static float load(float v) { return v; }
  static float store(float f) { return f; }
  static constexpr float kMax = 3.40282347e38f;  // the largest finite value
};
struct F16 {
  using storage = uint16_t;
  static float load(uint16_t v) { return half_to_float(v); }
  static uint16_t store(float f) { return float_to_half(f); }
  static constexpr float kMax = 65504.0f;
};
struct BF16 {
  using storage = uint16_t;
  static float load(uint16_t v) { return bf16_to_float(v); }
  static uint16_t store(float f) { return float_to_bf16(f); }
  static constexpr float kMax = 3.38953139e38f;
};

// A decoded value no larger than O's largest finite value (NaN stays NaN).
template <class O>
inline float finite(float y) {
  return y > O::kMax ? O::kMax : y;
}

constexpr uint32_t kNanF32 = 0x7FC00000u;
constexpr uint16_t kNanF16 = 0x7E00u;

// Runs fn(begin, end) over [0, n) split into contiguous ranges, one per
// thread. The threads are started by module.cpp (baseline code): this file is
// compiled per instruction set and keeps to arithmetic.
template <class Fn>
void parallel_for(int64_t n, int threads, Fn fn) {
  if (n <= 0) return;
  auto call = [](void* ctx, int64_t begin, int64_t end) { (*static_cast<Fn*>(ctx))(begin, end); };
  mpxq_parallel_for(n, threads, call, &fn);
}

// Threads worth starting for `elements` values: none below ~64 Ki per thread.
int useful_threads(int requested, int64_t elements) {
  int64_t by_size = elements / 65536;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(requested, by_size)));
}

template <int B>
inline void pack8(const uint8_t* codes, uint8_t* out) {
  uint64_t acc = 0;
  for (int j = 0; j < 8; ++j) acc |= static_cast<uint64_t>(codes[j]) << (j * B);
  for (int k = 0; k < B; ++k) out[k] = static_cast<uint8_t>(acc >> (8 * k));
}

template <int B>
inline void unpack8(const uint8_t* in, uint8_t* codes) {
  uint64_t acc = 0;
  for (int k = 0; k < B; ++k) acc |= static_cast<uint64_t>(in[k]) << (8 * k);
  for (int j = 0; j < 8; ++j) codes[j] = static_cast<uint8_t>((acc >> (j * B)) & ((1u << B) - 1u));
}

// Packs `groups` groups of 8 codes. Widths that divide a byte pack byte by
// byte (a loop the compiler vectorises); the others through a 64-bit word.
template <int B>
inline void pack_groups(const uint8_t* codes, int64_t groups, uint8_t* dst) {
  if constexpr (B == 8) {
    std::memcpy(dst, codes, static_cast<size_t>(groups * 8));
  } else if constexpr (B == 4 || B == 2 || B == 1) {
    constexpr int per = 8 / B;
    const int64_t nbytes = groups * B;
    for (int64_t k = 0; k < nbytes; ++k) {
      unsigned v = 0;
      for (int j = 0; j < per; ++j) v |= static_cast<unsigned>(codes[k * per + j]) << (j * B);
      dst[k] = static_cast<uint8_t>(v);
    }
  } else {
    for (int64_t g = 0; g < groups; ++g) pack8<B>(codes + 8 * g, dst + g * B);
  }
}

template <int B>
inline void unpack_groups(const uint8_t* src, int64_t groups, uint8_t* codes) {
  if constexpr (B == 8) {
    std::memcpy(codes, src, static_cast<size_t>(groups * 8));
  } else if constexpr (B == 4 || B == 2 || B == 1) {
    constexpr int per = 8 / B;
    const int64_t nbytes = groups * B;
    for (int64_t k = 0; k < nbytes; ++k)
      for (int j = 0; j < per; ++j)
        codes[k * per + j] = static_cast<uint8_t>((src[k] >> (j * B)) & ((1u << B) - 1u));
  } else {
    for (int64_t g = 0; g < groups; ++g) unpack8<B>(src + g * B, codes + 8 * g);
  }
}

struct BucketMeta {
  float mn;     // the bucket's min (halved in a wide bucket, see qmath.h)
  float recip;  // 1 / unit (1 / (unit / 2) in a wide bucket)
  bool flagged;
  bool wide;
};

// min/max/non-finite scan and the stored metadata of one bucket [a, e).
template <class T>
BucketMeta bucket_meta(const typename T::storage* x, int64_t a, int64_t e, int bits,
                       bool fp16_meta, void* mins, void* units, int64_t bucket) {
  constexpr int L = 16;
  float lmin[L], lmax[L], lz[L];
  float first = T::load(x[a]);
  for (int l = 0; l < L; ++l) {
    lmin[l] = first;
    lmax[l] = first;
    lz[l] = 0.0f;
  }
  int64_t i = a;
#if defined(__AVX2__) || defined(__SSE2__)
  if constexpr (std::is_same_v<T, F32>) {
    // min_ps(v, m) is exactly `v < m ? v : m` (m when v is NaN): the scalar
    // semantics, written out because GCC does not vectorise the select itself.
#if defined(__AVX2__)
    using V = __m256;
    constexpr int W = 8;
    auto load = [](const float* p) { return _mm256_loadu_ps(p); };
    auto vmin = [](V v, V m) { return _mm256_min_ps(v, m); };
    auto vmax = [](V v, V m) { return _mm256_max_ps(v, m); };
    auto vadd = [](V p, V q) { return _mm256_add_ps(p, q); };
    auto vsub = [](V p, V q) { return _mm256_sub_ps(p, q); };
    auto store = [](float* p, V v) { _mm256_storeu_ps(p, v); };
    auto splat = [](float f) { return _mm256_set1_ps(f); };
#else
    using V = __m128;
    constexpr int W = 4;
    auto load = [](const float* p) { return _mm_loadu_ps(p); };
    auto vmin = [](V v, V m) { return _mm_min_ps(v, m); };
    auto vmax = [](V v, V m) { return _mm_max_ps(v, m); };
    auto vadd = [](V p, V q) { return _mm_add_ps(p, q); };
    auto vsub = [](V p, V q) { return _mm_sub_ps(p, q); };
    auto store = [](float* p, V v) { _mm_storeu_ps(p, v); };
    auto splat = [](float f) { return _mm_set1_ps(f); };
#endif
    static_assert(L % (2 * W) == 0, "lanes");
    V mn0 = splat(first), mn1 = mn0, mx0 = mn0, mx1 = mn0, z0 = splat(0.0f), z1 = z0;
    const float* p = reinterpret_cast<const float*>(x);
    for (; i + 2 * W <= e; i += 2 * W) {
      V v0 = load(p + i), v1 = load(p + i + W);
      mn0 = vmin(v0, mn0);
      mn1 = vmin(v1, mn1);
      mx0 = vmax(v0, mx0);
      mx1 = vmax(v1, mx1);
      z0 = vadd(z0, vsub(v0, v0));
      z1 = vadd(z1, vsub(v1, v1));
    }
    store(lmin, mn0);
    store(lmin + W, mn1);
    store(lmax, mx0);
    store(lmax + W, mx1);
    store(lz, z0);
    store(lz + W, z1);
  }
#endif
  for (; i + L <= e; i += L) {
    for (int l = 0; l < L; ++l) {
      float v = T::load(x[i + l]);
      lmin[l] = v < lmin[l] ? v : lmin[l];
      lmax[l] = v > lmax[l] ? v : lmax[l];
      lz[l] += v - v;  // 0 for finite values, NaN once a NaN or an infinity is seen
    }
  }
  for (; i < e; ++i) {
    float v = T::load(x[i]);
    lmin[0] = v < lmin[0] ? v : lmin[0];
    lmax[0] = v > lmax[0] ? v : lmax[0];
    lz[0] += v - v;
  }
  float mn = lmin[0], mx = lmax[0], z = lz[0];
  for (int l = 1; l < L; ++l) {
    mn = lmin[l] < mn ? lmin[l] : mn;
    mx = lmax[l] > mx ? lmax[l] : mx;
    z += lz[l];
  }
  mn = mn + 0.0f;  // -0 -> +0, as the reference
  const float levels = static_cast<float>((1 << bits) - 1);
  float rng = mx - mn;
  // A range past float32 (finite values, e.g. -3e38 and 3e38) is taken at half
  // scale; the unit itself overflows only at 1 bit (unit = range): flagged.
  float unit = std::isfinite(rng) ? rng / levels : ((mx * 0.5f - mn * 0.5f) / levels) * 2.0f;
  if (fp16_meta) {
    uint16_t u16 = float_to_half(unit);
    if (half_to_float(u16) < unit) ++u16;  // round the unit up: codes stay within levels
    unit = half_to_float(u16);
  }
  float recip = 1.0f / unit;
  if (!std::isfinite(recip)) {  // unit 0 (constant bucket) or too small to invert
    unit = 0.0f;
    recip = 0.0f;
  }
  bool flagged = std::isnan(z) || !std::isfinite(unit);
  if (fp16_meta) {
    static_cast<uint16_t*>(mins)[bucket] = flagged ? kNanF16 : float_to_half(mn);
    static_cast<uint16_t*>(units)[bucket] = flagged ? kNanF16 : float_to_half(unit);
  } else {
    static_cast<float*>(mins)[bucket] = flagged ? float_of(kNanF32) : mn;
    static_cast<float*>(units)[bucket] = flagged ? float_of(kNanF32) : unit;
  }
  if (flagged) return BucketMeta{0.0f, 0.0f, true, false};
  if (mpxq::is_wide(unit, levels)) return BucketMeta{mn * 0.5f, 1.0f / (unit * 0.5f), false, true};
  return BucketMeta{mn, recip, false, false};
}

template <class T, int B>
void quantize_impl(const typename T::storage* x, int64_t nq, int64_t bs, bool stochastic,
                   uint64_t seed, bool fp16_meta, void* mins, void* units, uint8_t* values,
                   int threads) {
  const int64_t per_span = 8 / std::gcd<int64_t>(bs, 8);
  const int64_t span_elems = bs * per_span;
  const int64_t spans = (nq + span_elems - 1) / span_elems;
  const float levels = static_cast<float>((1 << B) - 1);
  parallel_for(spans, useful_threads(threads, nq), [=](int64_t s_begin, int64_t s_end) {
    uint8_t codes[kChunk];
    BucketMeta meta[8];
    for (int64_t s = s_begin; s < s_end; ++s) {
      const int64_t s0 = s * span_elems, s1 = std::min(nq, s0 + span_elems);
      const int64_t b0 = s0 / bs;
      for (int64_t b = b0; b * bs < s1; ++b)
        meta[b - b0] = bucket_meta<T>(x, b * bs, std::min(s1, (b + 1) * bs), B, fp16_meta, mins,
                                      units, b);
      for (int64_t c0 = s0; c0 < s1;) {
        // A chunk never crosses a multiple of 2^32: the hash keys are per index_hi.
        const int64_t hi_end = ((c0 >> 32) + 1) << 32;
        const int64_t c1 = std::min({s1, c0 + kChunk, hi_end});
        const mpxq::HashKeys keys = mpxq::hash_keys(seed, static_cast<uint32_t>(c0 >> 32));
        for (int64_t a = c0; a < c1;) {
          const int64_t b = a / bs;
          const int64_t e = std::min(c1, (b + 1) * bs);
          const BucketMeta m = meta[b - b0];
          uint8_t* out = codes + (a - c0);
          if (m.flagged) {
            std::memset(out, 0, static_cast<size_t>(e - a));
          } else if (m.wide) {  // at half scale (qmath.h): x - min would overflow
            for (int64_t i = a; i < e; ++i) {
              const float r =
                  stochastic ? mpxq::hash_uniform(keys, static_cast<uint32_t>(i)) : 0.5f;
              float t = (T::load(x[i]) * 0.5f - m.mn) * m.recip + r;
              t = t < levels ? t : levels;
              t = t > 0.0f ? t : 0.0f;
              out[i - a] = static_cast<uint8_t>(static_cast<int32_t>(t));
            }
          } else if (stochastic) {
            for (int64_t i = a; i < e; ++i) {
              float t = (T::load(x[i]) - m.mn) * m.recip + mpxq::hash_uniform(keys, static_cast<uint32_t>(i));
              t = t < levels ? t : levels;
              t = t > 0.0f ? t : 0.0f;
              out[i - a] = static_cast<uint8_t>(static_cast<int32_t>(t));
            }
          } else {
            for (int64_t i = a; i < e; ++i) {
              float t = (T::load(x[i]) - m.mn) * m.recip + 0.5f;
              t = t < levels ? t : levels;
              t = t > 0.0f ? t : 0.0f;
              out[i - a] = static_cast<uint8_t>(static_cast<int32_t>(t));
            }
          }
          a = e;
        }
        const int64_t len = c1 - c0;
        const int64_t groups = (len + 7) / 8;
        std::memset(codes + len, 0, static_cast<size_t>(groups * 8 - len));  // pad the last group
        uint8_t* dst = values + (c0 / 8) * B;
        pack_groups<B>(codes, groups, dst);
        c0 = c1;
      }
    }
  });
}

template <class O, int B>
void dequantize_impl(const uint8_t* values, const void* mins, const void* units, bool fp16_meta,
                     int64_t nq, int64_t bs, typename O::storage* out, bool accumulate,
                     int threads) {
  const int64_t chunks = (nq + kChunk - 1) / kChunk;
  const float levels = static_cast<float>((1 << B) - 1);
  parallel_for(chunks, useful_threads(threads, nq), [=](int64_t k_begin, int64_t k_end) {
    uint8_t codes[kChunk];
    for (int64_t k = k_begin; k < k_end; ++k) {
      const int64_t c0 = k * kChunk, c1 = std::min(nq, c0 + kChunk);
      const int64_t groups = (c1 - c0 + 7) / 8;
      const uint8_t* src = values + (c0 / 8) * B;
      unpack_groups<B>(src, groups, codes);
      for (int64_t a = c0; a < c1;) {
        const int64_t b = a / bs;
        const int64_t e = std::min(c1, (b + 1) * bs);
        float mn, unit;
        if (fp16_meta) {
          mn = half_to_float(static_cast<const uint16_t*>(mins)[b]);
          unit = half_to_float(static_cast<const uint16_t*>(units)[b]);
        } else {
          mn = static_cast<const float*>(mins)[b];
          unit = static_cast<const float*>(units)[b];
        }
        const uint8_t* cs = codes + (a - c0);
        typename O::storage* o = out + a;
        // A decoded value may overshoot the bucket's max by the unit's rounding;
        // near the dtype's largest value that would round to inf: clamp it (a
        // comparison, so a flagged bucket's NaN passes through).
        if (mpxq::is_wide(unit, levels)) {
          // min + code * unit may overflow: at half scale, then doubled (qmath.h).
          const float mh = mn * 0.5f, uh = unit * 0.5f;
          for (int64_t i = 0; i < e - a; ++i) {
            const float y = finite<O>((mh + static_cast<float>(cs[i]) * uh) * 2.0f);
            o[i] = O::store(accumulate ? O::load(o[i]) + y : y);
          }
        } else if (accumulate) {
          for (int64_t i = 0; i < e - a; ++i)
            o[i] = O::store(O::load(o[i]) + finite<O>(mn + static_cast<float>(cs[i]) * unit));
        } else {
          for (int64_t i = 0; i < e - a; ++i)
            o[i] = O::store(finite<O>(mn + static_cast<float>(cs[i]) * unit));
        }
        a = e;
      }
    }
  });
}

template <class T>
void quantize_bits(int bits, const void* x, int64_t nq, int64_t bs, bool stochastic, uint64_t seed,
                   bool fp16_meta, void* mins, void* units, uint8_t* values, int threads) {
  auto px = static_cast<const typename T::storage*>(x);
  switch (bits) {
#define MPXQ_CASE(BITS)                                                                     \
  case BITS:                                                                                \
    return quantize_impl<T, BITS>(px, nq, bs, stochastic, seed, fp16_meta, mins, units, \
                                  values, threads);
    MPXQ_CASE(1) MPXQ_CASE(2) MPXQ_CASE(3) MPXQ_CASE(4)
    MPXQ_CASE(5) MPXQ_CASE(6) MPXQ_CASE(7) MPXQ_CASE(8)
#undef MPXQ_CASE
  }
  // bits outside 1-8 never get here: module.cpp checks them
}

template <class O>
void dequantize_bits(int bits, const uint8_t* values, const void* mins, const void* units,
                     bool fp16_meta, int64_t nq, int64_t bs, void* out, bool accumulate,
                     int threads) {
  auto po = static_cast<typename O::storage*>(out);
  switch (bits) {
#define MPXQ_CASE(BITS)                                                                          \
  case BITS:                                                                                     \
    return dequantize_impl<O, BITS>(values, mins, units, fp16_meta, nq, bs, po, accumulate, \
                                    threads);
    MPXQ_CASE(1) MPXQ_CASE(2) MPXQ_CASE(3) MPXQ_CASE(4)
    MPXQ_CASE(5) MPXQ_CASE(6) MPXQ_CASE(7) MPXQ_CASE(8)
#undef MPXQ_CASE
  }
  // bits outside 1-8 never get here: module.cpp checks them
}

}  // namespace

void quantize(int dtype, int bits, const void* x, int64_t nq, int64_t bs, bool stochastic,
              uint64_t seed, void* mins, void* units, uint8_t* values, int threads) {
  const bool fp16_meta = dtype == mpxq::kFloat16;
  if (dtype == mpxq::kFloat32)
    quantize_bits<F32>(bits, x, nq, bs, stochastic, seed, fp16_meta, mins, units, values, threads);
  else if (dtype == mpxq::kFloat16)
    quantize_bits<F16>(bits, x, nq, bs, stochastic, seed, fp16_meta, mins, units, values, threads);
  else
    quantize_bits<BF16>(bits, x, nq, bs, stochastic, seed, fp16_meta, mins, units, values,
                        threads);
}

void dequantize(int qdtype, int out_dtype, int bits, const uint8_t* values, const void* mins,
                const void* units, int64_t nq, int64_t bs, void* out, bool accumulate,
                int threads) {
  const bool fp16_meta = qdtype == mpxq::kFloat16;
  if (out_dtype == mpxq::kFloat32)
    dequantize_bits<F32>(bits, values, mins, units, fp16_meta, nq, bs, out, accumulate, threads);
  else if (out_dtype == mpxq::kFloat16)
    dequantize_bits<F16>(bits, values, mins, units, fp16_meta, nq, bs, out, accumulate, threads);
  else
    dequantize_bits<BF16>(bits, values, mins, units, fp16_meta, nq, bs, out, accumulate,
                          threads);
}

}  // namespace MPXQ_KERNEL_NS
