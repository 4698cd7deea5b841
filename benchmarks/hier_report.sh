#!/usr/bin/env bash
# Several machines, on namespaced hosts of this machine (root): the 2 x 2 comparison with
# plain gloo, the 2 x 1 and 1 x 2 calibration runs of the cost model, and the model check.
#   bash benchmarks/hier_report.sh [OUT_DIR]        (default docs/results; ~15 min)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
"$PY" -m benchmarks.hier_bench --rounds 3 --out "$OUT/hier.jsonl"
"$PY" -m benchmarks.hier_bench --hosts 2 --ranks-per-host 1 --rounds 3 --out "$OUT/hier_2x1.jsonl"
"$PY" -m benchmarks.hier_bench --hosts 1 --ranks-per-host 2 --backends shm --rounds 3 \
    --out "$OUT/hier_1x2.jsonl"
"$PY" -m benchmarks.hier_model "$OUT/hier.jsonl" "$OUT/hier_2x1.jsonl" "$OUT/hier_1x2.jsonl"
