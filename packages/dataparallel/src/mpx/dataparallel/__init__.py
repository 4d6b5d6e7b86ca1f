"""mpx-dataparallel: Data-parallel training over MPI: FluxMPI's API, overlapped gradient allreduce,
parameter server, Downpour and EASGD.

This release is the package skeleton of the mpx monorepo: it installs and
imports, and declares its place among the layers; its API is being built.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
