# Sourced by scripts/demo and scripts/test: create or reuse .venv and install what is needed.
# torch 2.13.0 goes in first, on its own, so that pip never resolves a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ART_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.art-installed"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$ROOT/setup.cfg" -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test]"
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONUNBUFFERED=1
cd "$ROOT"
