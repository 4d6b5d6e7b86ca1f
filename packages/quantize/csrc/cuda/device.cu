// Device queries through the statically linked CUDA runtime.
#include <cuda_runtime.h>

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

}  // namespace mpx_quantize
