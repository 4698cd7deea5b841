#!/usr/bin/env bash
# CI: build shmcoll's wheel (its kernels compiled in: shmcoll/tools/build_kernels.py), install it
# (and its dependencies) into fresh virtualenvs, and run from it, as a user who
# pip-installs it would, asserting every time that numba compiled NOTHING (the kernels the
# wheel ships are loaded): a 2-rank all_reduce without torch (the engine's numpy API); then,
# torch added through the `torch` extra, every collective a first job meets on "shm" in 2
# rank processes with a writable site-packages and no `import shmcoll` (the wheel's
# torch.backends entry point registers it), and in 4 rank threads (threaded_pg); then a
# 2-rank all_reduce with site-packages read-only (numba's kernel cache then goes to
# $HOME/.cache; autoload off, `import shmcoll` registers), then with HOME unwritable too
# (shmcoll's private temp directory). 3 min on the 2-core machine at load 4 (main's
# before the kernels: 2.3 min), 5 min at load 5-7.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/shmcoll-wheel-check.XXXXXX)
TORCH_PID=
trap '[ -z "$TORCH_PID" ] || kill "$TORCH_PID" 2>/dev/null; rm -rf "$WORK"' EXIT
t0=$SECONDS

# The torch checks' venv gets torch, the CPU build, in the background while the wheel
# builds: ~40 s, mostly unpacking, beside the kernels' ~20-60 s of compiling. (As the
# `torch` extra's resolution, pip would take the newest torch, a CUDA build of several GB.)
# --no-compile: byte-compiling torch's thousands of files took ~45 of the ~55 s here.
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q --no-compile "torch==2.13.0" >"$WORK/torch.log" 2>&1 &
TORCH_PID=$!

# Build from a copy of the sources: an in-tree build leaves build/ and egg-info behind.
mkdir "$WORK/src"
tar --exclude=.git --exclude=__pycache__ --exclude=build --exclude='*.egg-info' \
    --exclude=results --exclude='*.so' -cf - . | tar -xf - -C "$WORK/src"
# require: a wheel whose kernels failed to build fails here, not later as a slow first call
SHMCOLL_BUILD_KERNELS=require "$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/shmcoll-*.whl)
LISTING=$(unzip -Z1 "$WHEEL")
echo "wheel check: built $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB," \
     "$(grep -c '^shmcoll/_kernels/.*\.nbc$' <<<"$LISTING" || true) kernel files) in" \
     "$((SECONDS - t0)) s"
if grep -q '__pycache__' <<<"$LISTING" || \
        grep -v '^shmcoll/_kernels/' <<<"$LISTING" | grep -q '\.nb[ic]$'; then
    echo "wheel check: the wheel carries compiled caches outside shmcoll/_kernels/" >&2
    exit 1
fi
if ! grep -q '^shmcoll/torch_backend/_lane\..*\.so$' <<<"$LISTING"; then
    echo "wheel check: the wheel has no compiled latency path (shmcoll/torch_backend/_lane)" >&2
    exit 1
fi
if ! grep -q '^shmcoll/_kernels/[^/]*/manifest\.json$' <<<"$LISTING"; then
    echo "wheel check: the wheel ships no kernels (shmcoll/_kernels/<cpu>/)" >&2
    exit 1
fi

# First without torch (an optional dependency), in a venv of its own: the engine alone.
"$PY" -m venv "$WORK/venv-numpy"
"$WORK/venv-numpy/bin/python" -m pip install -q --no-compile "$WHEEL"
SITE_NUMPY=$("$WORK/venv-numpy/bin/python" -c \
    "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "wheel check: installed without torch at $((SECONDS - t0)) s"

readonly_site() {  # run "$@" with $SITE mounted read-only (a root user ignores chmod)
    if [ "$(id -u)" != 0 ]; then
        chmod -R a-w "$SITE"
        local rc=0
        "$@" || rc=$?
        chmod -R u+w "$SITE"
        return $rc
    fi
    if ! unshare -m true 2>/dev/null; then
        echo "wheel check: SKIPPED read-only site-packages (root without mount namespaces)"
        return 0
    fi
    unshare -m sh -c 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"' \
        "$SITE" "$@"
}

REPO=$PWD
cd "$WORK"  # outside the repository: nothing but the venv may provide shmcoll
mkdir home
run=(env -u PYTHONPATH -u NUMBA_CACHE_DIR -u XDG_CACHE_HOME)
run+=(-u TORCH_DEVICE_BACKEND_AUTOLOAD)
"${run[@]}" HOME="$WORK/home" "$WORK/venv-numpy/bin/python" "$REPO/scripts/wheel_check.py" \
    --expect-prefix "$SITE_NUMPY" --expect-no-compile --mode numpy  # no torch installed

if ! wait "$TORCH_PID"; then
    TORCH_PID=
    grep -v 'is ignored' "$WORK/torch.log" >&2 || true
    "$VPY" -m pip install -q --no-compile torch
fi
TORCH_PID=
"$VPY" -m pip install -q --no-compile "$WHEEL[torch]"
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "wheel check: torch added (shmcoll[torch]) at $((SECONDS - t0)) s"
check=("$VPY" "$REPO/scripts/wheel_check.py" --expect-prefix "$SITE" --expect-no-compile)
# writable: the cache next to the sources; "shm" from the wheel's entry point alone; every
# collective (the shipped kernels are read where they lie: the read-only runs below check
# where numba's cache goes, with the first all_reduce)
"${run[@]}" HOME="$WORK/home" "${check[@]}" --mode autoload --workload --threads 4
readonly_site "${run[@]}" HOME="$WORK/home" TORCH_DEVICE_BACKEND_AUTOLOAD=0 "${check[@]}" \
    --mode import --expect-cache-outside "$SITE"
readonly_site "${run[@]}" HOME=/proc/nonexistent TMPDIR="$WORK" "${check[@]}" \
    --mode autoload --expect-cache-outside "$SITE"
echo "wheel check: passed in $((SECONDS - t0)) s"
