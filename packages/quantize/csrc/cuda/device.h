#pragma once

namespace mpx_quantize {

// Number of visible CUDA devices; *error receives the cudaError_t (0 = success).
int device_count(int* error);
const char* error_string(int error);
int runtime_version();

}  // namespace mpx_quantize
