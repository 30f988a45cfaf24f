"""Window-state snapshots at cached prefix boundaries, so a prefix-cache hit needs no replay (SGLang's SWA radix
cache keeps such states beside its tree).

Pages hold what grows with the sequence; a slot's window rings, compressor open windows, DSpark drafter context
ring and (host-side) Engram history do not. While a request prefills, the engine copies its slot state at every
page-aligned chunk end (on the device, after the chunk's step) and files it under the token prefix it follows.
On a hit, the request starts from the deepest snapshot inside its cached prefix instead of replaying tokens
(`serving.prefix.prefix_admission`). The Engram history is not stored: the host rebuilds it from the tokens.

Snapshots are keyed by a digest of the token prefix (`prefix_key`, `boundary_keys`), bounded by a count
(`capacity`, least recently used dropped first), and dropped with the tree block that ends their prefix.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import jax
import numpy as np


def prefix_key(tokens: Sequence[int]) -> bytes:
    """The digest a snapshot after `tokens` is filed under."""
    return hashlib.blake2b(np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


def boundary_keys(tokens: Sequence[int], block: int, limit: int) -> list[tuple[int, bytes]]:
    """(b, `prefix_key(tokens[:b])`) for every multiple b of `block` in [block, limit], hashed in one pass."""
    digest, out = hashlib.blake2b(digest_size=16), []
    for end in range(block, limit + 1, block):
        digest.update(np.asarray(tokens[end - block:end], np.int64).tobytes())
        out.append((end, digest.copy().digest()))
    return out


def put_newest(entries: collections.OrderedDict, key, value, capacity: int) -> int:
    """Put `value` under `key` as the most recently used entry, then drop the least recently used ones beyond
    `capacity`; returns how many were dropped."""
    entries[key] = value
    entries.move_to_end(key)
    dropped = max(0, len(entries) - capacity)
    for _ in range(dropped):
        entries.popitem(last=False)
    return dropped


class SnapshotStore:
    """Slot-state snapshots (device arrays) by prefix key: at most `capacity` (0: none), least recently used
    dropped first; counters for monitoring."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"prefix_snapshots must be a non-negative integer, got {capacity!r}")
        self.capacity = capacity
        self.entries: collections.OrderedDict[bytes, list[jax.Array]] = collections.OrderedDict()
        self.taken = self.hits = self.dropped = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def put(self, key: bytes, state: list[jax.Array]) -> None:
        """File a new snapshot (dropping the least recently used beyond the capacity)."""
        if self.capacity:
            self.taken += 1
            self.dropped += put_newest(self.entries, key, state, self.capacity)

    def get(self, key: bytes) -> list[jax.Array] | None:
        """The snapshot filed under `key` (now the most recently used), or None."""
        state = self.entries.get(key)
        if state is not None:
            self.entries.move_to_end(key)
        return state

    def drop(self, key: bytes) -> None:
        """Forget the snapshot under `key`, if any (its prefix left the cache)."""
        if self.entries.pop(key, None) is not None:
            self.dropped += 1

    def deepest(self, tokens: Sequence[int], block: int, limit: int, above: int) -> tuple[int, list | None]:
        """(b, snapshot) for the largest block multiple b in (above, limit] with a snapshot after tokens[:b];
        (above, None) when there is none. Counts a hit."""
        for end, key in reversed(boundary_keys(tokens, block, limit)):
            if end <= above:
                break
            if key in self.entries:
                self.hits += 1
                return end, self.get(key)
        return above, None

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for state in self.entries.values() for leaf in state)
