"""python -m model_utils.bench: the benchmark command (run.py)."""

import sys

from .run import main

sys.exit(main())
