"""mpx-pipeline: Pipeline-parallel training over MPI: GPipe, 1F1B and asynchronous pipelines with
weight stashing, prediction and gap-aware.

This release is the package skeleton of the mpx monorepo: it installs and
imports, and declares its place among the layers; its API is being built.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
