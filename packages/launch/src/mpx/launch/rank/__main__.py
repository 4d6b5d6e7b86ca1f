"""``python -m mpx.launch.rank -- prog args…``: the rank supervisor (see :mod:`mpx.launch.rank`)."""

import sys

from mpx.launch.rank.supervisor import main

sys.exit(main())
