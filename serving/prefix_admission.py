"""Prefix caching in the engine: requests share the compressed-KV and index-key pages of a cached prompt prefix.

On admission a request matches its prompt in the radix tree (`serving.prefix_cache`, blocks = pages, aligned
with every compression ratio) and adopts the matched pages (a reference each, read-only). Everything else a
step needs is per slot and not cached: the window rings, the compressors' open windows, the DSpark drafter's
context ring and the Engram n-gram history. Those are rebuilt by prefilling from `replay` tokens before the end
of the hit instead of from the hit's end. The replayed tokens run through every layer, but their compressed
entries are not written again: the step marks the shared tokens `frozen` (`model.compressor.store_complete`
keeps their entries, which the queries read from the shared pages; `serving.kv_cache.scatter_rows` writes no
shared page).

Exact replay: a replayed token's first-layer output is exact once its whole window lies after the replay start;
each later layer's keys inherit the error of the one below, moving the exact region W - 1 tokens further right
per layer. So every per-slot ring (window + backtracking, compressor open windows: `ring` slots at most) is
exactly what a cold prefill leaves when replay >= ring + (L - 1)(W - 1) for L layers (and the drafter's context
ring of C positions, fed from the last layers' outputs, when replay >= C + L(W - 1)): `exact_replay_tokens`.
A hit then gives the same tokens as a cold run, up to float reassociation from the different chunking. A shorter
replay (at least the window ring) is the approximate variant vLLM and DeepInfer use: cheaper, not exact.

A request's full prompt pages enter the tree when its prefill has been dispatched (from the next scheduling
round on, so no step reads pages the same step writes); on finish, the full pages of its prompt and output. The
tree holds one reference per cached page; when the pool is short it evicts unlocked tree pages (least recently
used) before the scheduler preempts running requests. With a host tier, an evicted page's contents are copied to
host memory (up to `host_pages` pages, least recently used dropped first) and copied back on a later hit
instead of recomputed.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from serving.kv_cache import PAGED_LEAVES, PageAllocator
from serving.prefix_cache import PrefixCache, PrefixMatch
from serving.request import Request

RINGS = ("ring_kv", "recent_kv")  # per-slot leaves [b, slots, d] whose slots follow the newest positions


def exact_replay_tokens(config, cache: dict) -> int:
    """The replay after which every per-slot ring of the engine `cache` holds what a cold prefill leaves."""
    named = jax.tree_util.tree_flatten_with_path(cache["layers"])[0]
    ring = max(leaf.shape[1] for path, leaf in named if getattr(path[-1], "key", None) in RINGS)
    depth, window = config.num_hidden_layers, config.sliding_window
    tokens = ring + (depth - 1) * (window - 1)
    if "drafter" in cache:
        context = max(leaf.shape[1] for leaf in jax.tree.leaves(cache["drafter"]) if leaf.ndim == 3)
        tokens = max(tokens, context + depth * (window - 1))
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
        if not self.capacity:
            return
        self.pages[prefix] = contents
        self.pages.move_to_end(prefix)
        self.stored += 1
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)
            self.dropped += 1

    def take(self, prefix: tuple[int, ...]) -> list[np.ndarray] | None:
        """The contents of the page ending `prefix` (it leaves the tier: the device holds it again), or None."""
        contents = self.pages.pop(prefix, None)
        self.restored += contents is not None
        return contents


class PrefixAdmission:
    """The engine's prefix cache: the tree over the scheduler's page pool, what each running request holds of
    it, the replay length (`replay`, read at each admission) and the optional host tier (`read_page` /
    `write_page` copy one page's paged leaves between the device cache and numpy)."""

    def __init__(self, pages: PageAllocator, replay: int, host_pages: int = 0,
                 read_page: Callable[[int], list[np.ndarray]] | None = None,
                 write_page: Callable[[int, list[np.ndarray]], None] | None = None):
        if isinstance(replay, bool) or not isinstance(replay, int) or replay < 0:
            raise ValueError(f"prefix replay must be a non-negative number of tokens, got {replay!r}")
        self.pages, self.replay = pages, replay
        self.tree = PrefixCache(pages.layout.page_tokens)
        self.host = HostTier(host_pages)
        if host_pages and (read_page is None or write_page is None):
            raise ValueError("a host tier needs read_page and write_page")
        self.read_page, self.write_page = read_page, write_page
        self.held: dict[str, PrefixMatch] = {}  # request id -> the locked path it uses
        self.inserts: list[Request] = []  # prefills dispatched this round: cached from the next one
        self.replayed_tokens = 0
        pages.reclaim = self.evict  # the pool evicts unlocked cached pages before it reports a shortage

    # ---- admission ---------------------------------------------------------------------------------------
    def admit(self, request: Request) -> None:
        """A request just given a fresh slot: adopt the pages of its prompt's cached prefix (restoring pages from
        the host tier where the tree ends) and start its prefill `replay` tokens before the hit's end."""
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
        if not match.tokens:
            return
        self.held[request.request_id] = match
        self.pages.adopt(request.slot, list(match.pages))
        request.computed = max(0, match.tokens - self.replay)

    def confirm(self, request: Request) -> None:
        """The request's first chunk is scheduled: count its query in the hit-rate metrics."""
        match = self.held.get(request.request_id)
        hit = match.tokens if match is not None else 0
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
            self.dropped(request)
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
                if self.host.capacity and self.pages.refs[page] == 1:
                    self.host.put(prefix, self.read_page(page))
                freed += self.pages.drop(page)
        return freed

    def clear(self) -> None:
        """Drop every unlocked cached block (pages return to the pool; the host tier keeps what it holds)."""
        for page in self.tree.evict(self.tree.cached_blocks):
            self.pages.drop(page)

    def metrics(self) -> dict[str, float]:
        """The tree's counters (queries, tokens queried / matched, hit rate, blocks cached / evicted), tokens
        replayed to rebuild slot state, and the host tier's pages held / stored / restored / dropped."""
        return {**self.tree.metrics(), "replayed_tokens": self.replayed_tokens,
                "host_pages": len(self.host.pages), "host_stored": self.host.stored,
                "host_restored": self.host.restored, "host_dropped": self.host.dropped}


class DevicePages:
    """What prefix caching does on the engine's device cache, reached as `owner.cache` (the engine replaces it
    on every step): copy one page's paged leaves to or from numpy (host tier), and start a slot's penalty
    statistics with the prompt tokens the replay does not feed. Each op is compiled once (`warmup`)."""

    def __init__(self, owner, max_len: int):
        self.owner, self.max_len = owner, max_len
        self._ops: dict[str, Callable] = {}

    def warmup(self) -> None:
        for name in ("read", "write", "mark"):
            self._op(name)

    def read(self, page: int) -> list[np.ndarray]:
        """The page's rows of every paged leaf, in tree order (waits for the steps that wrote it)."""
        return [np.asarray(x) for x in self._op("read")(self.owner.cache, np.int32(page))]

    def write(self, page: int, contents: list[np.ndarray]) -> None:
        """Put `contents` (from `read`) into page `page`."""
        self.owner.cache = self._op("write")(self.owner.cache, np.int32(page), contents)

    def start_prompt(self, slot: int, tokens: list[int]) -> None:
        """Start the slot's penalty statistics of a request that prefills from mid-prompt (a prefix hit): its
        prompt mask holds `tokens`, its output counts are zero (the step resets only rows starting at 0)."""
        padded = np.zeros(self.max_len, np.int32)
        padded[:len(tokens)] = tokens
        self.owner.cache = self._op("mark")(self.owner.cache, np.int32(slot), padded, np.int32(len(tokens)))

    def _op(self, name: str):
        if name not in self._ops:
            cache = self.owner.cache
            spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)  # noqa: E731
            scalar = jax.ShapeDtypeStruct((), np.int32)
            paged = [spec(leaf[0]) for leaf in _paged_leaves(cache)]
            args = {"read": (scalar,), "write": (scalar, paged),
                    "mark": (scalar, jax.ShapeDtypeStruct((self.max_len,), np.int32), scalar)}[name]
            fn = {"read": _read_page, "write": _write_page, "mark": _start_prompt}[name]
            donate = () if name == "read" else (0,)
            self._ops[name] = jax.jit(fn, donate_argnums=donate).lower(jax.tree.map(spec, cache), *args).compile()
        return self._ops[name]


def _paged_leaves(cache: dict) -> list[jax.Array]:
    """The page pools of the cache's layers, in tree order."""
    named = jax.tree_util.tree_flatten_with_path(cache["layers"])[0]
    return [leaf for path, leaf in named if getattr(path[-1], "key", None) in PAGED_LEAVES]


def _read_page(cache: dict, page):
    return [leaf[page] for leaf in _paged_leaves(cache)]


def _write_page(cache: dict, page, contents):
    rows = iter(contents)
    layers = jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf.at[page].set(next(rows)) if getattr(path[-1], "key", None) in PAGED_LEAVES else leaf,
        cache["layers"])
    return {**cache, "layers": layers}


def _start_prompt(cache: dict, slot, tokens, count):
    vocab = cache["prompt_mask"].shape[1]
    ids = jnp.where(jnp.arange(tokens.shape[0]) < count, tokens, vocab)  # padding: dropped
    mask = jnp.zeros((vocab,), bool).at[ids].set(True, mode="drop")
    return {**cache, "prompt_mask": cache["prompt_mask"].at[slot].set(mask),
            "output_counts": cache["output_counts"].at[slot].set(0)}
