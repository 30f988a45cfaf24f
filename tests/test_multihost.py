"""Two `jax.distributed` processes on localhost (4 emulated CPU devices each, one dp=8,ep=4 mesh) give the
same logits and greedy tokens as one process; a process waiting in `finish` is not taken for a lost one."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.serving import free_port
from model.initialize import init_model
from model.config import preset

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # tiny programs: compile time is all that counts
    return env


def test_two_processes_equal_one(tmp_path):
    port, out, env = free_port(), tmp_path / "logits.npy", _env()
    procs = [subprocess.Popen([sys.executable, "-m", "sharding.multihost", "--process-id", str(i),
                               "--num-processes", "2", "--port", str(port), "--out", str(out)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    tokens = np.random.default_rng(0).integers(0, 256, (8, 12))  # the leader's plan (sharding.multihost)
    single = np.asarray(init_model(preset("tiny"), seed=0).logits(tokens))
    distributed = np.load(out)
    np.testing.assert_allclose(distributed, single, atol=1e-5, rtol=0)
    assert (distributed.argmax(-1) == single.argmax(-1)).all()


# process 1 ends its part at once; process 0 watches it, then works on for three times `watch`'s limit before it
# ends too (a leader finishing its last compilation after the others stopped)
LATE_FINISH = """
import os, sys, time
from sharding import multihost
multihost.initialize(f"localhost:{sys.argv[1]}", 2, int(sys.argv[2]), 1)
if multihost.leader():
    multihost.watch(lambda why: (print("lost:", why, flush=True), os._exit(3)))
    time.sleep(3 * multihost.LOST_SECONDS)
multihost.finish()
"""


def test_a_process_waiting_in_finish_is_not_lost():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", LATE_FINISH, str(port), str(i)], cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert "lost:" not in logs[0]
