"""Install, from local wheels only, the distributions torchtitan 0.2.2 needs that this machine lacks.

    python examples/torchtitan/install_wheels.py .whl [.whl-arrow]

For the GPU machine (torch 2.11, no network), after `examples/torchtitan/download_wheels.sh`
here. A distribution whose module already imports is left alone; torch is never touched
(every wheel is installed with --no-deps). Ends by importing torchtitan's trainer and the
llama3_dtcp train spec, and exits non-zero naming whatever is still missing.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import subprocess
import sys

# distribution (wheel file prefix) -> module it provides
MODULES = {
    "torchtitan": "torchtitan", "torchdata": "torchdata", "tyro": "tyro",
    "docstring_parser": "docstring_parser", "typeguard": "typeguard", "einops": "einops",
    "datasets": "datasets", "dill": "dill", "multiprocess": "multiprocess", "xxhash": "xxhash",
    "pyarrow": "pyarrow", "pandas": "pandas",
}


def main() -> int:
    dirs = sys.argv[1:] or [".whl"]
    wheels = {}
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.whl"))):
            wheels[os.path.basename(path).split("-")[0]] = path
    missing = [dist for dist, mod in MODULES.items() if importlib.util.find_spec(mod) is None]
    print("missing before install:", missing or "nothing")
    todo = [wheels[d] for d in missing if d in wheels]
    absent = [d for d in missing if d not in wheels]
    if todo:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "-q", *todo], check=True)
    if absent:
        print(f"no wheel for {absent} in {dirs}: carry them (see download_wheels.sh)", file=sys.stderr)
        return 1
    importlib.invalidate_caches()
    import torch

    import dtcp.integrations.torchtitan  # noqa: F401  (imports torchtitan, registers llama3_dtcp)
    import torchtitan.train  # noqa: F401

    from importlib.metadata import version

    print(f"ok: torch {torch.__version__}, torchtitan {version('torchtitan')}, datasets {version('datasets')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
