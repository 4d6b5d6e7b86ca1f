// mpx-quantize CUDA extension (host side): argument checks and pybind11
// bindings of the kernels in device.cu. Pointers arrive as integers from
// kernels.py (tensor.data_ptr()), the stream as torch's cuda_stream integer.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "../common/qmath.h"
#include "device.h"

namespace py = pybind11;

namespace {

py::dict build_info() {
  py::dict info;
  info["backend"] = "cuda";
  info["cuda_runtime_version"] = mpx_quantize::runtime_version();
  return info;
}

int device_count() {
  int error = 0;
  int count = mpx_quantize::device_count(&error);
  // No driver or no device is "zero devices", not an error: the CPU path remains.
  return error == 0 ? count : 0;
}

void check(int bits, int64_t count, int64_t bs, int dtype, const char* dtype_name) {
  if (bits < 1 || bits > 8)
    throw std::invalid_argument("bits=" + std::to_string(bits) + " must be from 1 to 8");
  if (bs < 1 || bs > mpxq::kMaxBucketSize)
    throw std::invalid_argument("bucket_size=" + std::to_string(bs) +
                                " must be from 1 to 2**60");
  if (count < 0) throw std::invalid_argument("count=" + std::to_string(count) + " must be >= 0");
  if (dtype < 0 || dtype > 2)
    throw std::invalid_argument(std::string(dtype_name) + "=" + std::to_string(dtype) +
                                " is not 0 (float32), 1 (float16) or 2 (bfloat16)");
}

void raise_on(int error, const char* what) {
  if (error != 0)
    throw std::runtime_error(std::string("mpx-quantize CUDA ") + what + " failed: " +
                             mpx_quantize::error_string(error));
}

void quantize(uintptr_t x, int dtype, int64_t count, int bits, int64_t bs, bool stochastic,
              uint64_t seed, uintptr_t mins, uintptr_t units, uintptr_t values, int device,
              uintptr_t stream) {
  check(bits, count, bs, dtype, "dtype");
  int error;
  {
    py::gil_scoped_release release;
    error = mpx_quantize::quantize(reinterpret_cast<const void*>(x), dtype, count, bits, bs,
                                   stochastic, seed, reinterpret_cast<void*>(mins),
                                   reinterpret_cast<void*>(units),
                                   reinterpret_cast<uint8_t*>(values), device, stream);
  }
  raise_on(error, "quantize");
}

void dequantize(uintptr_t values, uintptr_t mins, uintptr_t units, int qdtype, int64_t count,
                int bits, int64_t bs, uintptr_t out, int out_dtype, bool accumulate, int device,
                uintptr_t stream) {
  check(bits, count, bs, qdtype, "qdtype");
  check(bits, count, bs, out_dtype, "out_dtype");
  int error;
  {
    py::gil_scoped_release release;
    error = mpx_quantize::dequantize(reinterpret_cast<const uint8_t*>(values),
                                     reinterpret_cast<const void*>(mins),
                                     reinterpret_cast<const void*>(units), qdtype, count, bits,
                                     bs, reinterpret_cast<void*>(out), out_dtype, accumulate,
                                     device, stream);
  }
  raise_on(error, "dequantize");
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "mpx-quantize CUDA kernels (raw device pointers; see mpx.quantize.kernels)";
  m.def("build_info", &build_info, "How this extension was built.");
  m.def("device_count", &device_count, "CUDA devices visible to the runtime (0 without a driver).");
  m.def("quantize", &quantize, py::arg("x"), py::arg("dtype"), py::arg("count"), py::arg("bits"),
        py::arg("bucket_size"), py::arg("stochastic"), py::arg("seed"), py::arg("mins"),
        py::arg("units"), py::arg("values"), py::arg("device"), py::arg("stream"),
        "Quantizes `count` values at device pointer `x` on `stream`.");
  m.def("dequantize", &dequantize, py::arg("values"), py::arg("mins"), py::arg("units"),
        py::arg("qdtype"), py::arg("count"), py::arg("bits"), py::arg("bucket_size"),
        py::arg("out"), py::arg("out_dtype"), py::arg("accumulate"), py::arg("device"),
        py::arg("stream"),
        "Decodes `count` values into `out` on `stream` (adds them when accumulate).");
}
