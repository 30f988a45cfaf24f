"""The sharded model across processes (`jax.distributed`): one leader decides each step, every process runs it.

`initialize` joins a process to the job (CPU processes talk through gloo). The leader (process 0) owns
the step's plan; `broadcast_plan` gives every process the leader's copy of an array, and a `Channel` carries
the leader's messages, in order, through the job's key-value store (the serving engine's lockstep,
`serving.core.lockstep`). Each process runs the same program on its own devices of the global mesh: `put`
places host arrays (the same on every process) on a sharding of that mesh, `to_host` reads an array split
over the processes. Run as `python -m sharding.multihost --process-id I --num-processes N --port P ...` it is
one process of a whole-sequence forward (`sharding.mesh.logits_on_mesh`): the leader writes the logits to
`--out` (a .npy file).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import Int

from sharding.mesh import place

PULSE_SECONDS = 0.5  # how often each process says it lives (`watch`)
LOST_SECONDS = 5.0  # a process silent this long is gone
HEARTBEAT_SECONDS = 30  # the coordination service's own limit, after `watch`'s: it ends the job's processes
_finishing = threading.Event()  # this process is ending the job (`finish`): the pulse and `watch` stop
_threads: list[threading.Thread] = []  # the pulse and the watches, joined before the job ends


def initialize(coordinator: str, num_processes: int, process_id: int, local_devices: int | None = None) -> None:
    """Join a `jax.distributed` job before any JAX operation (on CPU: `local_devices` emulated devices), and start
    this process's pulse for `watch`. The job is recoverable: a process that dies does not end the others at
    once, so they can fail their work with a clear error first (`watch`)."""
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if local_devices:
            jax.config.update("jax_num_cpu_devices", local_devices)
    jax.config.update("jax_enable_recoverability", True)
    # The processes trace the same programs from different call sites (the leader's code and `follow`'s), and
    # under jax 0.12.1 a program whose HLO locations differ between the processes never completes its collectives:
    # locations keep no Python frames, so every process compiles the same HLO.
    jax.config.update("jax_traceback_in_locations_limit", 0)
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_SECONDS, shutdown_timeout_seconds=30)
    _start(threading.Thread(target=_pulse, args=(_client(), process_id), name="pulse", daemon=True))


def _start(thread: threading.Thread) -> threading.Thread:
    _threads.append(thread)
    thread.start()
    return thread


def finish(timeout: float = 60.0) -> None:
    """End the job once every process has got here (a recoverable job's shutdown waits for no one): the leader
    shuts the coordination service down; every other process exits at once, with status 0, since a shutdown
    handshake with a service that may be gone already would fail. A process here says so before its pulse
    stops, so the others' `watch` does not take a process waiting for them for a lost one."""
    _client().key_value_set(f"finished/{jax.process_index()}", "1")
    _finishing.set()  # this process's pulse and watch stop from here on
    for thread in _threads:  # out of the client's calls before it goes (a thread inside one at exit aborts)
        thread.join(timeout=5 * PULSE_SECONDS)
    _client().wait_at_barrier("finish", int(timeout * 1000))
    if leader():
        jax.distributed.shutdown()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _client():
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise RuntimeError("no jax.distributed job: call sharding.multihost.initialize first")
    return distributed.global_state.client


def _pulse(client, process_id: int) -> None:
    beat = 0
    while not _finishing.is_set():
        try:
            client.key_value_set(f"pulse/{process_id}", str(beat), allow_overwrite=True)
        except jax.errors.JaxRuntimeError:
            return  # the coordination service is gone: `watch` tells
        beat += 1
        time.sleep(PULSE_SECONDS)


def watch(on_lost: Callable[[str], None], timeout: float = LOST_SECONDS) -> threading.Thread:
    """Call `on_lost(why)` once (on a daemon thread) when another process of the job stops its pulse for `timeout`
    seconds, or the coordination service (in process 0) cannot be reached. A step of a job that lost a process
    waits in its collectives for ever: `on_lost` must fail the work and end this process."""
    client, me = _client(), jax.process_index()
    others = [i for i in range(jax.process_count()) if i != me]

    def lose(why: str) -> None:
        if not _finishing.is_set():  # a process ending the job stops its pulse: no loss
            on_lost(why)

    def run():
        seen = {i: (None, time.monotonic()) for i in others}  # the processes watched: last beat, when it changed
        while seen and not _finishing.is_set():
            time.sleep(PULSE_SECONDS)
            now = time.monotonic()
            for i in list(seen):
                try:
                    beat = _try_get(client, f"pulse/{i}")  # None: not started yet
                    if beat != seen[i][0]:
                        seen[i] = (beat, now)
                    elif now - seen[i][1] > timeout:
                        if _try_get(client, f"finished/{i}") is None:
                            return lose(f"process {i} of the {len(others) + 1}-process job stopped ({timeout:.0f} "
                                        f"s without a sign of life)")
                        del seen[i]  # it waits for this one in `finish`
                except jax.errors.JaxRuntimeError as e:
                    return lose(f"the job's coordination service (process 0) cannot be reached ({e})")

    return _start(threading.Thread(target=run, name="watch", daemon=True))


def _try_get(client, key: str) -> str | None:
    """The job's value at `key`, or None where none was set."""
    try:
        return client.key_value_try_get(key)
    except jax.errors.JaxRuntimeError as e:
        if "NOT_FOUND" in str(e):
            return None
        raise


def leader() -> bool:
    """Whether this process leads the job (process 0; a single process leads itself)."""
    return jax.process_index() == 0


class Channel:
    """The leader's messages (picklable objects) to the other processes, in order, through the `jax.distributed`
    key-value store: message i is key `{name}/i`. The leader `send`s, every other process `receive`s the next one;
    the leader deletes a message once `keep` newer ones were sent (the others read each within a few steps)."""

    def __init__(self, name: str = "jaxseek", keep: int = 4096):
        self.client, self.name, self.keep = _client(), name, keep
        self.count = 0  # messages sent (leader) or received (the others)

    def send(self, message: object) -> None:
        self.client.key_value_set_bytes(f"{self.name}/{self.count}", pickle.dumps(message))
        if self.count >= self.keep:
            self.client.key_value_delete(f"{self.name}/{self.count - self.keep}")
        self.count += 1

    def receive(self, poll_seconds: float = 60.0) -> object:
        """The leader's next message, waiting for it as long as the job lives (an idle server sends none)."""
        key = f"{self.name}/{self.count}"
        while True:
            try:
                raw = self.client.blocking_key_value_get_bytes(key, int(poll_seconds * 1000))
                break
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self.count += 1
        return pickle.loads(raw)


def put(tree, shardings):
    """`tree`'s host arrays, the same on every process, placed as `shardings` say: each process places only its
    own devices' parts (`sharding.mesh.place`; `jax.device_put` would check that the processes agree, a
    collective per leaf)."""
    return jax.device_put(tree, shardings) if jax.process_count() == 1 else place(tree, shardings)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole of `x` as numpy on this process, gathered from the others where they hold parts of it."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def broadcast_plan(plan: Int[np.ndarray, "..."]) -> Int[np.ndarray, "..."]:
    """The leader's plan on every process (the others pass an array of the same shape and dtype)."""
    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(plan)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--local-devices", type=int, default=4)
    p.add_argument("--config", default="tiny")
    p.add_argument("--mesh", default="dp=8,ep=4")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="where the leader writes the logits (.npy)")
    args = p.parse_args(argv)
    initialize(f"localhost:{args.port}", args.num_processes, args.process_id, args.local_devices)
    jax.config.update("jax_default_matmul_precision", "highest")
    from model.initialize import init_model
    from model.config import preset
    from sharding.mesh import MeshSpec, logits_on_mesh, make_mesh

    config = preset(args.config)
    tokens = (np.random.default_rng(args.seed).integers(0, config.vocab_size, (args.batch, args.seq))
              if leader() else np.zeros((args.batch, args.seq), np.int64))
    tokens = broadcast_plan(tokens)
    logits = logits_on_mesh(init_model(config, seed=args.seed), tokens, make_mesh(MeshSpec.parse(args.mesh)))
    logits = to_host(logits)
    if leader():
        np.save(args.out, logits)
    finish()


if __name__ == "__main__":
    main()
