"""`python -m art.trainer_rank estimate | plan` (the parser is in cli/main.py)."""

import sys

from art.trainer_rank.cli.main import main

sys.exit(main())
