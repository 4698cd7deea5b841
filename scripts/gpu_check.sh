#!/usr/bin/env bash
# The GPU check of cuda_ipc in one run that fits one 10-minute device call (about 8
# minutes at most on one H100): environment report, GPU test suite, init/destroy leak
# test, device benchmark and extras. Each stage runs under its own deadline (`timeout`),
# so a hang in one still leaves the other stages' results, and every result file is
# written while its stage runs. Nothing here uses the network.
#
#   bash scripts/gpu_check.sh [STAGE]            # all (default), env, suite, leak, bench
#   GPU_RESULTS=$OUT bash scripts/gpu_check.sh   # results there instead of docs/results/
#
# Results, at most 6 files:
#   gpu_env.txt       device, driver, versions, commit, `python -m cuda_ipc.info` (stream
#                     memory operations, CUDA IPC, a 2-process stream handoff on one GPU),
#                     and at the end one line per stage: exit status and seconds
#   gpu_tests.log     tests/test_cuda_ipc_gpu.py but the leak test (deadline per test)
#   gpu_leak.log      the init/destroy leak test: as many of 1000 cycles as fit its budget
#   gpu_bench.jsonl   all_reduce float32 on one GPU at 8 B, 64 KiB, 1, 64 and 256 MiB: 2 ranks
#   gpu_bench.md        shm / gloo / nccl and the device's memcpy, then 4 ranks shm / gloo
#                       (.md: the printed tables)
#   gpu_extras.jsonl  host vs device time of an enqueued 256 MiB all_reduce; DDP vs gloo
# Exit status: 0 when every stage passed, 1 when one failed, 2 on bad usage or wheels.
#
# Through the device tool (no network there; posix-ipc travels as a wheel):
#   here, once:  bash scripts/gpu_wheels.sh          (fills .whl/, git-ignored)
#   run:  command "GPU_CHECK_COMMIT=<git rev-parse --short HEAD here> GPU_RESULTS=$OUT
#         bash scripts/gpu_check.sh", carry [".whl"], timeout_s 600
#   then copy the files from files_at into docs/results/ and commit them.
# Deadlines in seconds (GPU_T_ENV, GPU_T_SUITE, GPU_T_LEAK, GPU_T_BENCH2, GPU_T_BENCH4,
# GPU_T_EXTRAS): 45, 180, 90, 85, 50, 70 = 520 s at most.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
case "$stage" in all|env|suite|leak|bench) ;; *) echo "unknown stage: $stage" >&2; exit 2;; esac
PY=${PYTHON:-python3}
OUT=${GPU_RESULTS:-docs/results}
mkdir -p "$OUT"
T_ENV=${GPU_T_ENV:-45} T_SUITE=${GPU_T_SUITE:-180} T_LEAK=${GPU_T_LEAK:-90}
T_BENCH2=${GPU_T_BENCH2:-85} T_BENCH4=${GPU_T_BENCH4:-50} T_EXTRAS=${GPU_T_EXTRAS:-70}
wheels="none in .whl/"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/gpu_site .whl/*.whl; then
    export PYTHONPATH=/tmp/gpu_site
    wheels="installed $(cd .whl && echo *.whl)"
  else
    echo "gpu_check: installing .whl/*.whl failed" | tee "$OUT/gpu_env.txt"
    exit 2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
# the device tool copies the working tree without .git: pass GPU_CHECK_COMMIT there
commit=${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export GPU_CHECK_COMMIT=$commit GPU_CHECK_STAGE=$stage GPU_CHECK_WHEELS=$wheels GPU_CHECK_PY=$PY
status=0
summary=("--- stages (commit $commit):")
t_all=$(date +%s)

# run NAME SECONDS LOG (w|a) CMD...: CMD under a deadline (SIGTERM, then SIGKILL 10 s
# later, to its whole process group), its output into LOG; noted in the summary
run() {
  local name=$1 limit=$2 log=$3 mode=$4 t0 rc
  shift 4
  t0=$(date +%s)
  if [ "$mode" = a ]; then
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  else
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
  fi
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu_check: stage '$name' passed its deadline of ${limit}s and was stopped" | tee -a "$log"
  fi
  summary+=("$name: exit $rc, $(( $(date +%s) - t0 ))s (deadline ${limit}s)")
  [ "$rc" -eq 0 ] || status=1
}

env_report() {
  echo "date: $(date -Is)  commit: $GPU_CHECK_COMMIT  stage: $GPU_CHECK_STAGE"
  git status --short 2>/dev/null | head -5 | sed 's/^/uncommitted: /'
  echo "wheels: $GPU_CHECK_WHEELS"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv 2>&1
  "$GPU_CHECK_PY" - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.machine(), "kernel", platform.release())
for name in ("torch", "numpy", "numba", "posix_ipc", "triton", "cupy"):
    try:
        m = __import__(name)
        print(name, getattr(m, "__version__", getattr(m, "VERSION", "?")))
    except Exception as e:
        print(name, "unavailable:", type(e).__name__, e)
import torch
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as e:
    print("nccl unavailable:", e)
try:
    import shmcoll  # noqa: F401  registers "shm"
    print("shmcoll imports: ok")
except Exception as e:
    print("shmcoll import FAILED:", type(e).__name__, e)
EOF
  "$GPU_CHECK_PY" -m cuda_ipc.info
}
export -f env_report

if [ "$stage" = all ] || [ "$stage" = env ]; then
  run env "$T_ENV" "$OUT/gpu_env.txt" w bash -c env_report
fi
if [ "$stage" = all ] || [ "$stage" = suite ]; then
  run suite "$T_SUITE" "$OUT/gpu_tests.log" w env SHMCOLL_GPU_JOB_TIMEOUT_S=90 \
    SHMCOLL_GPU_TEST_TIMEOUT_S=120 "$PY" -m pytest tests/test_cuda_ipc_gpu.py -m cuda -v -rA \
    --durations=0 --tb=short -p no:cacheprovider -k "not thousand"
fi
if [ "$stage" = all ] || [ "$stage" = leak ]; then
  # cycles for T_LEAK - 40 s; the ranks' stacks are printed if the job outlives T_LEAK - 15 s
  run leak "$T_LEAK" "$OUT/gpu_leak.log" w env SHMCOLL_GPU_LEAK_BUDGET_S=$(( T_LEAK - 40 )) \
    SHMCOLL_GPU_JOB_TIMEOUT_S=$(( T_LEAK - 15 )) SHMCOLL_GPU_TEST_TIMEOUT_S=$(( T_LEAK - 5 )) \
    "$PY" -m pytest tests/test_cuda_ipc_gpu.py \
    -m cuda -v -s --tb=short -p no:cacheprovider -k thousand
fi
if [ "$stage" = all ] || [ "$stage" = bench ]; then
  common=(--device cuda --ops all_reduce --dtype float32 --sizes 8,64K,1M,64M,256M -n 50 -w 5
          --iter-bytes 1G --timeout 60 --stall-timeout 40 --init-timeout 45)
  run bench2 "$T_BENCH2" "$OUT/gpu_bench.md" w "$PY" -m benchmarks.bench "${common[@]}" \
    --world-sizes 2 --backends shm,gloo,nccl,memcpy --out "$OUT/gpu_bench.jsonl"
  # 4 ranks without NCCL: NCCL_MULTI_RANK_GPU_ENABLE allows 2 ranks per GPU
  rm -f /tmp/gpu_bench_ws4.jsonl
  run bench4 "$T_BENCH4" "$OUT/gpu_bench.md" a "$PY" -m benchmarks.bench "${common[@]}" \
    --world-sizes 4 --backends shm,gloo --out /tmp/gpu_bench_ws4.jsonl
  [ -f /tmp/gpu_bench_ws4.jsonl ] && cat /tmp/gpu_bench_ws4.jsonl >> "$OUT/gpu_bench.jsonl"
  run extras "$T_EXTRAS" "$OUT/gpu_bench.md" a "$PY" -m benchmarks.gpu_extras \
    --timeout $(( (T_EXTRAS - 5) / 3 )) --out "$OUT/gpu_extras.jsonl"
fi
summary+=("all: $(( $(date +%s) - t_all ))s; exit $status")
printf '%s\n' "${summary[@]}" | tee -a "$OUT/gpu_env.txt"
exit "$status"
