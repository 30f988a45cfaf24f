"""What the engine decides from the clock or from work in other threads, made one decision for every process.

A step's shape and its DSpark verify length are host decisions; most follow from the requests alone, so every
process of a multi-process engine (`serving.core.lockstep`) takes them alike. Two kinds do not: readings of the
clock (DSpark's cost table is timed) and choices that depend on a background thread (which buckets are compiled
yet). The engine takes both through `HostChoices`: on one process, the clock and the choice itself; in a
multi-process job the leader `publish`es each value it took on a channel, and every other process `follow`s,
taking the leader's value in place of its own, in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


@runtime_checkable
class Channel(Protocol):
    """The leader's messages in order (`sharding.multihost.Channel`)."""

    def send(self, message: object) -> None: ...

    def receive(self) -> object: ...


class HostChoices:
    """The clock and the background-dependent choices of one engine (see the module docstring)."""

    def __init__(self):
        self.channel: Channel | None = None
        self.leads = True

    def publish(self, channel: Channel) -> None:
        """Lead: send every value taken from now on."""
        self.channel, self.leads = channel, True

    def follow(self, channel: Channel) -> None:
        """Follow: take every value from the leader's messages."""
        self.channel, self.leads = channel, False

    def now(self) -> float:
        """The clock (seconds, `time.perf_counter`)."""
        return self.choose(time.perf_counter)

    def choose(self, compute: Callable[[], T]) -> T:
        """`compute()`, or the leader's value for it."""
        if not self.leads:
            kind, value = self.channel.receive()
            if kind != "value":
                raise RuntimeError(f"this process is out of step with the leader: it expected a value, got {kind!r}")
            return value
        value = compute()
        if self.channel is not None:
            self.channel.send(("value", value))
        return value
