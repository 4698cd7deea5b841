#!/usr/bin/env bash
# The GPU check of cuda_ipc in one device call of at most 8 minutes (on one H100/H200):
# environment report, a 2-rank smoke test, the GPU test suite, the init/destroy leak test,
# device benchmark and extras. Each stage runs under its own deadline (`timeout`), all of
# them under one total (GPU_T_TOTAL, 480 s: a later stage gets what is left), so a hang in
# one still leaves the other stages' results, and every result file is written while its
# stage runs. Nothing here uses the network. With no GPU visible to torch it stops at once
# (exit 3), saying so: every GPU test would skip and the stages would report success.
#
#   bash scripts/gpu_check.sh [STAGE]            # all (default), env, smoke, suite, leak, bench
#   GPU_RESULTS=$OUT bash scripts/gpu_check.sh   # results there instead of docs/results/
#
# Results, at most 6 files:
#   gpu_env.txt       device, driver, versions, commit, /dev/shm, `python -m cuda_ipc.info`
#                     (stream memory operations, CUDA IPC, a 2-process stream handoff on one
#                     GPU; run first), and at the end one line per stage: exit status, seconds
#   gpu_tests.log     the smoke test, then tests/test_cuda_ipc_gpu.py but the leak test
#                     (deadline per rank job, --maxfail)
#   gpu_leak.log      the init/destroy leak test: as many of 1000 cycles as fit its budget
#   gpu_bench.jsonl   all_reduce float32 on one GPU at 8 B, 64 KiB, 1, 64 and 256 MiB: 2 ranks
#   gpu_bench.md        shm / gloo / nccl (skipped, with the reason, where NCCL < 2.30 cannot
#                       share a GPU) and the device's memcpy, then 4 ranks shm / gloo
#                       (.md: the printed tables)
#   gpu_extras.jsonl  host vs device time of an enqueued 256 MiB all_reduce; DDP vs gloo
# Exit status: 0 when every stage passed, 1 when one failed, 2 on bad usage or wheels, 3 when
# torch sees no GPU.
#
# Through the device tool (no network there; posix-ipc travels as a wheel):
#   here, once:  bash scripts/gpu_wheels.sh          (fills .whl/, git-ignored)
#   run:  command "GPU_CHECK_COMMIT=<git rev-parse --short HEAD here> GPU_RESULTS=$OUT
#         bash scripts/gpu_check.sh", carry [".whl"], timeout_s 540
#   then copy the files from files_at into docs/results/ and commit them.
# Deadlines in seconds (GPU_T_ENV, GPU_T_SMOKE, GPU_T_SUITE, GPU_T_LEAK, GPU_T_BENCH2,
# GPU_T_BENCH4, GPU_T_EXTRAS; GPU_T_TOTAL): 75, 50, 120, 60, 60, 75, 50; 480 in all (a
# stage that would pass the total gets what is left of it).
# GPU_CHECK_NO_GPU_OK=1 runs the stages without a GPU (a dry run of this script on a CPU
# machine: the GPU tests skip).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
case "$stage" in all|env|smoke|suite|leak|bench) ;; *) echo "unknown stage: $stage" >&2; exit 2;; esac
PY=${PYTHON:-python3}
OUT=${GPU_RESULTS:-docs/results}
mkdir -p "$OUT"
T_ENV=${GPU_T_ENV:-75} T_SMOKE=${GPU_T_SMOKE:-50} T_SUITE=${GPU_T_SUITE:-120}
T_LEAK=${GPU_T_LEAK:-60} T_BENCH2=${GPU_T_BENCH2:-60} T_BENCH4=${GPU_T_BENCH4:-75}
T_EXTRAS=${GPU_T_EXTRAS:-50} T_TOTAL=${GPU_T_TOTAL:-480}
t_all=$(date +%s)
# the driver's tools live there on the GPU machines (nvidia-smi)
if [ -d /usr/local/nvidia/bin ]; then export PATH=/usr/local/nvidia/bin:$PATH; fi
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

if [ "$stage" = all ] || [ "$stage" = env ]; then : > "$OUT/gpu_env.txt"; fi
# No GPU visible to torch: every GPU test would skip and the stages exit 0. Stop, saying so.
if ! gpu_seen=$("$PY" -c "import torch; print(torch.__version__, 'CUDA', torch.version.cuda,
'available', torch.cuda.is_available()); raise SystemExit(0 if torch.cuda.is_available() else 3)" 2>&1); then
  echo "gpu_check: torch sees no CUDA device ($gpu_seen)" | tee -a "$OUT/gpu_env.txt"
  nvidia-smi -L 2>&1 | head -3 | tee -a "$OUT/gpu_env.txt"
  if [ "${GPU_CHECK_NO_GPU_OK:-0}" != 1 ]; then
    echo "gpu_check: stopped: every GPU test would skip (GPU_CHECK_NO_GPU_OK=1 runs the stages anyway)" \
      | tee -a "$OUT/gpu_env.txt"
    exit 3
  fi
  echo "gpu_check: GPU_CHECK_NO_GPU_OK=1: running the stages anyway (GPU tests skip)" \
    | tee -a "$OUT/gpu_env.txt"
fi
[ "${GPU_CHECK_NO_GPU_OK:-0}" = 1 ] || export SHMCOLL_REQUIRE_GPU=1

# run NAME SECONDS LOG (w|a) CMD...: CMD under a deadline (SIGTERM, then SIGKILL 10 s
# later, to its whole process group), its output into LOG; noted in the summary. The
# deadline is cut to what is left of T_TOTAL (less the kill grace); with under 15 s left the
# stage is not started.
run() {
  local name=$1 limit=$2 log=$3 mode=$4 t0 rc left
  shift 4
  left=$(( T_TOTAL - ($(date +%s) - t_all) - 10 ))
  if [ "$left" -lt 15 ]; then
    echo "gpu_check: stage '$name' not started: ${left}s left of GPU_T_TOTAL=${T_TOTAL}s" \
      | tee -a "$log"
    summary+=("$name: not started (total deadline)")
    status=1
    return 1
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
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
  return "$rc"
}

env_report() {
  echo "date: $(date -Is)  commit: $GPU_CHECK_COMMIT  stage: $GPU_CHECK_STAGE"
  git status --short 2>/dev/null | head -5 | sed 's/^/uncommitted: /'
  echo "wheels: $GPU_CHECK_WHEELS"
  # first what matters most (it prints each finding as it comes)
  "$GPU_CHECK_PY" -m cuda_ipc.info
  echo "cuda_ipc.info: exit $?"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode,persistence_mode \
    --format=csv 2>&1
  df -h /dev/shm 2>&1
  "$GPU_CHECK_PY" - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.machine(), "kernel", platform.release())
for name in ("torch", "numpy", "numba", "llvmlite", "posix_ipc"):
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
}
export -f env_report

if [ "$stage" = all ] || [ "$stage" = env ]; then
  run env "$T_ENV" "$OUT/gpu_env.txt" a bash -c env_report
fi
maxfail=4
if [ "$stage" = all ] || [ "$stage" = smoke ]; then
  # 2 ranks, the basics: a failure here leaves the suite fewer failures to spend time on
  run smoke "$T_SMOKE" "$OUT/gpu_tests.log" w env SHMCOLL_GPU_JOB_TIMEOUT_S=40 \
    SHMCOLL_GPU_TEST_TIMEOUT_S=$(( T_SMOKE - 5 )) "$PY" -m pytest tests/test_cuda_ipc_gpu.py \
    -m cuda -v -rA -s --tb=short -p no:cacheprovider -k smoke || maxfail=2
fi
if [ "$stage" = all ] || [ "$stage" = suite ]; then
  # a hang costs one job's 40 s, and --maxfail stops a broken suite early
  run suite "$T_SUITE" "$OUT/gpu_tests.log" a env SHMCOLL_GPU_JOB_TIMEOUT_S=40 \
    SHMCOLL_GPU_TEST_TIMEOUT_S=60 "$PY" -m pytest tests/test_cuda_ipc_gpu.py -m cuda -v -rA \
    --durations=0 --tb=short -p no:cacheprovider --maxfail=$maxfail \
    -k "not thousand and not smoke"
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
  # 4 ranks without NCCL (2 ranks per GPU at most, and only from NCCL 2.30)
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
