#!/usr/bin/env bash
# Run tests/test_transformers.py against another transformers release, installed (without its
# dependencies) into a folder of its own that is put first on PYTHONPATH; everything else is the
# current environment's.
#
#   scripts/test_transformers_version.sh 5.18.0              # the oldest release dtcp accepts
#   scripts/test_transformers_version.sh 5.24.0 -k llama4    # extra arguments go to pytest
#
# The folder is ${DTCP_TRANSFORMERS_DIR:-/tmp/dtcp-transformers-<version>}, reused when it exists.
# Releases before 5.18 need huggingface-hub < 2 and tokenizers <= 0.23.0 (not what dtcp's extra
# installs) and are outside the accepted range.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 TRANSFORMERS_VERSION [pytest args...]" >&2
  exit 2
fi
version="$1"; shift
root="$(cd "$(dirname "$0")/.." && pwd)"
target="${DTCP_TRANSFORMERS_DIR:-/tmp/dtcp-transformers-$version}"
if [ ! -d "$target/transformers" ]; then
  python -m pip install -q --no-deps --target "$target" "transformers==$version"
fi
cd "$root"
PYTHONPATH="$target:$root${PYTHONPATH:+:$PYTHONPATH}" python -c \
  "import transformers; print('transformers', transformers.__version__, 'from', transformers.__file__)"
PYTHONPATH="$target:$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 python -m pytest -q tests/test_transformers.py "$@"
