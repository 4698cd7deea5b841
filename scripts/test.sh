#!/usr/bin/env bash
# Tests: install, then the unit + multi-process suite and a fast subset of PyTorch's own
# distributed conformance suite. Slow fuzz/soak/full-conformance runs: pass -m slow.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
"$PY" -m shmcoll.warmup
"$PY" -m pytest tests -q -m "not slow" -p no:cacheprovider --ignore=tests/conformance "$@"
"$PY" -m tests.conformance.run_suite --backend shm --subset tests/conformance/subset.txt
