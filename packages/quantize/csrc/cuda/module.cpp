// mpx-quantize CUDA extension (host side). Kernels arrive with the quantize
// issue; this module reports the build and the devices the runtime sees.
#include <pybind11/pybind11.h>

#include <string>

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

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "mpx-quantize CUDA kernels";
  m.def("build_info", &build_info, "How this extension was built.");
  m.def("device_count", &device_count, "CUDA devices visible to the runtime (0 without a driver).");
}
