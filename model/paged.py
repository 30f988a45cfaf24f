"""Compressed entries and index keys as page pools read through each row's block table.

A layer's growing state (`PAGED_LEAVES`: compressed entries, index keys) is a `Paged`: one pool of pages all
rows share and each row's block table. Layers read it in place (by global slot, `global_slots`) and a step
writes only the windows it completes (`store_windows`), all rows at once, never inside a per-row `vmap` (a
scatter into an unbatched pool there would copy the pool per row). A dense reference cache ([b, n, d] leaves,
`Model.init_cache`) is the special case of one n-entry page per row (`as_paged`), so both run one code path.

Glossary: b rows, n windows a chunk touches, P pages in the pool, E entries a page, p pages in a row's table.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_attention import global_slots

PAGED_LEAVES = ("entries", "index_keys")  # state leaves that grow with the sequence


class Paged(NamedTuple):
    """A page pool and the rows' pages: `table` lists each row's pages in order (row-local entry i lives at
    page table[i // E], offset i % E); a row's first `frozen` tokens are held in shared, read-only pages."""

    pages: Float[Array, "P E d"]
    table: Int[Array, "b p"]
    frozen: Int[Array, " b"]


def is_paged(node) -> bool:
    return isinstance(node, Paged)


def paged_path(path) -> bool:
    """Whether the leaf at a layer-state tree path grows with the sequence (kept in pages, `PAGED_LEAVES`)
    rather than per slot."""
    return getattr(path[-1], "key", None) in PAGED_LEAVES


def as_paged(states):
    """Layer states whose dense paged leaves [b, n, d] become pools of one n-entry page per row (leaves that
    are `Paged` already, the engine's, stay)."""

    def wrap(path, leaf):
        if is_paged(leaf) or not paged_path(path):
            return leaf
        b = leaf.shape[0]
        return Paged(leaf, jnp.arange(b, dtype=jnp.int32)[:, None], jnp.zeros((b,), jnp.int32))

    return jax.tree.map_with_path(wrap, states, is_leaf=is_paged)


def pools(states):
    """Layer states with each `Paged` replaced by its pool (a dense reference state's [b, n, d] leaf)."""
    return jax.tree.map(lambda node: node.pages if is_paged(node) else node, states, is_leaf=is_paged)


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
    return paged._replace(pages=pages)


def per_row(fn, x: Float[Array, "b c D"], start, count, states: tuple):
    """`fn(x, start, *states, count=count) -> (value, *new_states)` where every row may have its own start
    and count ([b] arrays): then each row is one vmapped single-row call, the pools passed unbatched (only
    tables and frozen counts per row). `fn` never writes a pool: a `Paged` of its new states is its input's,
    put back by key. A scalar start is one call for the whole batch."""
    if jnp.ndim(start) == 0:
        return fn(x, start, *states, count=count)
    count = jnp.broadcast_to(count, start.shape)
    one = lambda node: node._replace(table=node.table[None], frozen=node.frozen[None]) if is_paged(node) \
        else node[None]  # noqa: E731

    def one_row(x, start, count, *rows):
        out = fn(x[None], start, *jax.tree.map(one, rows, is_leaf=is_paged), count=count)
        out = jax.tree.map(lambda node: None if is_paged(node) else node, out, is_leaf=is_paged)
        return jax.tree.map(lambda leaf: leaf[0], out)

    axes = jax.tree.map(lambda node: Paged(None, 0, 0) if is_paged(node) else 0, states, is_leaf=is_paged)
    value, *new = jax.vmap(one_row, in_axes=(0, 0, 0, *axes))(x, start, count, *states)
    return value, *[_put_back(out, given) for out, given in zip(new, states)]


def _put_back(out, given):
    """`out` (a state tree) with the pools of `given` where `per_row` took them out."""
    if out is None and is_paged(given):
        return given
    if isinstance(out, dict):
        return {k: _put_back(v, given.get(k) if isinstance(given, dict) else None) for k, v in out.items()}
    return out
