"""Stands in for Cython's ``cython`` module where Cython is not installed.

A module written in Cython's pure-Python mode (:mod:`mpx.collectives.core.fast_path`)
imports ``cython``; compiled, that import is Cython's own and costs nothing.
Run as Python, it needs the module Cython installs -- or, without Cython,
this one, which answers the only question such a module asks at run time.
"""

from __future__ import annotations

__all__ = ["cython"]


class cython:  # named as the module it stands in for
    """``cython.compiled`` is False: the module runs as Python."""

    compiled = False
