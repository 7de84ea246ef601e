"""`python -m model_utils ...`: the headless CLI (see cli.py)."""

from .cli import main

raise SystemExit(main())
