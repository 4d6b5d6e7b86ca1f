"""mpx-collectives: Every collective on torch tensors over MPI (mpi, ring, shm, staged, ipc,
hierarchical), and a torch.distributed backend.

This release is the package skeleton of the mpx monorepo: it installs and
imports, and declares its place among the layers; its API is being built.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
