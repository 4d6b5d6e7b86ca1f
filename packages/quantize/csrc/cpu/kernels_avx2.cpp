// The CPU kernels compiled with -mavx2 (CMake adds it on x86-64 only): 8-wide
// float and 32-bit integer lanes for the min/max scan and the noise hash.
#define MPXQ_KERNEL_NS mpxq_avx2
#include "kernels_impl.h"
