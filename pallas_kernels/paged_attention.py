"""Sparse sink attention, HCA attention and lightning-indexer scores that read the compressed entries from the
shared page pools in place, through each row's block table, as FlashMLA's sparse decode reads its paged cache:
the window keys come from the row's own ring, the compressed entries from `pages` [P, E, d] (E entries a page)
by global slot page * E + offset (`global_slots`; -1 = none). No row's pages are copied into a dense view.
References (`*_reference` below) gather the same keys by global slot (the indexer's reference scores the row's
pages side by side, `dense_view`). Top-k selection over the indexer scores stays `model.compressor.top_visible`
(XLA's stable `top_k`: ties go to the lower entry) for both implementations.

Glossary: b rows, c queries, h heads, d head dim, n window rows, k window ids, m picked entries, P pages in the
pool, E entries a page, p pages in a row's table (a context bucket), t = p * E entries a row can see.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import tuning
from pallas_kernels.sparse_attention import _attend, attend_keys

QUERY_BLOCK = 8  # indexer queries sharing one page read


def global_slots(table: Int[Array, "b p"], ids: Int[Array, "b c m"], per_page: int) -> Int[Array, "b c m"]:
    """The global slot (page * per_page + offset) of each row-local entry id through the row's block table;
    -1 (no entry) stays -1."""
    safe = jnp.maximum(ids, 0)
    page = jnp.take_along_axis(table, (safe // per_page).reshape(ids.shape[0], -1), axis=1).reshape(ids.shape)
    return jnp.where(ids >= 0, page * per_page + safe % per_page, -1)


def dense_view(pages: Float[Array, "P E d"], table: Int[Array, "b p"]) -> Float[Array, "b t d"]:
    """Each row's pages copied side by side (what the paged attention avoids)."""
    return pages[table].reshape(table.shape[0], -1, pages.shape[-1])


def paged_sink_attention_reference(
    q: Float[Array, "b c h d"], kv: Float[Array, "b n d"], ids: Int[Array, "b c k"], valid: Bool[Array, "b c k"],
    sink: Float[Array, " h"], pages: Float[Array, "P E d"], table: Int[Array, "b p"], picks: Int[Array, "b c m"],
) -> Float[Array, "b c h d"]:
    """Sink attention over the window keys (`ids` into the row's `kv`) and the picked compressed entries
    (`picks`: row-local entry ids, -1 none) of the row's pages."""
    slots = global_slots(table, picks, pages.shape[1])
    window = jnp.take_along_axis(kv[:, None], jnp.where(valid, ids, 0)[..., None], axis=2)  # [b, c, k, d]
    picked = pages.reshape(-1, pages.shape[-1])[jnp.maximum(slots, 0)].astype(kv.dtype)  # [b, c, m, d]
    return attend_keys(q, jnp.concatenate([window, picked], 2), jnp.concatenate([valid, slots >= 0], -1), sink)


def paged_sink_attention(
    q: Float[Array, "b c h d"], kv: Float[Array, "b n d"], ids: Int[Array, "b c k"], valid: Bool[Array, "b c k"],
    sink: Float[Array, " h"], pages: Float[Array, "P E d"], table: Int[Array, "b p"], picks: Int[Array, "b c m"],
) -> Float[Array, "b c h d"]:
    """Pallas form of `paged_sink_attention_reference`: the picks are read from the pages by global slot."""
    slots = global_slots(table, picks, pages.shape[1])
    return _attend(q, kv, jnp.where(valid, ids, -1), sink, pages.reshape(-1, pages.shape[-1]), slots)


def paged_hca_attention_reference(
    q: Float[Array, "b c h d"], kv: Float[Array, "b n d"], ids: Int[Array, "b c k"], valid: Bool[Array, "b c k"],
    sink: Float[Array, " h"], pages: Float[Array, "P E d"], table: Int[Array, "b p"], visible: Int[Array, " c"],
) -> Float[Array, "b c h d"]:
    """Sink attention over the window keys and each query's first `visible` compressed entries of the row's
    pages (every visible HCA entry)."""
    return paged_sink_attention_reference(q, kv, ids, valid, sink, pages, table, visible_ids(table, pages, ids,
                                                                                           visible))


def paged_hca_attention(
    q: Float[Array, "b c h d"], kv: Float[Array, "b n d"], ids: Int[Array, "b c k"], valid: Bool[Array, "b c k"],
    sink: Float[Array, " h"], pages: Float[Array, "P E d"], table: Int[Array, "b p"], visible: Int[Array, " c"],
) -> Float[Array, "b c h d"]:
    """Pallas form of `paged_hca_attention_reference`: the visible entries' global slots (built once, as vLLM
    builds its C128A slots per step) read from the pages."""
    return paged_sink_attention(q, kv, ids, valid, sink, pages, table, visible_ids(table, pages, ids, visible))


def visible_ids(table: Int[Array, "b p"], pages: Float[Array, "P E d"], ids: Int[Array, "b c k"],
                visible: Int[Array, " c"]) -> Int[Array, "b c t"]:
    """Row-local ids of each query's first `visible` entries of the table's p * E; -1 past them."""
    entries = jnp.arange(table.shape[1] * pages.shape[1])
    return jnp.broadcast_to(jnp.where(entries < visible[:, None], entries, -1), (*ids.shape[:2], entries.shape[0]))


def paged_index_scores_reference(
    q: Float[Array, "b c h d"], pages: Float[Array, "P E d"], table: Int[Array, "b p"],
    head_weights: Float[Array, "b c h"], visible: Int[Array, " c"],
) -> Float[Array, "b c t"]:
    """Lightning-indexer scores of the row's index keys (its pages, in table order), sum over heads of
    w_h * h^-1/2 * d^-1/2 * ReLU(q_h . k); -inf past each query's `visible`."""
    keys = dense_view(pages, table)
    per_head = jax.nn.relu(jnp.einsum("bchd,btd->bcht", q, keys)) * q.shape[-1] ** -0.5
    scores = jnp.einsum("bcht,bch->bct", per_head, head_weights * q.shape[-2] ** -0.5)
    return jnp.where(jnp.arange(keys.shape[1]) < visible[:, None], scores, -jnp.inf)


def paged_index_scores(
    q: Float[Array, "b c h d"], pages: Float[Array, "P E d"], table: Int[Array, "b p"],
    head_weights: Float[Array, "b c h"], visible: Int[Array, " c"],
) -> Float[Array, "b c t"]:
    """Pallas form of `paged_index_scores_reference`: one program per (row, query block, table page), which
    reads that page of the pool (pages no query of the block sees are not read: -inf)."""
    b, c, h, d = q.shape
    per_page, p = pages.shape[1], table.shape[1]
    if per_page * p == 0:  # no entry fits the row (a sequence shorter than one window): nothing to score
        return jnp.zeros((b, c, 0), jnp.float32)
    tq = tuning.fit(QUERY_BLOCK, c)
    kernel = functools.partial(_index_kernel, queries=tq, per_page=per_page, scale=d ** -0.5 * h ** -0.5)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((b, c, p * per_page), jnp.float32), grid=(b, c // tq, p),
        in_specs=[pl.BlockSpec((None, tq, h, d), lambda i, j, k: (i, j, 0, 0)),
                  pl.BlockSpec(pages.shape, lambda i, j, k: (0, 0, 0)),
                  pl.BlockSpec((None, p), lambda i, j, k: (i, 0)),
                  pl.BlockSpec((None, tq, h), lambda i, j, k: (i, j, 0)),
                  pl.BlockSpec((tq,), lambda i, j, k: (j,))],
        out_specs=pl.BlockSpec((None, tq, per_page), lambda i, j, k: (i, j, k)),
        name="paged_index_scores", **tuning.call_options(),
    )(q, pages, table.astype(jnp.int32), head_weights.astype(jnp.float32), visible.astype(jnp.int32))


def _index_kernel(q_ref, pages_ref, table_ref, w_ref, vis_ref, o_ref, *, queries: int, per_page: int,
                  scale: float):
    """Scores of `queries` queries against table page `program_id(2)`, read from the pool at its page id."""
    k = pl.program_id(2)
    cols = k * per_page + jax.lax.broadcasted_iota(jnp.int32, (per_page,), 0)
    visible = vis_ref[...]

    @pl.when(k * per_page < jnp.max(visible))
    def _():
        keys = pages_ref[table_ref[k]]
        for i in range(queries):
            s = jax.lax.dot_general(q_ref[i], keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            score = jnp.sum(jax.nn.relu(s) * w_ref[i][:, None], axis=0) * scale
            o_ref[i] = jnp.where(cols < vis_ref[i], score, -jnp.inf)  # a ref load: Triton has no value slice

    @pl.when(k * per_page >= jnp.max(visible))
    def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, o_ref.dtype)


OPS = {"paged_sink_attention": (paged_sink_attention_reference, paged_sink_attention),
       "paged_hca_attention": (paged_hca_attention_reference, paged_hca_attention),
       "paged_index_scores": (paged_index_scores_reference, paged_index_scores)}
