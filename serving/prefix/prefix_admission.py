"""Prefix caching in the engine: requests share the compressed-KV and index-key pages of a cached prompt prefix.

A request adopts the pages of its prompt's longest cached prefix (`serving.prefix.prefix_cache`) and rebuilds its
per-slot state from a window-state snapshot or by replaying tokens before the hit's end (`exact_replay_tokens`).
Prompt and output pages enter the tree; evicted pages may wait in a host tier (`HostTier`).
See docs/prefix-cache-and-replay.md.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model.paged import Paged, map_state, page_pools
from sharding.multihost import put
from serving.base.kv_cache import EngineCache, PageAllocator, drafter_ring
from serving.prefix.prefix_cache import PrefixCache, PrefixMatch
from serving.base.request import Request
from serving.prefix.prompt_logprobs import PromptLogprobStore
from serving.prefix.window_snapshots import SnapshotStore, boundary_keys, prefix_key, put_newest

RINGS = ("ring_kv", "recent_kv")  # per-slot leaves [b, slots, d] whose slots follow the newest positions


def exact_replay_tokens(config, cache: EngineCache) -> int:
    """The replay after which every per-slot ring of the engine `cache` holds what a cold prefill leaves."""
    named = jax.tree_util.tree_flatten_with_path(cache.layers)[0]
    ring = max(leaf.shape[1] for path, leaf in named if getattr(path[-1], "key", None) in RINGS)
    depth, window = config.num_hidden_layers, config.sliding_window
    tokens = ring + (depth - 1) * (window - 1)
    if cache.drafter is not None:
        tokens = max(tokens, drafter_ring(cache) + depth * (window - 1))
    return tokens


class HostTier:
    """Evicted prefix pages kept in host memory: each page's paged leaves (numpy), keyed by the token prefix its
    block ends, at most `capacity` pages (the least recently stored or used go first)."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"host_pages must be a non-negative integer, got {capacity!r}")
        self.capacity = capacity
        self.pages: collections.OrderedDict[tuple[int, ...], list[np.ndarray]] = collections.OrderedDict()
        self.stored = self.restored = self.dropped = 0

    def put(self, prefix: tuple[int, ...], contents: list[np.ndarray]) -> None:
        """Keep one evicted page's contents under its prefix (dropping the oldest page when full)."""
        if self.capacity:
            self.stored += 1
            self.dropped += put_newest(self.pages, prefix, contents, self.capacity)

    def take(self, prefix: tuple[int, ...]) -> list[np.ndarray] | None:
        """The contents of the page ending `prefix` (it leaves the tier: the device holds it again), or None."""
        contents = self.pages.pop(prefix, None)
        self.restored += contents is not None
        return contents


class PrefixAdmission:
    """The engine's prefix cache: the tree over the scheduler's page pool, what each running request holds of
    it, the replay length (`replay`, read at each admission) and the optional host tier (`read_page` /
    `write_page` copy one page's paged leaves between the device cache and numpy). With bounded replay in the
    engine's prefill (`bounded_keep` > 0, `model.replay`) a hit's prefill starts no later than `bounded_keep`
    tokens before the prompt's end, so the replay layers see what a cold prefill shows them."""

    def __init__(self, pages: PageAllocator, replay: int, host_pages: int = 0,
                 read_page: Callable[[int], list[np.ndarray]] | None = None,
                 write_page: Callable[[int, list[np.ndarray]], None] | None = None, bounded_keep: int = 0,
                 snapshots: int = 0, take_state: Callable[[int], list[jax.Array]] | None = None,
                 exact_replay: int | None = None, prompt_logprobs: PromptLogprobStore | None = None):
        if isinstance(replay, bool) or not isinstance(replay, int) or replay < 0:
            raise ValueError(f"prefix replay must be a non-negative number of tokens, got {replay!r}")
        if isinstance(bounded_keep, bool) or not isinstance(bounded_keep, int) or bounded_keep < 0:
            raise ValueError(f"bounded_keep must be a non-negative number of tokens, got {bounded_keep!r}")
        self.pages, self.replay, self.bounded_keep = pages, replay, bounded_keep
        self.tree = PrefixCache(pages.layout.page_tokens)
        self.host = HostTier(host_pages)
        if host_pages and (read_page is None or write_page is None):
            raise ValueError("a host tier needs read_page and write_page")
        self.read_page, self.write_page = read_page, write_page
        self.snapshots = SnapshotStore(snapshots)
        if snapshots and take_state is None:
            raise ValueError("window-state snapshots need take_state")
        self.take_state, self.exact_replay = take_state, replay if exact_replay is None else exact_replay
        self.prompt_logprobs = prompt_logprobs  # a request asking for prompt logprobs takes them from here
        self.exact_from: dict[str, int] = {}  # request id -> first position at which its slot state is exact
        self.restores: dict[str, list[jax.Array]] = {}  # request id -> the snapshot its first chunk starts from
        self.snapshot_tokens = 0  # prompt tokens snapshots spared from prefill beyond what replay would have
        self.held: dict[str, PrefixMatch] = {}  # request id -> the locked path it uses
        self.inserts: list[Request] = []  # prefills dispatched this round: cached from the next one
        self.replayed_tokens = 0
        pages.reclaim = self.evict  # the pool evicts unlocked cached pages before it reports a shortage

    # ---- admission ---------------------------------------------------------------------------------------
    def admit(self, request: Request) -> None:
        """A request just given a fresh slot: adopt the pages of its prompt's cached prefix (restoring pages from
        the host tier where the tree ends) and start its prefill from the deepest usable window-state snapshot
        (`serving.prefix.window_snapshots`) or, without one, `replay` tokens before the hit's end.

        A snapshot at boundary b is usable when b is inside the cached prefix and before the prompt's last token
        and, with bounded replay, b <= P - keep for a prompt of P tokens: the snapshot's replay-layer rings were
        not computed for this prompt (the request that left it ran its replay layers only on its own last keep
        tokens), but a cold bounded prefill of this prompt hides every replay-layer key below P - keep anyway,
        and its P - b >= keep prefilled tokens overwrite those rings and the drafter's context ring. So a
        snapshot hit is as exact as the exact replay: the numbers of a cold run, up to float reassociation.

        A request asking for prompt logprobs copies those of its prefix's pages from the prompt-logprob store
        (`serving.prefix.prompt_logprobs`) and starts its prefill no later than they reach, so that it computes the rest."""
        prompt = request.prompt
        match = self.tree.match(prompt, record=False)
        self.tree.lock(match)  # restoring may evict: never this path
        restored = self._restore(prompt, match.tokens) if self.host.pages else []
        if restored:
            self.tree.unlock(match)
            taken = self.tree.insert(prompt[:match.tokens + len(restored) * self.tree.block_tokens],
                                     list(match.pages) + restored)
            for page in set(restored) - set(taken):
                self.pages.drop(page)
            match = self.tree.match(prompt, record=False)
            self.tree.lock(match)
        self.exact_from[request.request_id] = 0
        if not match.tokens:
            return
        self.held[request.request_id] = match
        self.pages.adopt(request.slot, list(match.pages))
        covered = None  # a prompt-logprob request: its entries the store holds (the prefill computes the rest)
        if request.prompt_logprobs is not None:
            covered = self.prompt_logprobs.fill(request) if self.prompt_logprobs is not None else 0
        last, start = self._bounds(prompt, match.tokens, covered)
        boundary, snapshot = self.snapshots.deepest(prompt, self.tree.block_tokens, min(match.tokens, last), start)
        if snapshot is not None:
            self.restores[request.request_id] = snapshot
            self.snapshot_tokens += boundary - start
        elif start:
            self.exact_from[request.request_id] = start + self.exact_replay
        request.computed = boundary

    def cached_tokens(self, prompt: list[int]) -> int:
        """Prompt tokens an admission now would not prefill: of the prefix this cache holds (the device tree and
        the host-tier blocks continuing it), up to its deepest usable snapshot, or less the replay (as `admit`
        does). Touches neither recency nor counters."""
        block = self.tree.block_tokens
        end = self.tree.match(prompt, record=False, use=False).tokens + block
        while end <= len(prompt) and tuple(prompt[:end]) in self.host.pages:
            end += block
        hit = end - block
        last, start = self._bounds(prompt, hit)
        return max((b for b, key in boundary_keys(prompt, block, min(hit, last))
                    if b > start and key in self.snapshots.entries), default=start)

    def _bounds(self, prompt: list[int], hit: int, covered: int | None = None) -> tuple[int, int]:
        """(the last position a prefill may start at, where it starts without a snapshot) for a hit of `hit`
        tokens: bounded replay's layers must see the prompt's last keep tokens. A prompt-logprob request whose
        first `covered` entries are known starts no later than that, and replays from exact state by then (its
        logits from there on are a cold prefill's)."""
        last = len(prompt) - self.bounded_keep if self.bounded_keep else len(prompt) - 1
        start = min(hit - self.replay, last)
        if covered is not None:
            last, start = min(last, covered), min(start, covered - self.exact_replay)
        return last, max(0, start)

    def restore(self, request: Request) -> list[jax.Array] | None:
        """The snapshot the request's first chunk starts from (installed in its slot before that chunk), or None
        when it prefills from the start or replays."""
        return self.restores.pop(request.request_id, None)

    def chunk_done(self, request: Request) -> None:
        """A prefill chunk of `request` was dispatched (its `computed` advanced): snapshot its slot state when the
        chunk ends on a page boundary and the state there is exact (not inside a replay's inexact stretch)."""
        end = request.computed
        if (not self.snapshots.capacity or end % self.tree.block_tokens
                or end < self.exact_from.get(request.request_id, end + 1)):
            return
        key = prefix_key(request.sequence[:end])
        if self.snapshots.get(key) is None:
            self.snapshots.put(key, self.take_state(request.slot))

    def confirm(self, request: Request) -> None:
        """The request's first chunk is scheduled: count its query in the hit-rate metrics, and its prompt
        tokens taken from the cache (`cached_tokens`: those its prefill skips)."""
        match = self.held.get(request.request_id)
        hit = match.tokens if match is not None else 0
        request.cached_tokens = request.computed
        self.tree.record(len(request.prompt), hit)
        self.replayed_tokens += hit - request.computed

    def _restore(self, prompt: list[int], cached: int) -> list[int]:
        """Pages for the host-tier blocks that continue a cached prefix of `cached` tokens, each written on the
        device (evicting unlocked cached pages for room); returns them, one reference each."""
        block, restored = self.tree.block_tokens, []
        end = cached + block
        while end <= len(prompt) and tuple(prompt[:end]) in self.host.pages:
            if not self.pages.free and not self.evict(1):
                break
            contents = self.host.take(tuple(prompt[:end]))
            page = self.pages.allocate()
            self.write_page(page, contents)
            restored.append(page)
            end += block
        return restored

    # ---- caching -----------------------------------------------------------------------------------------
    def prefilled(self, request: Request) -> None:
        """The request's last prefill chunk is being scheduled: cache its full pages once it is dispatched."""
        self.inserts.append(request)

    def flush(self) -> None:
        """Cache the full pages of prefills dispatched since the last call (requests still holding their slot):
        the tree takes a reference to each new page and the slot stops writing them."""
        for request in self.inserts:
            if request.slot is not None:
                self._insert(request, request.sequence, relock=True)
        self.inserts.clear()

    def finished(self, request: Request) -> None:
        """A request leaves its slot (finished or cancelled): cache the full pages of every token whose state its
        steps computed, and unlock what it held."""
        fed = request.computed if request.prefilling else max(request.computed,
                                                               len(request.prompt) + len(request.output) - 1)
        self._insert(request, (request.prompt + request.output)[:fed], relock=False)
        self.dropped(request)

    def dropped(self, request: Request) -> None:
        """The request gives up its slot without caching anything (preempted, or admission undone)."""
        self.exact_from.pop(request.request_id, None)
        self.restores.pop(request.request_id, None)
        self._unlock(request)

    def _unlock(self, request: Request) -> None:
        match = self.held.pop(request.request_id, None)
        if match is not None:
            self.tree.unlock(match)

    def _insert(self, request: Request, tokens: list[int], relock: bool) -> None:
        owned = self.pages.owned.get(request.slot, [])
        blocks = min(len(tokens) // self.tree.block_tokens, len(owned))
        tokens = tokens[:blocks * self.tree.block_tokens]
        for page in self.tree.insert(tokens, owned[:blocks]):
            self.pages.share(page)
        self.pages.freeze(request.slot, blocks)
        if relock and blocks:
            self._unlock(request)
            match = self.tree.match(tokens, record=False)
            self.tree.lock(match)
            self.held[request.request_id] = match

    # ---- memory ------------------------------------------------------------------------------------------
    def evict(self, pages: int) -> int:
        """Free up to `pages` pages by dropping unlocked cached blocks, least recently used first (a dropped
        block's page goes to the host tier when it has room); returns the pages freed."""
        freed = 0
        while freed < pages:
            blocks = self.tree.evict_blocks(pages - freed)
            if not blocks:
                break
            for prefix, page in blocks:
                self.snapshots.drop(prefix_key(prefix))
                if self.host.capacity and self.pages.refs[page] == 1:
                    self.host.put(prefix, self.read_page(page))
                freed += self.pages.drop(page)
        return freed

    def clear(self) -> None:
        """Drop every unlocked cached block and its snapshot (pages return to the pool; the host tier keeps what
        it holds)."""
        for prefix, page in self.tree.evict_blocks(self.tree.cached_blocks):
            self.snapshots.drop(prefix_key(prefix))
            self.pages.drop(page)

    def metrics(self) -> dict[str, float]:
        """The tree's counters (queries, tokens queried / matched, hit rate, blocks cached / evicted), tokens
        replayed to rebuild slot state, window-state snapshots (hits, tokens they spared from replay, held,
        their bytes, taken, dropped) and the host tier's pages held / stored / restored / dropped."""
        store = self.snapshots
        return {**self.tree.metrics(), "replayed_tokens": self.replayed_tokens, "snapshot_hits": store.hits,
                "snapshot_tokens": self.snapshot_tokens, "snapshots": len(store.entries),
                "snapshot_bytes": store.nbytes, "snapshots_taken": store.taken, "snapshots_dropped": store.dropped,
                "host_pages": len(self.host.pages), "host_stored": self.host.stored,
                "host_restored": self.host.restored, "host_dropped": self.host.dropped}


class DevicePages:
    """What prefix caching does on the engine's device cache, reached as `owner.cache` (the engine replaces it
    on every step): copy one page's paged leaves to or from numpy (host tier), copy a slot's per-slot state to
    or from a device snapshot, and start a slot's penalty statistics with the prompt tokens its prefill does not
    feed. Slots and pages are the scheduler's, found in the cache through `owner.placement` (a mesh engine
    stacks its ranks' caches). Each op is compiled once (`warmup`)."""

    def __init__(self, owner, max_len: int):
        self.owner, self.max_len = owner, max_len
        self._ops: dict[str, Callable] = {}

    def warmup(self) -> None:
        for name in ("read", "write", "mark", "take", "restore"):
            self._op(name)

    def read(self, page: int) -> list[np.ndarray]:
        """The page's rows of every paged leaf, in tree order (waits for the steps that wrote it)."""
        return [np.asarray(x) for x in self._run("read", self._page(page))]

    def write(self, page: int, contents: list[np.ndarray]) -> None:
        """Put `contents` (from `read`) into page `page`."""
        self.owner.cache = self._run("write", self._page(page), contents)

    def take(self, slot: int) -> list[jax.Array]:
        """A device copy of the slot's window state (`EngineCache.window_state`), taken after the steps dispatched
        so far."""
        return self._run("take", self._slot(slot))

    def restore(self, slot: int, state: list[jax.Array] | list[np.ndarray]) -> None:
        """Put a snapshot from `take` (or a partial hand-off's, on the host) into slot `slot`."""
        self.owner.cache = self._run("restore", self._slot(slot), state)

    def start_prompt(self, slot: int, tokens: list[int]) -> None:
        """Start the slot's penalty statistics of a request that prefills from mid-prompt (a prefix hit): its
        prompt mask holds `tokens`, its output counts are zero (the step resets only rows starting at 0)."""
        padded = np.zeros(self.max_len, np.int32)
        padded[:len(tokens)] = tokens
        self.owner.cache = self._run("mark", self._slot(slot), padded, np.int32(len(tokens)))

    def _run(self, name: str, *args):
        """Op `name` on the cache and `args`, placed whole on every device (a multi-process engine's processes
        each place their own devices' copies)."""
        op = self._op(name)
        return op(self.owner.cache, *put(args, op.input_shardings[0][1:]))

    def _slot(self, slot: int) -> np.int32:
        return np.int32(self.owner.placement.cache_slot(slot))

    def _page(self, page: int) -> np.int32:
        return self.owner.placement.cache_pages(np.array([page], np.int32))[0]

    def _op(self, name: str):
        if name not in self._ops:
            cache = self.owner.cache
            # an op's other arguments and what it reads out lie whole on every device of the cache's
            whole = jax.tree.leaves(cache)[0].sharding
            whole = NamedSharding(whole.mesh, P()) if isinstance(whole, NamedSharding) else whole
            spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=whole)  # noqa: E731
            scalar = jax.ShapeDtypeStruct((), np.int32, sharding=whole)
            paged = [spec(pool[0]) for pool in page_pools(cache.layers)]
            per_slot = [spec(leaf[0]) for leaf in cache.window_state()]
            # the cache keeps its placement (a mesh engine's is split over the ranks): the steps expect it
            placed = jax.tree.map(lambda x: x.sharding, cache)
            args = {"read": (scalar,), "write": (scalar, paged), "take": (scalar,), "restore": (scalar, per_slot),
                    "mark": (scalar, spec(np.zeros(self.max_len, np.int32)), scalar)}[name]
            fn = {"read": _read_page, "write": _write_page, "mark": _start_prompt, "take": _take_slot,
                  "restore": _restore_slot}[name]
            keeps = name in ("read", "take")
            jitted = jax.jit(fn, out_shardings=whole) if keeps else jax.jit(fn, donate_argnums=0, out_shardings=placed)
            shaped = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=x.sharding), cache)
            self._ops[name] = jitted.lower(shaped, *args).compile()
        return self._ops[name]


def _take_slot(cache: EngineCache, slot):
    return [leaf[slot] for leaf in cache.window_state()]


def _restore_slot(cache: EngineCache, slot, state):
    rows = iter(state)
    return cache.with_window_state(lambda leaf: leaf.at[slot].set(next(rows)))


def _read_page(cache: EngineCache, page):
    return [pool[page] for pool in page_pools(cache.layers)]


def _write_page(cache: EngineCache, page, contents):
    rows = iter(contents)
    def put(node: Paged) -> Paged:
        return jax.tree.map(lambda pool: pool.at[page].set(next(rows)), node)
    return cache.replace(layers=map_state(put, lambda leaf: leaf, cache.layers))


def _start_prompt(cache: EngineCache, slot, tokens, count):
    vocab = cache.prompt_mask.shape[1]
    ids = jnp.where(jnp.arange(tokens.shape[0]) < count, tokens, vocab)  # padding: dropped
    mask = jnp.zeros((vocab,), bool).at[ids].set(True, mode="drop")
    return cache.replace(prompt_mask=cache.prompt_mask.at[slot].set(mask),
                         output_counts=cache.output_counts.at[slot].set(0))
