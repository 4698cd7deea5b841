#!/usr/bin/env bash
# Tests: install, then the unit + multi-process suite, a fast subset of PyTorch's own
# distributed conformance suite (on one node, and at 4 ranks on 2 simulated nodes), and the
# wheel installed into a fresh virtualenv.
# Slow fuzz/soak/full-conformance runs: pass -m slow.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
t0=$SECONDS
# whether the install built the compiled latency path: optional (no C compiler, no lane:
# its tests skip), required where SHMCOLL_REQUIRE_LANE=1 (CI: .ci/run)
if ! "$PY" -c "from shmcoll.torch_backend import lane; import sys; sys.exit(not lane.available())"
then
  echo "test.sh: WARNING: shmcoll/torch_backend/_lane.c was not built (no C compiler or" \
       "Python headers? see the install output): its tests skip" >&2
  [ "${SHMCOLL_REQUIRE_LANE:-0}" != 1 ] || exit 1
fi
"$PY" -m shmcoll.engine.warmup
"$PY" -m pytest tests -q -m "not slow" -p no:cacheprovider --ignore=tests/conformance \
    --durations 20 "$@"
echo "test.sh: suite done at $((SECONDS - t0)) s"
"$PY" -m tests.conformance.run_suite --backend shm --subset tests/conformance/subset.txt
# at 4 ranks on 2 simulated nodes (hierarchical groups), a cut of it (~1.5 min; the whole
# subset passed there too when last run whole: tests/conformance/README.md)
"$PY" -m tests.conformance.run_suite --backend shm --subset tests/conformance/subset_hier.txt \
    --world-size 4 --nodes 2
echo "test.sh: conformance done at $((SECONDS - t0)) s"
bash scripts/wheel_check.sh  # the built wheel in fresh venvs, also read-only (~3 min)
echo "test.sh: passed in $((SECONDS - t0)) s"
