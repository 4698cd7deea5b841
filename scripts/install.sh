#!/usr/bin/env bash
# Install shmcoll and what its demo/tests need, without ever replacing a torch that is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  # No torch yet: take the CPU build (on the dev/CI image this is a local wheel; elsewhere
  # PyPI's). A torch the user already has is left alone.
  "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q torch
fi
"$PY" -m pip install -q -e ".[test,bench]"
