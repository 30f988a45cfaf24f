"""Compressed entries and index keys as page pools read through each row's block table.

A layer's growing state (compressed entries, index keys) is declared as a `Paged`: one pool of pages all rows
share and each row's block table. Layers read it in place (by global slot, `global_slots`) and a step writes
only the windows it completes (`store_windows`), all rows at once, never inside a per-row `vmap` (a scatter
into an unbatched pool there would copy the pool per row). A dense reference cache (`Model.init_cache`) is the
special case of one n-entry page per row (`row_pages`), so both run one code path; the engine cache keeps each
pool alone (`Paged.unbound`) and binds the rows' tables every step (`Paged.bind`). Whatever treats paged state
apart (the engine's pools, the cache's logical axes, a hand-off, the host tier) tells it by this type.

Glossary: b rows, n windows a chunk touches, P pages in the pool, E entries a page, p pages in a row's table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PyTree

from model.pytree import pytree_dataclass, replace
from pallas_kernels.paged_attention import global_slots


@pytree_dataclass
@dataclasses.dataclass(frozen=True)
class Paged:
    """A page pool and the rows' pages: `table` lists each row's pages in order (row-local entry i lives at
    page table[i // E], offset i % E); a row's first `frozen` tokens are held in shared, read-only pages. Held
    in the engine cache, a pool has no rows yet (`table` and `frozen` None)."""

    pages: Float[Array, "P E d"]
    table: Int[Array, "b p"] | None = None
    frozen: Int[Array, " b"] | None = None

    def bind(self, table: Int[Array, "b p"], frozen: Int[Array, " b"]) -> Paged:
        """This pool read and written through the rows' block tables."""
        return replace(self, table=table, frozen=frozen)

    def unbound(self) -> Paged:
        """This pool without rows, as the engine cache holds it."""
        return replace(self, table=None, frozen=None)


def row_pages(leaf: Float[Array, "b n d"]) -> Paged:
    """A growing state leaf of b rows declared as a pool of one n-entry page per row (a dense cache)."""
    b = leaf.shape[0]
    return Paged(leaf, jnp.arange(b, dtype=jnp.int32)[:, None], jnp.zeros((b,), jnp.int32))


def is_paged(node) -> bool:
    return isinstance(node, Paged)


def map_state(on_pages: Callable, on_slots: Callable, state: PyTree, *others: PyTree) -> PyTree:
    """`state` (layer states) with every `Paged` mapped by `on_pages` and every other leaf by `on_slots`, each
    given the matching parts of `others` (trees of the same layout)."""
    return jax.tree.map(lambda node, *rest: on_pages(node, *rest) if is_paged(node) else on_slots(node, *rest),
                        state, *others, is_leaf=is_paged)


def page_pools(state: PyTree) -> list:
    """The page pools of layer states, in tree order."""
    return [node.pages for node in jax.tree.leaves(state, is_leaf=is_paged) if is_paged(node)]


def slot_leaves(state: PyTree) -> list:
    """Every leaf of layer states that is not paged (kept per row or per slot), in tree order."""
    return [node for node in jax.tree.leaves(state, is_leaf=is_paged) if not is_paged(node)]


def unbound(states: PyTree) -> PyTree:
    """Layer states with each `Paged` as the engine cache holds it, its pool alone."""
    return map_state(Paged.unbound, lambda leaf: leaf, states)


def store_windows(
    paged: Paged, values: Float[Array, "b n d"], start: Int[Array, "*b"], count: Int[Array, "*b"] | int, ratio: int
) -> Paged:
    """Write the values of windows start // ratio + i that the chunk's first `count` tokens complete, past each
    row's frozen tokens (a prefix-cache hit replaying them reads the cached entries and never writes them);
    incomplete windows are dropped. One batched scatter into the pool."""
    b, n, _ = values.shape
    start, count = jnp.broadcast_to(start, (b,)), jnp.broadcast_to(count, (b,))
    per_page = paged.pages.shape[1]
    ids = start[:, None] // ratio + jnp.arange(n)
    ends = (ids + 1) * ratio
    keep = (ends <= (start + count)[:, None]) & (ends > paged.frozen[:, None])
    keep &= ids < paged.table.shape[1] * per_page
    slots = global_slots(paged.table, jnp.where(keep, ids, -1)[:, None], per_page)[:, 0]
    page = jnp.where(keep, slots // per_page, paged.pages.shape[0])  # out of range: dropped
    pages = paged.pages.at[page, slots % per_page].set(values.astype(paged.pages.dtype), mode="drop")
    return replace(paged, pages=pages)


def per_row(fn, x: Float[Array, "b c D"], start, count, states: tuple):
    """`fn(x, start, *states, count=count) -> (value, *new_states)` where every row may have its own start
    and count ([b] arrays): then each row is one vmapped single-row call, the pools passed unbatched (only
    tables and frozen counts per row). `fn` never writes a pool: a `Paged` of its new states is its input's,
    put back by key. A scalar start is one call for the whole batch."""
    if jnp.ndim(start) == 0:
        return fn(x, start, *states, count=count)
    count = jnp.broadcast_to(count, start.shape)
    one = lambda node: node.bind(node.table[None], node.frozen[None]) if is_paged(node) else node[None]  # noqa: E731

    def one_row(x, start, count, *rows):
        out = fn(x[None], start, *jax.tree.map(one, rows, is_leaf=is_paged), count=count)
        out = jax.tree.map(lambda node: None if is_paged(node) else node, out, is_leaf=is_paged)
        return jax.tree.map(lambda leaf: leaf[0], out)

    axes = map_state(lambda node: replace(node, pages=None, table=0, frozen=0), lambda leaf: 0, states)
    value, *new = jax.vmap(one_row, in_axes=(0, 0, 0, *axes))(x, start, count, *states)
    return value, *[_put_back(out, given) for out, given in zip(new, states)]


def _put_back(out, given):
    """`out` (a state tree) with the pools of `given` where `per_row` took them out."""
    if out is None and is_paged(given):
        return given
    if isinstance(out, dict):
        return {k: _put_back(v, given.get(k) if isinstance(given, dict) else None) for k, v in out.items()}
    return out
