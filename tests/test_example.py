"""examples/train_llama.py --check under torchrun on 2 gloo ranks: the context-parallel run's
losses must equal a single-process run without context parallelism (fp32, relative 1e-6)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(script: str, *args, timeout: float = 300) -> tuple[int, str]:
    """`torchrun --standalone --nproc-per-node 2 examples/<script> <args>` (also
    tests/test_hf_examples.py): (exit code, stdout + stderr). The spawned rank pools of earlier
    tests are closed first: they would compete with the example for 2 cores (a pool rank's gloo
    loop thread has been seen spinning on a core after the failure tests)."""
    from dist_harness import close_all

    close_all()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_train_llama_check_cpu():
    rc, out = run_example("train_llama.py", "--check", "--compile", "aot_eager", "--steps", "5")
    assert rc == 0, out[-4000:]
    assert "check: max relative loss difference" in out and "-> PASS" in out, out[-4000:]
    assert out.count("loss ") >= 5 and "tokens/s" in out, out[-4000:]
