"""``python -m mpx.launch`` is ``mpxrun``."""

from mpx.launch.cli import run

run()
