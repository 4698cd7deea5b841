#!/usr/bin/env bash
# Compatibility job (CI, after scripts/test.sh): the torch-facing tests on the OLDEST torch
# shmcoll supports, under Python 3.12 (the GPU machines' Python), in a virtualenv of their
# own; the main suite covers the newest torch on Python 3.11. What differs between torch
# versions lives in shmcoll/torch_backend/compat.py; these tests are what keeps it honest.
#
#   bash scripts/compat.sh                       # torch $COMPAT_TORCH on python3.12
#   COMPAT_TORCH=2.11.0 bash scripts/compat.sh   # another torch (the GPU machines' one)
#
# PyPI's Linux wheels of older torch are CUDA builds: they install (~2.5 GB of NVIDIA
# libraries with them, ~3-4 min here) and run without a GPU. The venv is kept between runs
# on one machine (COMPAT_VENV), so only the first run pays the download.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${COMPAT_TORCH:-2.4.1}
VENV=${COMPAT_VENV:-/tmp/shmcoll-compat-py312-torch$TORCH}
PY312=${COMPAT_PYTHON:-$(command -v python3.12 2>/dev/null || true)}
if [ -z "$PY312" ] || ! "$PY312" -c "import sys; assert sys.version_info[:2] == (3, 12)" \
    2>/dev/null; then
  # pyenv's shim answers for versions it does not select: take the interpreter itself
  PY312=$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
          /usr/bin/python3.12 /usr/local/bin/python3.12 2>/dev/null | head -1 || true)
fi
if [ -z "$PY312" ]; then
  echo "compat: no Python 3.12 interpreter found (set COMPAT_PYTHON)" >&2
  exit 2
fi
t0=$SECONDS
if [ ! -x "$VENV/bin/python" ] || \
   ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" \
     2>/dev/null; then
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first and pinned, then the project with its test extra (torch is then satisfied)
  "$VENV/bin/python" -m pip install -q "torch==$TORCH"
fi
"$VENV/bin/python" -m pip install -q -e ".[test]"
PY="$VENV/bin/python"
"$PY" -c "import sys, torch; print('compat: python', sys.version.split()[0], 'torch', torch.__version__)"
echo "compat: environment ready in $((SECONDS - t0)) s"
"$PY" -m shmcoll.warmup
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/test_torch_compat.py tests/test_torch_backend.py tests/test_gloo_seeds.py \
  tests/test_threaded_pg.py tests/test_threaded_rng.py tests/test_futures.py tests/test_ddp.py \
  tests/test_programs.py tests/test_isolation.py tests/test_tensor_memory.py \
  tests/test_cuda_ipc.py tests/test_hier.py "$@"
echo "compat: passed in $((SECONDS - t0)) s (torch $TORCH, python 3.12)"
