"""``python -m zenflow_triton.demo``: see :mod:`zenflow_triton.demo`."""

import sys

from .cli import main

sys.exit(main())
