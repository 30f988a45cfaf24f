"""One engine over the processes of a `jax.distributed` job: the leader schedules, every process runs each step.

Every process builds the same `Engine` on the one global mesh (`--mesh` over all the job's devices) and keeps the
same host state, so each launches the same compiled programs, in the same order, on its own devices. The leader
(process 0) sends its engine settings first (`send_config`). It is the engine its users see: `Leader` passes
through to it and sends each call that changes the engine (a request added or cancelled, a step, a warm-up) to
the other processes on a `sharding.multihost.Channel`, with the values of the engine's clock readings and
background-dependent choices (`HostChoices`) in between. Every other process runs `follow`: it repeats the
leader's calls on its own engine, taking those values from the leader, until the leader stops it. Steps gather
their outputs onto every process, so each reads the same tokens.

A process that fails ends the job: a step whose collectives fail raises `ProcessFailed`, and a process that dies
stops its pulse, which the others' `sharding.multihost.watch` sees within `LOST_SECONDS`: the leader then fails
the requests in flight with an error naming it, and every process exits non-zero.
"""

from __future__ import annotations

import dataclasses
import time

import jax
from jax.sharding import Mesh

from serving.base.engine_config import EngineConfig
from serving.base.host_choices import Channel
from sharding.mesh import MeshSpec
from sharding.multihost import LOST_SECONDS, PULSE_SECONDS

# the calls that change an engine, repeated on every process; the ones run after the leader's own call succeeds
# (a bad request is refused once, on the leader) take no `HostChoices` values. The leader alone compiles in the
# background (`compile_in_background`): another process compiles a bucket when the leader's steps first need it,
# since two threads tracing mesh steps at once failed in JAX (an `AbstractRef` error).
REPEATED = ("add_request", "cancel", "abort", "step", "warmup")
AFTER_LEADER = ("add_request", "cancel")


class ProcessFailed(RuntimeError):
    """A step of the multi-process engine failed: a process of the job failed or lost touch."""


def _failed(message: str, error: jax.errors.JaxRuntimeError) -> ProcessFailed:
    """`ProcessFailed(message)`, after the time `sharding.multihost.watch` takes to see a lost process: a step's
    collective fails at once when a peer dies, but only the watch can say which one was lost (it ends this process
    with that reason); a failure it does not explain is raised as is."""
    time.sleep(LOST_SECONDS + 4 * PULSE_SECONDS)
    return ProcessFailed(f"{message}: a process of the job failed or lost touch ({error})")


class Leader:
    """The leader's engine (process 0 of a multi-process job; see the module docstring): reads pass through to
    `engine`, the calls in `REPEATED` are sent to the other processes too. `close` stops them."""

    def __init__(self, engine, channel: Channel):
        own = {"engine": engine, "channel": channel, "processes": jax.process_count(),
               "_calls": [], "_closed": False}  # `_calls`: run here, not sent yet
        for name, value in own.items():
            object.__setattr__(self, name, value)
        engine.choices.publish(channel)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.engine, name, value)  # e.g. `on_compile`

    def __getattr__(self, name: str):
        value = getattr(self.engine, name)
        if name not in REPEATED:
            return value

        def repeated(*args, **kwargs):
            if name in AFTER_LEADER:
                result = value(*args, **kwargs)
                if name == "add_request":
                    kwargs = {**kwargs, "request_id": result}  # the leader's id (a fresh one is random)
                self._calls.append((name, args, kwargs))
                return result
            self._send((name, args, kwargs))
            try:
                return value(*args, **kwargs)
            except jax.errors.JaxRuntimeError as e:
                raise _failed(f"the {self.processes}-process engine failed in {name}", e) from e

        return repeated

    def _send(self, call: tuple[str, tuple, dict]) -> None:
        calls = [*self._calls, call]
        self._calls.clear()
        self.channel.send(("calls", calls))

    def close(self) -> None:
        """Stop the other processes (after the calls run here so far), once: after this process's background
        compilation ends (`Engine.close`), so the job's processes reach `sharding.multihost.finish` together."""
        if not self._closed:
            object.__setattr__(self, "_closed", True)
            self.engine.close()
            self._send(("stop", (), {}))


def send_config(channel: Channel, config: EngineConfig, model_config) -> None:
    """The leader's first message: its engine settings (less `detokenize`: each process has its own) and its
    model's config, sent before it builds its engine, since building one runs collectives that need every
    process. Raises ValueError for a mesh that does not hold every device of the job (each process must run
    every step)."""
    mesh = config.mesh
    size = (1 if mesh is None else mesh.devices.size if isinstance(mesh, Mesh)
            else (MeshSpec.parse(mesh) if isinstance(mesh, str) else mesh).num_devices)
    total = jax.device_count()
    if size != total:
        raise ValueError(f"a {jax.process_count()}-process engine needs a --mesh over all {total} devices of the "
                         f"job ({jax.local_device_count()} per process), got one of {size} (dp x cp devices: ep "
                         f"splits the dp ranks' experts, e.g. dp={total},ep=2)")
    channel.send(("config", dataclasses.replace(config, detokenize=None), model_config))


def follower_config(channel: Channel, model_config) -> EngineConfig:
    """The leader's engine settings (its first message), but its `detokenize`: a follower builds its engine from
    them, with its own tokenizer's (stop strings end requests alike on every process). Raises ValueError if this
    process's model (`model_config`) is not the leader's."""
    kind, config, leaders = channel.receive()
    if kind != "config":
        raise RuntimeError(f"expected the leader's engine settings first, got {kind!r}")
    if leaders != model_config:
        differ = [f.name for f in dataclasses.fields(leaders) if getattr(leaders, f.name, None)
                  != getattr(model_config, f.name, None)] if type(leaders) is type(model_config) else ["its type"]
        raise ValueError(f"process {jax.process_index()}'s model is not the leader's ({', '.join(differ[:5])} "
                         f"differ): give every process the same --model")
    return config


def follow(engine, channel: Channel) -> None:
    """Repeat the leader's calls on `engine` (built from `follower_config`) until the leader stops; a finished
    request is forgotten at once (only the leader reports results)."""
    engine.choices.follow(channel)
    while True:
        kind, calls = channel.receive()
        if kind != "calls":
            raise RuntimeError(f"this process is out of step with the leader: it expected calls, got {kind!r}")
        for name, args, kwargs in calls:
            if name == "stop":
                return
            if name == "cancel" and args[0] not in engine.requests:
                continue  # finished here already
            try:
                result = getattr(engine, name)(*args, **kwargs)
            except jax.errors.JaxRuntimeError as e:
                raise _failed(f"process {jax.process_index()} of the {jax.process_count()}-process engine failed "
                              f"in {name}", e) from e
            if name in ("step", "abort"):
                for output in result:
                    engine.requests.pop(output.request_id, None)
