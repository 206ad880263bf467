#!/usr/bin/env bash
# Run dtcp's CPU test suite against another torch release, in a fresh virtual environment.
#
#   scripts/test_torch_version.sh 2.15.0                 # the whole suite
#   scripts/test_torch_version.sh 2.11.0 -k ring         # extra arguments go to pytest
#   WITH_TORCHTITAN=1 scripts/test_torch_version.sh 2.13.0   # also install the torchtitan extra
#
# The venv lives in ${DTCP_VENV_DIR:-/tmp/dtcp-torch-<version>} and is reused when it exists. pip
# installs the release's CPU build where the index has one (e.g. 2.13.0+cpu), else its default
# build (a CUDA build of several GB: it runs the CPU suite just the same).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 TORCH_VERSION [pytest args...]" >&2
  exit 2
fi
version="$1"; shift
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${DTCP_VENV_DIR:-/tmp/dtcp-torch-$version}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==$version+cpu" 2>/dev/null \
    || "$venv/bin/python" -m pip install -q "torch==$version"
  extras="dev"
  if [ "${WITH_TORCHTITAN:-0}" = "1" ]; then extras="dev,torchtitan"; fi
  # --no-build-isolation: setuptools' editable build must not resolve torch again
  "$venv/bin/python" -m pip install -q setuptools
  "$venv/bin/python" -m pip install -q --no-build-isolation -e "$root[$extras]"
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
cd "$root"
OMP_NUM_THREADS=1 exec "$venv/bin/python" -m pytest -q tests "$@"
