"""torchrun worker that never finishes: it records its pid in argv[1]/rank<R>.pid and sleeps
(test_torchrun_timeout.py checks that a launch timing out leaves no worker behind)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

Path(sys.argv[1], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
time.sleep(3600)
