"""`python -m art.trainer_rank estimate ...` (see _cli.py)."""

import sys

from art.trainer_rank._cli import main

sys.exit(main())
