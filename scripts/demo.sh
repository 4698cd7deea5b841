#!/usr/bin/env bash
# Main job: install, then a short verified benchmark of shm against gloo (all_reduce, 2 ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
# No warm-up first: the benchmark's ranks compile the kernels they use (~2 s, one rank
# compiles, the other loads; see README "First run"), outside the timed iterations.
exec "$PY" -m benchmarks.bench --quick --backends shm,gloo --out results/quick.jsonl --plot results/quick.png "$@"
