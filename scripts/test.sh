#!/usr/bin/env bash
# Tests: install, then the unit + multi-process suite, a fast subset of PyTorch's own
# distributed conformance suite (on one node, and at 4 ranks on 2 simulated nodes), and the
# wheel installed into a fresh virtualenv.
# Slow fuzz/soak/full-conformance runs: pass -m slow.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
"$PY" -m shmcoll.warmup
"$PY" -m pytest tests -q -m "not slow" -p no:cacheprovider --ignore=tests/conformance "$@"
"$PY" -m tests.conformance.run_suite --backend shm --subset tests/conformance/subset.txt
# the same subset at 4 ranks on 2 simulated nodes (hierarchical groups; ~3 min)
"$PY" -m tests.conformance.run_suite --backend shm --subset tests/conformance/subset.txt \
    --world-size 4 --nodes 2
bash scripts/wheel_check.sh  # the built wheel in a fresh venv, also read-only (~1.5 min)
