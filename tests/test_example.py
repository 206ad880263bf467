"""examples/train_llama.py --check under torchrun on 2 gloo ranks: the context-parallel run's
losses must equal a single-process run without context parallelism (fp32, relative 1e-6)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(*extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "train_llama.py"), "--check", "--compile", "aot_eager", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_train_llama_check_cpu():
    from dist_harness import close_all

    close_all()  # (the spawned rank pools of earlier tests would compete with the example for 2 cores)
    rc, out = run_example("--steps", "5")
    assert rc == 0, out[-4000:]
    assert "check: max relative loss difference" in out and "-> PASS" in out, out[-4000:]
    assert out.count("loss ") >= 5 and "tokens/s" in out, out[-4000:]
