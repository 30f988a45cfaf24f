"""The prefix cache of a data-parallel engine: one `PrefixAdmission` per attention rank, over that rank's pages.

A rank's cached pages live in its own cache, so a request can use only the prefix its rank holds: each rank
keeps a tree, a host tier and window-state snapshots of its own (`host_pages` and `prefix_snapshots` split
evenly), and `DataParallelScheduler` sends a new request to the rank whose cache holds most of its prompt,
weighed against the rank's load (`cached_tokens`). See docs/sharding.md.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from serving.base.kv_cache import PageAllocator
from serving.prefix.prefix_admission import PrefixAdmission
from serving.base.request import Request


class RankPages(PageAllocator):
    """One rank's share of a pool split over ranks (`serving.core.engine_dp.ShardedPages`), as that rank's prefix
    cache sees a pool: its free list is the rank's, and the pages it reclaims are the rank's. The bookkeeping
    (references, slot tables) is the pool's."""

    def __init__(self, pool: PageAllocator, rank: int):  # no PageAllocator.__init__: the state is `pool`'s
        self.pool, self.rank = pool, rank

    def __getattr__(self, name: str):
        if name in ("pool", "rank"):  # unset: raise rather than recurse
            raise AttributeError(name)
        return getattr(self.pool, name)

    @property
    def free(self) -> list[int]:
        return self.pool.pools[self.rank]

    @property
    def reclaim(self) -> Callable[[int], int] | None:
        return self.pool.reclaims[self.rank]

    @reclaim.setter
    def reclaim(self, evict: Callable[[int], int] | None) -> None:
        self.pool.reclaims[self.rank] = evict


class RankedPrefix:
    """The per-rank prefix caches of a data-parallel engine, with `PrefixAdmission`'s interface: each call for a
    request goes to the cache of the rank holding its slot (`rank_of`)."""

    def __init__(self, ranks: list[PrefixAdmission], rank_of: Callable[[Request], int]):
        self.ranks, self.rank_of = ranks, rank_of

    def _of(self, request: Request) -> PrefixAdmission:
        return self.ranks[self.rank_of(request)]

    def cached_tokens(self, prompt: list[int]) -> list[int]:
        """Prompt tokens each rank's cache would serve (`PrefixAdmission.cached_tokens`)."""
        return [rank.cached_tokens(prompt) for rank in self.ranks]

    def admit(self, request: Request) -> None:
        self._of(request).admit(request)

    def restore(self, request: Request) -> list[jax.Array] | None:
        return self._of(request).restore(request)

    def chunk_done(self, request: Request) -> None:
        self._of(request).chunk_done(request)

    def confirm(self, request: Request) -> None:
        self._of(request).confirm(request)

    def prefilled(self, request: Request) -> None:
        self._of(request).prefilled(request)

    def finished(self, request: Request) -> None:
        self._of(request).finished(request)

    def dropped(self, request: Request) -> None:
        self._of(request).dropped(request)

    def flush(self) -> None:
        for rank in self.ranks:
            rank.flush()

    def clear(self) -> None:
        for rank in self.ranks:
            rank.clear()

    def metrics(self) -> dict[str, float]:
        """Every counter of `PrefixAdmission.metrics` summed over the ranks, the hit rate of them all, and each
        rank's hit rate (`rank{d}_hit_rate`)."""
        each = [rank.metrics() for rank in self.ranks]
        total = {key: sum(m[key] for m in each) for key in each[0]}
        total["hit_rate"] = total["hit_tokens"] / total["query_tokens"] if total["query_tokens"] else 0.0
        return total | {f"rank{d}_hit_rate": m["hit_rate"] for d, m in enumerate(each)}
