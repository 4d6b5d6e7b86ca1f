// The CPU kernels for the compiler's baseline instruction set.
#define MPXQ_KERNEL_NS mpxq_base
#include "kernels_impl.h"
