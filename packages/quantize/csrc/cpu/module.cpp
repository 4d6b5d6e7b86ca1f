// mpx-quantize CPU extension: argument checks, the choice of kernel variant
// (AVX2 where the CPU has it), and the pybind11 bindings. The kernels are in
// kernels_impl.h.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../common/qmath.h"
#include "kernels.h"

namespace py = pybind11;

void mpxq_parallel_for(int64_t n, int threads, void (*fn)(void*, int64_t, int64_t), void* ctx) {
  if (n <= 0) return;
  int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  if (t == 1) {
    fn(ctx, 0, n);
    return;
  }
  int64_t step = (n + t - 1) / t;
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(t - 1));
  for (int64_t i = 1; i < t; ++i) {
    int64_t b = i * step, e = std::min(n, (i + 1) * step);
    if (b < e) pool.emplace_back(fn, ctx, b, e);
  }
  fn(ctx, 0, std::min(n, step));
  for (auto& th : pool) th.join();
}

namespace {

bool use_avx2() {
#if defined(MPXQ_HAVE_AVX2) && (defined(__x86_64__) || defined(__i386__))
  // MPX_QUANTIZE_CPU_KERNELS=baseline forces the baseline variant (tests, comparisons).
  static const bool has = [] {
    const char* forced = std::getenv("MPX_QUANTIZE_CPU_KERNELS");
    if (forced != nullptr && std::string(forced) == "baseline") return false;
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
#else
  return false;
#endif
}

void check_common(int bits, int64_t nq, int64_t bs, int dtype, const char* dtype_name) {
  if (bits < 1 || bits > 8)
    throw std::invalid_argument("bits=" + std::to_string(bits) + " must be from 1 to 8");
  if (bs < 1 || bs > mpxq::kMaxBucketSize)
    throw std::invalid_argument("bucket_size=" + std::to_string(bs) +
                                " must be from 1 to 2**60");
  if (nq < 0) throw std::invalid_argument("count=" + std::to_string(nq) + " must be >= 0");
  if (dtype < 0 || dtype > 2)
    throw std::invalid_argument(std::string(dtype_name) + "=" + std::to_string(dtype) +
                                " is not 0 (float32), 1 (float16) or 2 (bfloat16)");
}

void quantize(uintptr_t x, int dtype, int64_t nq, int bits, int64_t bs, bool stochastic,
              uint64_t seed, uintptr_t mins, uintptr_t units, uintptr_t values, int threads) {
  check_common(bits, nq, bs, dtype, "dtype");
  if (nq == 0) return;
  py::gil_scoped_release release;
  auto px = reinterpret_cast<const void*>(x);
  auto pm = reinterpret_cast<void*>(mins);
  auto pu = reinterpret_cast<void*>(units);
  auto pv = reinterpret_cast<uint8_t*>(values);
  if (use_avx2())
    mpxq_avx2::quantize(dtype, bits, px, nq, bs, stochastic, seed, pm, pu, pv, threads);
  else
    mpxq_base::quantize(dtype, bits, px, nq, bs, stochastic, seed, pm, pu, pv, threads);
}

void dequantize(uintptr_t values, uintptr_t mins, uintptr_t units, int qdtype, int64_t nq,
                int bits, int64_t bs, uintptr_t out, int out_dtype, bool accumulate,
                int threads) {
  check_common(bits, nq, bs, qdtype, "qdtype");
  check_common(bits, nq, bs, out_dtype, "out_dtype");
  if (nq == 0) return;
  py::gil_scoped_release release;
  auto pv = reinterpret_cast<const uint8_t*>(values);
  auto pm = reinterpret_cast<const void*>(mins);
  auto pu = reinterpret_cast<const void*>(units);
  auto po = reinterpret_cast<void*>(out);
  if (use_avx2())
    mpxq_avx2::dequantize(qdtype, out_dtype, bits, pv, pm, pu, nq, bs, po, accumulate, threads);
  else
    mpxq_base::dequantize(qdtype, out_dtype, bits, pv, pm, pu, nq, bs, po, accumulate, threads);
}

py::dict build_info() {
  py::dict info;
  info["backend"] = "cpu";
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#else
  info["compiler"] = "unknown";
#endif
  info["hardware_threads"] = std::thread::hardware_concurrency();
  info["kernels"] = use_avx2() ? "avx2" : "baseline";
  return info;
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "mpx-quantize CPU kernels (raw pointers; see mpx.quantize.kernels)";
  m.def("build_info", &build_info, "How this extension was built.");
  m.def("quantize", &quantize, py::arg("x"), py::arg("dtype"), py::arg("count"), py::arg("bits"),
        py::arg("bucket_size"), py::arg("stochastic"), py::arg("seed"), py::arg("mins"),
        py::arg("units"), py::arg("values"), py::arg("threads"),
        "Quantizes `count` values at `x` into mins/units/values (buffers sized by the caller).");
  m.def("dequantize", &dequantize, py::arg("values"), py::arg("mins"), py::arg("units"),
        py::arg("qdtype"), py::arg("count"), py::arg("bits"), py::arg("bucket_size"),
        py::arg("out"), py::arg("out_dtype"), py::arg("accumulate"), py::arg("threads"),
        "Decodes `count` values into `out` (or adds them to it when accumulate).");
}
