#!/usr/bin/env bash
# Install shmcoll and what its demo/tests need, without ever replacing a torch that is there.
# torch is an optional dependency of shmcoll (README): this script adds the CPU build where
# none is installed, and stops where the installed one is older than shmcoll supports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Whether torch is installed, from its metadata: without importing it (an import that fails
# for another reason must not make this script install a torch over the user's).
TORCH=$("$PY" -c "import importlib.metadata as m
try: print(m.version('torch'))
except m.PackageNotFoundError: pass")
if [ -z "$TORCH" ]; then
  # No torch yet: take the CPU build (on the dev/CI image this is a local wheel; elsewhere
  # PyPI's). A torch the user already has is left alone.
  "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q torch
elif ! "$PY" -c "import sys; v = '$TORCH'.split('+')[0].split('.')
sys.exit((int(v[0]), int(''.join(c for c in v[1] if c.isdigit()) or 0)) < (2, 4))"; then
  echo "install.sh: shmcoll needs torch >= 2.4; this is torch $TORCH. Install a newer" \
       "torch yourself (this script never replaces one)." >&2
  exit 1
fi
# the test extra's lightning asks for torch >= 2.1: pip keeps the torch found above
"$PY" -m pip install -q -e ".[test,bench]"
