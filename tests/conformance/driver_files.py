"""One rank of a conformance job over one of torch's test files (MultiProcessTestCase tests).

Started by ``run_torch_files.py`` as ``mpxrun -n N -- python driver_files.py
--file test_x.py --tests LIST --backend B --out DIR``. torch's distributed
test files (``test/distributed/test_c10d_common.py`` and the like, which are
not in the torch wheel: they come from a checkout of torch's sources) run
each test in processes that ``MultiProcessTestCase`` forks; here MPI starts
the ranks instead, and each rank does what a forked process does: the test
case with this rank, a store file every rank shares, the test method.

On ``--backend mpx`` every group the test asks gloo for (``init_process_group``
and ``new_group`` with ``"gloo"``, ``"cpu:gloo"`` or the default) is made on
mpx. A test that builds gloo's classes itself (``ProcessGroupGloo(...)``)
made no mpx group: it is recorded as ``skip`` with the detail ``not on mpx``
and left out of the comparison.

One JSON line per event goes to ``rank<r>.jsonl``, as ``driver.py`` writes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import unittest
from pathlib import Path
from typing import Any

import driver  # type: ignore[import-not-found]  # this folder's: the script's sys.path[0]

NOT_ON_MPX = "not on mpx: the test builds gloo's classes itself"


def load(path: Path) -> Any:
    """Imports torch's test file ``path`` as a module (its folder on sys.path, for siblings)."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def test_names(module: Any) -> list[str]:
    """``Class.test_x`` for every MultiProcessTestCase class the file defines.

    The tests are those unittest finds (any ``test*`` method: torch names a few
    ``testWithoutEnv``-style).
    """
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    loader = unittest.TestLoader()
    names = []
    for name, value in sorted(vars(module).items()):
        if (
            isinstance(value, type)
            and issubclass(value, MultiProcessTestCase)
            and value.__module__ == module.__name__
        ):
            names += [f"{name}.{t}" for t in sorted(loader.getTestCaseNames(value))]
    return names


def _on_backend(backend: str, made: list[int]) -> None:
    """Makes the groups tests ask gloo for on ``backend``; counts the mpx groups in ``made``."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from mpx.collectives import register_torch_backend
    from mpx.collectives.torch.backend import MPXProcessGroup

    register_torch_backend()
    original_init = MPXProcessGroup.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        made[0] += 1
        original_init(self, *args, **kwargs)

    MPXProcessGroup.__init__ = counted  # type: ignore[method-assign]

    def swap(name: Any) -> Any:
        if name is None:
            return backend
        text = str(name)
        return text.replace("gloo", backend) if "gloo" in text else name

    for function in ("init_process_group", "new_group"):
        original = getattr(c10d, function)

        def wrapped(
            *args: Any, __original: Any = original, __name: str = function, **kwargs: Any
        ) -> Any:
            if __name == "init_process_group" and args:  # backend is its first argument
                args = (swap(args[0]), *args[1:])
            else:
                kwargs["backend"] = swap(kwargs.get("backend"))
            return __original(*args, **kwargs)

        setattr(c10d, function, wrapped)
        setattr(dist, function, wrapped)


def run_one(module: Any, qualified: str, rank: int, size: int, root: Path) -> tuple[str, str]:
    """Runs ``Class.test`` on this rank: ("pass"|"skip"|"fail", detail)."""

    class_name, name = qualified.split(".", 1)
    cls = getattr(module, class_name)
    case = cls(name)
    store = root / qualified / "store"

    def test() -> None:
        with contextlib.ExitStack() as stack:
            # The test's own process start (setUp's _spawn_processes) is MPI's here.
            stack.enter_context(_patched(cls, "_spawn_processes", lambda self: None))
            case.setUp()
        case.rank = rank
        case.file_name = str(store)
        if case.world_size != size:
            raise unittest.SkipTest(f"needs {case.world_size} ranks, the job has {size}")
        getattr(case, name)()

    return driver.outcome(test)  # type: ignore[no-any-return]


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Any:
    had = name in vars(owner)
    old = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", required=True, help="the backend under test: mpx or gloo")
    parser.add_argument("--file", required=True, type=Path, help="torch's test file")
    parser.add_argument("--tests", required=True, type=Path, help="file: Class.test a line")
    parser.add_argument("--out", required=True, type=Path, help="folder of the result files")
    parser.add_argument("--list", action="store_true", help="print the tests and exit")
    args = parser.parse_args()
    module = load(args.file.resolve())
    if args.list:
        print("\n".join(test_names(module)))
        return 0
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    made = [0]
    if args.backend != "gloo":
        _on_backend(args.backend, made)
    out = args.out.resolve()
    root = out / "tmp"

    def run(qualified: str) -> tuple[str, str]:
        (root / qualified).mkdir(parents=True, exist_ok=True)
        before = made[0]
        status, detail = run_one(module, qualified, rank, size, root)
        if args.backend != "gloo" and status == "pass" and made[0] == before:
            status, detail = "skip", NOT_ON_MPX
        return status, detail

    driver.run_all([n for n in args.tests.read_text().split() if n], out, comm, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
