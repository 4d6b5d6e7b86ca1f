// mpx-quantize CPU extension. The kernels arrive with the quantize issue; this
// module already reports how it was built, so that available_backends() and
// `mpxrun --check` can tell users what they have.
#include <pybind11/pybind11.h>

#include <string>
#include <thread>

namespace py = pybind11;

namespace {

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
  return info;
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "mpx-quantize CPU kernels";
  m.def("build_info", &build_info, "How this extension was built.");
}
