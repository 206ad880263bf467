#!/usr/bin/env bash
# Fill .whl/ (repository root) with the wheels torchtitan 0.2.2 needs on the GPU machine, which
# has torch 2.11, Python 3.12 and no network. Run it here, where the package registry is
# reachable; then carry .whl/ to the GPU machine and run examples/torchtitan/install_wheels.py
# there, which installs only the distributions that machine lacks (never torch).
#
#   bash examples/torchtitan/download_wheels.sh          # -> .whl/ (~14 MB) and .whl-arrow/ (~53 MB)
#
# .whl/        torchtitan and the small pure-Python pieces it imports that the GPU image lacks
#              (torchdata, tyro, docstring_parser, typeguard, einops), plus `datasets` and its small
#              deps (dill, multiprocess, xxhash, pandas), which torchtitan's llama3 spec imports.
# .whl-arrow/  pyarrow (~53 MiB), which `datasets` needs: carry it only if the GPU image lacks it,
#              in a call of its own (with .whl it would pass the 64 MiB a device call carries):
#              python examples/torchtitan/install_wheels.py .whl-arrow
set -euo pipefail
cd "$(dirname "$0")/../.."
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
          --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
          --platform manylinux_2_17_x86_64)
get() {  # get <dir> <requirement>...
  local dir=$1; shift
  mkdir -p "$dir"
  python -m pip download -q --no-deps "${PLATFORM[@]}" -d "$dir" "$@"
}
get .whl torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.0 \
    einops==0.8.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pandas==3.1.1
get .whl-arrow pyarrow==26.0.1
du -sh .whl .whl-arrow
ls .whl .whl-arrow
