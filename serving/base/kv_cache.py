"""The engine's device cache: per-slot state plus paged compressed entries, and the host page allocator.

Per request slot (leading axis; the last slot is scratch for padding rows): every layer's window ring
(window + max backtracking slots), compressor open-window buffers, V4.1 Engram-free group buffers, the
last sampled token and the token statistics the penalties need. Compressed entries and indexer keys live
in fixed-size pages shared by all slots and addressed by each slot's block table; one page holds
`page_tokens` tokens' worth of entries in every compressed layer (page_tokens / ratio entries), so page
boundaries are aligned with every compression ratio and one block table serves all layers. Pages are
reference counted, so slots and the prefix cache (`serving.prefix.prefix_admission`) can share them; a step reads
the pages in place and writes only the entries it completes, never a slot's shared pages (`model.paged`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree

from model.axes import batch_axes
from model.paged import Paged, map_state, page_pools, slot_leaves
from model.pytree import pytree_dataclass, replace


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Sizes of the engine cache: slots, pages, ring slots and the longest sequence a slot may hold."""

    max_slots: int
    max_len: int
    num_pages: int
    page_tokens: int
    ring: int  # window ring slots per layer: sliding_window + max backtracking
    vocab_size: int

    @property
    def pages_per_slot(self) -> int:
        return -(-self.max_len // self.page_tokens)

    @property
    def scratch_slot(self) -> int:
        return self.max_slots

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    @classmethod
    def for_model(cls, config, max_slots: int, max_len: int, num_pages: int | None = None,
                  page_tokens: int | None = None, backtrack: int = 0) -> CacheLayout:
        """A layout whose page size is a multiple of every compression ratio (default: enough pages for
        every slot to reach `max_len`)."""
        ratios = [r for r in config.compress_ratios if r] or [1]
        unit = math.lcm(*ratios)
        page_tokens = page_tokens or unit * max(1, 64 // unit)
        if page_tokens % unit:
            raise ValueError(f"page_tokens={page_tokens} must be a multiple of every compression ratio ({unit})")
        if max_len > config.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds the model's {config.max_position_embeddings} positions")
        pages = num_pages if num_pages is not None else max_slots * -(-max_len // page_tokens)
        layout = cls(max_slots, max_len, pages, page_tokens, config.sliding_window + backtrack, config.vocab_size)
        if layout.pages_per_slot > pages:
            raise ValueError(f"a pool of {pages} pages of {page_tokens} tokens cannot hold even one request of "
                             f"max_len={max_len} tokens")
        return layout


@pytree_dataclass
@dataclasses.dataclass(frozen=True)
class EngineCache:
    """The engine's device cache. Every entry but `layers` is per slot ([slots + 1, ...], the last slot scratch);
    `layers` holds each layer's state as the model declares it (`init_state`), its per-slot leaves with the slot
    axis and its growing leaves as page pools (`model.paged.Paged`, the pool alone). The drafter entries are
    None without a DSpark drafter."""

    layers: list
    last_token: Int[Array, " s"]
    next_pos: Int[Array, " s"]  # the position of `last_token`
    prompt_mask: Bool[Array, "s vocab"]
    output_counts: Int[Array, "s vocab"]
    drafter: list | None = None  # the DSpark drafter's context rings
    drafts: Int[Array, "s g"] | None = None  # its current drafted block, the distributions it was drawn from
    draft_probs: Float[Array, "s g vocab"] | None = None
    confidence: Float[Array, "s g"] | None = None

    def replace(self, **entries) -> EngineCache:
        return replace(self, **entries)

    def per_slot(self) -> dict[str, PyTree]:
        """Every entry the cache keeps slot by slot, by name (the layers and absent drafter entries left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "layers" and getattr(self, f.name) is not None}

    def window_state(self) -> list[jax.Array]:
        """What a window-state snapshot holds, in tree order: every per-slot layer leaf (window rings, compressor
        open windows) and the DSpark drafter's context rings, each with its slot axis."""
        return slot_leaves(self.layers) + jax.tree.leaves(self.drafter)

    def with_window_state(self, put: Callable[[jax.Array], jax.Array]) -> EngineCache:
        """The cache with `put` applied, in `window_state` order, to what a snapshot holds."""
        return self.replace(layers=map_state(lambda node: node, put, self.layers),
                            drafter=jax.tree.map(put, self.drafter))

    def axes(self) -> EngineCache:
        """Logical axes of every leaf (arrays or shapes): page pools lead with `pages`, every other leaf with its
        slot (`batch`), so the rules split both over the attention ranks."""
        pool = lambda leaf: ("pages",) + (None,) * (len(leaf.shape) - 1)  # noqa: E731
        return jax.tree.map(batch_axes, self.replace(layers=None)).replace(
            layers=map_state(lambda node: jax.tree.map(pool, node), batch_axes, self.layers))


def page_bytes(module, page_tokens: int) -> int:
    """Bytes one page holds over every layer's paged leaves (compressed entries and index keys) of a model module."""
    shapes = jax.eval_shape(lambda: module.init_cache(1, page_tokens)["layers"])
    return sum(math.prod(pool.shape) * pool.dtype.itemsize for pool in page_pools(shapes))


def init_engine_cache(module, layout: CacheLayout, drafter=None) -> EngineCache:
    """The empty device cache of `layout` for a model module (DeepseekV4 or DeepseekV41), with a DSpark drafter
    module's entries (`model.dspark.DSparkDrafter`) when given."""
    span, slots = layout.pages_per_slot * layout.page_tokens, layout.max_slots + 1

    def pool(node: Paged) -> Paged:  # [slots, entries, d] -> [pages + 1, entries per page, d]
        dense = node.pages
        shape = (layout.num_pages + 1, *dense.shape[1:-2], dense.shape[-2] * layout.page_tokens // span,
                 dense.shape[-1])
        return Paged(jnp.zeros(shape, dense.dtype))

    layers = map_state(pool, lambda leaf: leaf, module.init_cache(slots, span, layout.ring)["layers"])
    cache = EngineCache(layers, last_token=jnp.zeros((slots,), jnp.int32), next_pos=jnp.zeros((slots,), jnp.int32),
                        prompt_mask=jnp.zeros((slots, layout.vocab_size), bool),
                        output_counts=jnp.zeros((slots, layout.vocab_size), jnp.int32))
    if drafter is None:
        return cache
    g = drafter.config.block_size
    return cache.replace(drafter=drafter.init_state(slots), drafts=jnp.zeros((slots, g), jnp.int32),
                         draft_probs=jnp.zeros((slots, g, layout.vocab_size), jnp.float32),
                         confidence=jnp.zeros((slots, g), jnp.float32))


def drafter_ring(cache: EngineCache) -> int:
    """Positions in each slot's drafter context ring of the engine `cache` (its widest [slots, ring, d] leaf;
    0 without a drafter)."""
    return max((leaf.shape[1] for leaf in jax.tree.leaves(cache.drafter) if leaf.ndim == 3), default=0)


def gather_slots(tree: PyTree, slots: Int[Array, " r"], empty: PyTree, reset) -> PyTree:
    """Rows `slots` of per-slot state leaves; rows flagged in `reset` start from the one-sequence `empty` state."""

    def one(leaf, empty_leaf):
        rows = leaf[slots]
        return jnp.where(reset.reshape((-1,) + (1,) * (rows.ndim - 1)), empty_leaf, rows)

    return jax.tree.map(one, tree, empty)


def layer_rows(layers: list, slots: Int[Array, " r"], tables: Int[Array, "r p"], frozen: Int[Array, " r"],
               empty: list, reset) -> list:
    """The layer states a step runs the model on, from the engine cache's `layers`: the per-slot leaves of
    `slots` (rows flagged in `reset` start from the one-sequence empty state `empty`, a fresh request in a
    reused slot), materialised before use so the slot buffers are no longer read when they are updated in
    place; and every page pool bound to the rows' block tables `tables` (the step's context bucket), read and
    written in place, with `frozen` tokens per row held in shared, read-only pages. Stale entries of reused
    pages are never visible: pools need no reset."""
    rows = jax.lax.optimization_barrier(map_state(
        lambda node, _: None, lambda leaf, empty_leaf: gather_slots(leaf, slots, empty_leaf, reset), layers, empty))
    return map_state(lambda node, _: node.bind(tables, frozen), lambda leaf, row: row, layers, rows)


def put_rows(layers: list, slots: Int[Array, " r"], new: list) -> list:
    """The engine cache's `layers` with the model's new layer states of `layer_rows(layers, slots, ...)`:
    per-slot leaves by slot, the page pools (written in place) as they are."""
    return map_state(lambda node, new_node: new_node.unbound(), lambda leaf, row: leaf.at[slots].set(row), layers, new)


class PageAllocator:
    """Host bookkeeping of the page pool: free pages, each page's reference count, and each slot's pages in
    block-table order. A page is referenced by every slot whose table lists it and by the prefix cache while
    it caches it; it returns to the pool when the last reference goes. A slot's first `frozen[slot]` pages are
    shared (adopted from the prefix cache, or handed to it): read-only for the slot's steps."""

    def __init__(self, layout: CacheLayout):
        self.layout = layout
        self.free = list(range(layout.num_pages - 1, -1, -1))
        self.refs = [0] * layout.num_pages
        self.owned: dict[int, list[int]] = {}
        self.frozen: dict[int, int] = {}
        self.reclaim: Callable[[int], int] | None = None  # frees up to n pages held by a cache (prefix cache)

    def pages_needed(self, slot: int, tokens: int) -> int:
        """Additional pages slot `slot` needs to hold `tokens` tokens."""
        return max(0, -(-tokens // self.layout.page_tokens) - len(self.owned.get(slot, [])))

    def grow(self, slot: int, tokens: int) -> list[int] | None:
        """Give `slot` pages for `tokens` tokens (reclaiming cached pages if the pool is short); returns the new
        pages, or None (nothing taken) if the pool is still short."""
        if tokens > self.layout.max_len:
            raise ValueError(f"{tokens} tokens exceed the cache's max_len={self.layout.max_len}")
        need, free = self.pages_needed(slot, tokens), self.free_pages(slot)
        if need > len(free):
            self.reclaim_for(slot, need - len(free))
        if need > len(free):
            return None
        new = [self.allocate(free) for _ in range(need)]
        self.owned.setdefault(slot, []).extend(new)
        return new

    def reclaim_for(self, slot: int, pages: int) -> None:
        """Ask the cache holding pages `slot` may take (`reclaim`) to free up to `pages` of them."""
        if self.reclaim is not None:
            self.reclaim(pages)

    def free_pages(self, slot: int) -> list[int]:
        """The free list `slot` takes pages from: the one pool (`serving.core.engine_dp` keeps one per rank)."""
        return self.free

    def home(self, page: int) -> list[int]:
        """The free list a freed `page` returns to."""
        return self.free

    def allocate(self, free: list[int] | None = None) -> int:
        """A page of `free` (default: the pool) with one reference, held by the caller (it must not be empty)."""
        page = (self.free if free is None else free).pop()
        self.refs[page] = 1
        return page

    def adopt(self, slot: int, pages: list[int]) -> None:
        """Start an empty slot's table with shared `pages` (a prefix-cache hit): a reference each, read-only."""
        if self.owned.get(slot):
            raise ValueError(f"slot {slot} already holds pages; shared pages must come first")
        for page in pages:
            self.share(page)
        self.owned[slot] = list(pages)
        self.frozen[slot] = len(pages)

    def share(self, page: int) -> None:
        """One more reference to a page in use."""
        if self.refs[page] <= 0:
            raise ValueError(f"page {page} is free; only a page in use can be shared")
        self.refs[page] += 1

    def drop(self, page: int) -> bool:
        """Remove one reference; True if that freed the page."""
        if self.refs[page] <= 0:
            raise ValueError(f"page {page} has no reference to drop")
        self.refs[page] -= 1
        if self.refs[page]:
            return False
        self.home(page).append(page)
        return True

    def freeze(self, slot: int, pages: int) -> None:
        """Mark the slot's first `pages` pages read-only (they were handed to the prefix cache)."""
        self.frozen[slot] = max(self.frozen.get(slot, 0), min(pages, len(self.owned.get(slot, []))))

    def frozen_tokens(self, slot: int) -> int:
        """Tokens at the slot's start whose pages are shared (its steps never write them)."""
        return self.frozen.get(slot, 0) * self.layout.page_tokens

    def release(self, slot: int) -> None:
        """Drop the slot's reference to each of its pages (unshared ones return to the pool)."""
        for page in reversed(self.owned.pop(slot, [])):
            self.drop(page)
        self.frozen.pop(slot, None)

    def held(self, slot: int) -> int:
        """Pages in the slot's table (what its steps may read)."""
        return len(self.owned.get(slot, []))

    def idle(self) -> int:
        """Pages no slot holds: free, or held only by a cache that gives them back on demand."""
        return self.layout.num_pages - len({page for pages in self.owned.values() for page in pages})

    def table(self, slot: int) -> list[int]:
        """The slot's block-table row (scratch page past its pages)."""
        pages = self.owned.get(slot, [])
        return pages + [self.layout.scratch_page] * (self.layout.pages_per_slot - len(pages))
