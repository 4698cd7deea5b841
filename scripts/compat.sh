#!/usr/bin/env bash
# Compatibility job (CI, beside scripts/test.sh): the torch-facing tests on the OLDEST torch
# shmcoll supports, under Python 3.12 (the GPU machines' Python), in a virtualenv of their
# own; the main suite covers the newest torch on Python 3.11. What differs between torch
# versions lives in shmcoll/torch_backend/compat.py; these tests are what keeps it honest.
#
#   bash scripts/compat.sh                       # prepare, then test: torch $COMPAT_TORCH
#   bash scripts/compat.sh prepare               # only the virtualenv (CI runs this in the
#                                                # background while scripts/test.sh runs)
#   bash scripts/compat.sh test [pytest args]    # only the tests, in a prepared virtualenv
#   COMPAT_TORCH=2.11.0 bash scripts/compat.sh   # another torch (the GPU machines' one)
#
# PyPI's Linux wheels of older torch are CUDA builds: they install (~2.5 GB of NVIDIA
# libraries with them, ~3-4 min here, mostly download and unpacking, little CPU) and run
# without a GPU. The venv is kept between runs on one machine (COMPAT_VENV), so only the
# first run pays the download.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=all
case "${1:-}" in
  prepare|test|all) STAGE=$1; shift ;;
esac
TORCH=${COMPAT_TORCH:-2.4.1}
VENV=${COMPAT_VENV:-/tmp/shmcoll-compat-py312-torch$TORCH}
PY="$VENV/bin/python"
t0=$SECONDS

prepare() {
  local py312=${COMPAT_PYTHON:-$(command -v python3.12 2>/dev/null || true)}
  if [ -z "$py312" ] || ! "$py312" -c "import sys; assert sys.version_info[:2] == (3, 12)" \
      2>/dev/null; then
    # pyenv's shim answers for versions it does not select: take the interpreter itself
    py312=$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 \
            "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 \
            /usr/local/bin/python3.12 2>/dev/null | head -1 || true)
  fi
  if [ -z "$py312" ]; then
    echo "compat: no Python 3.12 interpreter found (set COMPAT_PYTHON)" >&2
    exit 2
  fi
  if [ ! -x "$PY" ] || \
     ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" \
       2>/dev/null; then
    rm -rf "$VENV"
    "$py312" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # torch first and pinned, then the project with its test extra (torch is then
    # satisfied). --no-compile: byte-compiling torch's thousands of files is most of the
    # unpacking time; the few modules a run imports compile on first import.
    "$PY" -m pip install -q --no-compile "torch==$TORCH"
  fi
  "$PY" -m pip install -q --no-compile -e ".[test]"
  "$PY" -c "import sys, torch; print('compat: python', sys.version.split()[0], 'torch', torch.__version__)"
  echo "compat: environment ready in $((SECONDS - t0)) s"
}

run_tests() {
  if [ ! -x "$PY" ]; then
    echo "compat: no virtualenv at $VENV (run: bash scripts/compat.sh prepare)" >&2
    exit 2
  fi
  t0=$SECONDS
  "$PY" -m shmcoll.engine.warmup
  # What meets torch's version differences: the adapter and its seams (compat), gloo's
  # front-end seeds, futures and DDP hooks, threaded_pg, the programs (DDP, FSDP, DTensor,
  # DCP, pipelining, elastic), where the backends register and what torch asks of a group
  # its creation thread has not made yet (test_deferred_init), the CUDA path's torch surface
  # (the simulated device: a caller's default device, DDP, the host kernel's complex
  # arithmetic against torch's) and a hierarchical group (gloo between nodes). ~6.5 min
  # with every cuda_ipc and hier test, ~4 without: these are the ones that touch torch.
  "$PY" -m pytest -q -p no:cacheprovider -m "not slow" --durations 15 \
    tests/test_torch_compat.py tests/test_torch_backend*.py tests/test_gloo_seeds_*.py \
    tests/test_threaded_pg_*.py tests/test_threaded_rng.py tests/test_futures.py tests/test_ddp.py \
    tests/test_programs.py tests/test_autoload.py tests/test_tensor_memory.py tests/test_deferred_init.py \
    tests/test_lane.py \
    tests/test_cuda_ipc.py::test_a_callers_default_device_does_not_leak_into_the_backend \
    tests/test_cuda_ipc.py::test_ddp_on_the_device_path \
    tests/test_cuda_ipc.py::test_reduce_matches_the_host_kernel \
    tests/test_cuda_ipc.py::test_dist_collectives_on_the_device_path \
    "tests/test_hier.py::test_every_collective_and_p2p[3+1]" "$@"
  echo "compat: passed in $((SECONDS - t0)) s (torch $TORCH, python 3.12)"
}

case $STAGE in
  prepare) prepare ;;
  test) run_tests "$@" ;;
  all) prepare; run_tests "$@" ;;
esac
