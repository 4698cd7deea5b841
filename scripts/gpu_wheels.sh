#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels scripts/gpu_check.sh needs on the
# GPU machine (Python 3.12, x86_64, no network) into .whl/ (git-ignored via .git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 -d .whl posix-ipc expecttest
ls -l .whl
