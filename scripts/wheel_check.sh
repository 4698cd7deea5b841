#!/usr/bin/env bash
# CI: build shmcoll's wheel, install it (and its dependencies) into a fresh virtualenv, and
# run a 2-rank all_reduce from it, as a user who pip-installs it would: first without torch
# (the engine's numpy API), then, torch added through the `torch` extra, dist.all_reduce on
# "shm" with a writable site-packages and no `import shmcoll` (the wheel's torch.backends
# entry point registers it), then with site-packages read-only (numba's kernel cache then
# goes to $HOME/.cache; autoload off, `import shmcoll` registers), then with HOME
# unwritable too (shmcoll's private temp directory).
# About 1 min on the 2-core CI machine (3 min when it is loaded).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/shmcoll-wheel-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS

# Build from a copy of the sources: an in-tree build leaves build/ and egg-info behind.
mkdir "$WORK/src"
tar --exclude=.git --exclude=__pycache__ --exclude=build --exclude='*.egg-info' \
    --exclude=results -cf - . | tar -xf - -C "$WORK/src"
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
if unzip -l "$WORK"/dist/shmcoll-*.whl | grep -q -e '__pycache__' -e '\.nb[ic]$'; then
    echo "wheel check: the wheel carries compiled caches" >&2
    exit 1
fi

"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
WHEEL=$(ls "$WORK"/dist/shmcoll-*.whl)
# First without torch (an optional dependency): the engine alone, numpy only.
"$VPY" -m pip install -q --no-compile "$WHEEL"
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "wheel check: built and installed without torch in $((SECONDS - t0)) s"

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
check=("$VPY" "$REPO/scripts/wheel_check.py" --expect-prefix "$SITE")
"${run[@]}" HOME="$WORK/home" "${check[@]}" --mode numpy   # no torch installed
# --no-compile: byte-compiling torch's thousands of files took ~45 of the ~55 s here.
"$VPY" -m pip install -q --no-compile "$WHEEL[torch]"
echo "wheel check: torch added (shmcoll[torch]) at $((SECONDS - t0)) s"
# writable: the cache next to the sources; "shm" from the wheel's entry point alone
"${run[@]}" HOME="$WORK/home" "${check[@]}" --mode autoload
readonly_site "${run[@]}" HOME="$WORK/home" TORCH_DEVICE_BACKEND_AUTOLOAD=0 "${check[@]}" \
    --mode import --expect-cache-outside "$SITE"
readonly_site "${run[@]}" HOME=/proc/nonexistent TMPDIR="$WORK" "${check[@]}" \
    --mode autoload --expect-cache-outside "$SITE"
echo "wheel check: passed in $((SECONDS - t0)) s"
