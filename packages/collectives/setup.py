"""Builds mpx-collectives: Python, and the modules compiled where they can be.

The metadata is pyproject.toml's; this file only adds the compiled modules.
Each is a module written in Cython's pure-Python mode (the ``.py`` is the
source, a ``.pxd`` beside it holds the C declarations), so a build that
compiles nothing installs the same package as plain Python.

``MPX_COLLECTIVES_CYTHON`` (read here, at build time; declared in
mpx.collectives.settings):

    AUTO (default)  compile with Cython; if Cython or the C compiler fails,
                    warn and install the Python modules
    ON              compile, or fail the install
    OFF             install the Python modules only (and delete the compiled
                    copies an earlier editable install left in src/, which
                    Python would load instead)

``mpx.collectives.core.fast_path.COMPILED`` tells which one is installed. The
compiled module needs no MPI headers: it finds the MPI library's functions
at run time (see fast_path.py).
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Modules compiled with Cython, where they can be (see each one's docstring).
COMPILED = ["mpx.collectives.core.fast_path"]

# The build-time setting of mpx.collectives.settings.BUILD_CYTHON. This file
# cannot import mpx.launch (it is not installed while building), so it reads
# the variable itself.
MODE = (os.environ.get("MPX_COLLECTIVES_CYTHON", "").strip() or "AUTO").upper()
if MODE not in ("AUTO", "ON", "OFF"):
    sys.exit(f"MPX_COLLECTIVES_CYTHON={MODE!r} must be AUTO, ON or OFF")


def _warn(what: str, error: BaseException) -> None:
    print(
        f"mpx-collectives: {what} failed ({error}); installing the Python modules "
        "(set MPX_COLLECTIVES_CYTHON=ON to make this an error)",
        file=sys.stderr,
    )


def _extensions() -> list[Extension]:
    if MODE == "OFF":
        for name in COMPILED:
            package, module = os.path.join("src", *name.split(".")[:-1]), name.split(".")[-1]
            for stale in glob.glob(os.path.join(package, f"{module}.*.so")):
                os.remove(stale)
        return []
    try:
        from Cython.Build import cythonize

        modules = [
            Extension(name, [os.path.join("src", *name.split(".")) + ".py"]) for name in COMPILED
        ]
        return list(
            cythonize(
                modules,
                include_path=["src"],  # finds each module's .pxd
                build_dir="build/cython",  # the generated C stays out of src/
                compiler_directives={
                    "language_level": 3,
                    # Types come from the .pxd only: an annotation such as
                    # ``op: str`` must not start rejecting str subclasses.
                    "annotation_typing": False,
                },
                quiet=True,
            )
        )
    except Exception as error:
        if MODE == "ON":
            raise
        _warn("Cython", error)
        return []


class OptionalBuildExt(build_ext):
    """Compiles the extensions; with AUTO, a compiler that fails leaves Python."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:
            if MODE == "ON":
                raise
            _warn("compiling", error)

    def build_extension(self, ext: Any) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:
            if MODE == "ON":
                raise
            _warn(f"compiling {ext.name}", error)


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
