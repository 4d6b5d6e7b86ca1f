"""mpx-quantize: bucket quantization kernels (C++ and CUDA) and the compressed allreduce.

This release is the package skeleton: the C++ extension (and the CUDA one,
where built) is compiled and loaded, and :func:`available_backends` says which
were built; the kernels and the allreduce land with their issue.

Example::

    import mpx.quantize
    print(mpx.quantize.available_backends())   # e.g. ['cpu'] or ['cpu', 'cuda']
"""

from mpx.quantize.backends import available_backends, build_info

__all__ = ["__version__", "available_backends", "build_info"]

__version__ = "0.1.0"
