#pragma once

#include <cstdint>

namespace mpx_quantize {

// Number of visible CUDA devices; *error receives the cudaError_t (0 = success).
int device_count(int* error);
const char* error_string(int error);
int runtime_version();

// The kernels. Pointers are device pointers on CUDA device `device` (made
// current first: this runtime is statically linked and does not share torch's
// per-thread state); `stream` is a cudaStream_t as an integer (0: the legacy
// default stream). They return a cudaError_t (0 = ok)
// from launching; kernels run asynchronously on `stream`.
int quantize(const void* x, int dtype, int64_t count, int bits, int64_t bucket_size,
             bool stochastic, uint64_t seed, void* mins, void* units, uint8_t* values,
             int device, uintptr_t stream);
int dequantize(const uint8_t* values, const void* mins, const void* units, int qdtype,
               int64_t count, int bits, int64_t bucket_size, void* out, int out_dtype,
               bool accumulate, int device, uintptr_t stream);

}  // namespace mpx_quantize
