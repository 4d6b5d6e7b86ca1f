"""Registers the ``mpx`` torch.distributed backend when torch is imported.

torch (2.4+) calls the entry points of group ``torch.backends`` at the end of
``import torch`` (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off). This
module is that entry point of mpx-collectives. It lives beside the
``mpx.collectives`` package, not in it, because importing anything under
``mpx.collectives`` imports mpi4py, which initialises MPI: importing torch
must not. So it registers a creator that imports the backend, and with it
MPI, only when a process group is made::

    import torch.distributed as dist
    dist.init_process_group("mpx")      # no `import mpx.collectives` needed

It also lets ``init_process_group`` run under any MPI launcher with nothing
set by hand. torch's default rendezvous (``env://``) reads RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, which ``torchrun`` and ``mpxrun`` export but a
plain ``mpiexec`` or ``srun`` does not::

    srun -n 2 --mpi=pmi2 python train.py      # or mpiexec -n 2 python train.py
      init_process_group("mpx")  ->  env://  ->  RANK etc. missing, an MPI launcher's
                                                 variables present (PMI_RANK, SLURM_PROCID,
                                                 OMPI_COMM_WORLD_RANK): mpx.launch's
                                                 init_torch_env_under_mpi fills in rank, size
                                                 and local rank from them, MASTER_ADDR/PORT
                                                 from rank 0 over MPI
                                             ->  torch's own env:// handler, unchanged

Variables already set are honoured (torchrun-style jobs are untouched), and
MPI starts only in that case, when the group is made. Wrapping the ``env``
handler needs torch's handler table, a private name: it is here and not in
:mod:`mpx.collectives.base._torch_private` because that module's package starts
MPI when imported, which ``import torch`` must not.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

__all__ = ["register"]

BACKEND_NAME = "mpx"  # mpx.collectives.torch.backend.BACKEND_NAME


def _create(options: Any, backend_options: Any = None) -> Any:
    # Here, not at import: see the docstring.
    from mpx.collectives.torch import backend as torch_backend

    return torch_backend._create(options, backend_options)


def _env_or_mpi_handler(original: Any) -> Any:
    def handler(url: str, **kwargs: Any) -> Iterator[Any]:
        # Lazily, as torch's own handler: only when init_process_group iterates it.
        from mpx.launch import init_torch_env_under_mpi  # no torch, no MPI: cheap

        init_torch_env_under_mpi()
        yield from original(url, **kwargs)

    handler.mpx_wraps = original  # type: ignore[attr-defined]
    return handler


def _wrap_env_rendezvous() -> None:
    # The module, not the function of the same name that torch.distributed exports.
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    handlers = getattr(rendezvous, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict):
        return  # a torch without the table: plain env:// then, never a failed `import torch`
    current = handlers.get("env")
    if current is not None and not hasattr(current, "mpx_wraps"):
        handlers["env"] = _env_or_mpi_handler(current)


def register() -> None:
    """Registers ``"mpx"`` lazily (idempotent; a no-op without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    _wrap_env_rendezvous()
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
