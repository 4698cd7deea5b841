#!/usr/bin/env bash
# The GPU suite and the GPU benchmark, on a machine with a CUDA GPU. Results go to
# docs/results/ (gpu_env.txt, gpu_tests.log, gpu_bench.jsonl/.md, gpu_extras.jsonl), each
# with the device, driver, torch version and commit. Exit status: the suite's.
#
#   bash scripts/gpu_check.sh [STAGE]    # STAGE: all (default), suite, leak, bench
#     suite  the GPU tests but the 1000-cycle leak test   (gpu_env.txt, gpu_tests.log)
#     leak   the 1000-cycle leak test alone                (gpu_leak.log)
#     bench  the device benchmark and the extras           (gpu_bench.*, gpu_extras.jsonl)
#   Each stage alone is meant to fit a 10-minute remote call; `all` runs the three.
#
# Packages missing on that machine (posix-ipc) travel as wheels in .whl/: run
# `bash scripts/gpu_wheels.sh` here first (it downloads them for Python 3.12), then carry
# .whl with the command.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
case "$stage" in all|suite|leak|bench) ;; *) echo "unknown stage: $stage" >&2; exit 2;; esac
PY=${PYTHON:-python3}
OUT=${GPU_RESULTS:-docs/results}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/gpu_site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
  echo "date: $(date -Is)  commit: $commit"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  "$PY" -c "import torch, numba; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__); print('nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
  "$PY" -m cuda_ipc.info 2>&1
} | tee "$OUT/gpu_env.txt"
status=0
if [ "$stage" = all ] || [ "$stage" = suite ]; then
  "$PY" -m pytest tests/test_cuda_ipc_gpu.py -m cuda -v -p no:cacheprovider -k "not thousand" \
    2>&1 | tee "$OUT/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "$stage" = all ] || [ "$stage" = leak ]; then
  "$PY" -m pytest tests/test_cuda_ipc_gpu.py -m cuda -v -p no:cacheprovider -k thousand \
    2>&1 | tee "$OUT/gpu_leak.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$stage" = all ] || [ "$stage" = bench ]; then
  "$PY" -m benchmarks.bench --device cuda --backends shm,gloo,nccl,memcpy --world-sizes 2,4 \
    --ops all_reduce --sizes 8,1K,64K,1M,16M,64M,256M -n 50 -w 10 --iter-bytes 4G \
    --out "$OUT/gpu_bench.jsonl" 2>&1 | tee "$OUT/gpu_bench.md"
  "$PY" -m benchmarks.gpu_extras --out "$OUT/gpu_extras.jsonl" 2>&1 | tee -a "$OUT/gpu_bench.md"
fi
exit "$status"
