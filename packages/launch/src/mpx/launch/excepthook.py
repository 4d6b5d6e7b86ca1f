"""``mpx.launch.excepthook``, what ``mpx_launch_hook.pth`` installs: the module
:mod:`mpx.launch.hook.excepthook`.

The module lives in ``hook/`` (issue 57: one subpackage a role). This path
stays because the ``.pth`` file imports it by it
(``__import__("mpx.launch.excepthook").launch.excepthook.install()``), in
every Python process of a job, installed copies included. ``sys.modules``
maps this name to that module itself: ``mpx.launch.excepthook`` *is*
``mpx.launch.hook.excepthook``. The names bound below only tell type checkers
what the module holds.
"""

import sys

from mpx.launch.hook import excepthook

__all__ = ["install"]

install = excepthook.install

sys.modules[__name__] = excepthook
