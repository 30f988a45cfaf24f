"""Sparse sink attention: each query reads only its own key rows (window ids, and through `_attend`'s shared
pool the paged kernels' compressed entries); one online softmax per query with the head's sink in the
denominator. Reference: `sink_attention_reference` below.

Glossary: b rows, c queries per row, h heads, d head dim (K = V), n pool rows, k key ids per query.
Decode form (c <= DECODE_MAX_QUERIES): programs over (row, query, head block, key split); a long key list is
split (at least SPLIT_MIN_BLOCKS key blocks a split) and each split writes its normalised partial output
(in the query dtype) with its softmax max and sum, which a small combine merges, so few queries still fill
the device. Prefill form: one program per (row, query) with all heads, so each gathered key row is read once
for every head. Invalid ids (-1 or `valid` false) are never used: their rows read as zeros.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import tuning

SPLIT_MIN_BLOCKS = 4  # a split's partial output costs about as much traffic as this many key blocks


def sink_attention_reference(
    q: Float[Array, "b c h d"], pool: Float[Array, "b n d"], ids: Int[Array, "b c k"],
    valid: Bool[Array, "b c k"], sink: Float[Array, " h"],
) -> Float[Array, "b c h d"]:
    """softmax over the gathered keys plus a per-head sink logit (denominator only), weighted sum of values."""
    keys = jnp.take_along_axis(pool[:, None], jnp.where(valid, ids, 0)[..., None], axis=2)  # [b, c, k, d]
    return attend_keys(q, keys, valid, sink)


def attend_keys(
    q: Float[Array, "b c h d"], keys: Float[Array, "b c k d"], valid: Bool[Array, "b c k"], sink: Float[Array, " h"]
) -> Float[Array, "b c h d"]:
    """Each query's softmax over its own (gathered) keys, the invalid ones left out, plus the per-head sink
    logit in the denominator; K = V."""
    scores = jnp.einsum("bchd,bckd->bchk", q, keys).astype(jnp.float32) * q.shape[-1] ** -0.5
    scores = jnp.where(valid[:, :, None, :], scores, -jnp.inf)
    sink_logit = jnp.broadcast_to(sink[:, None], (*scores.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink_logit], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bchk,bckd->bchd", probs.astype(keys.dtype), keys)


def sink_attention(
    q: Float[Array, "b c h d"], pool: Float[Array, "b n d"], ids: Int[Array, "b c k"],
    valid: Bool[Array, "b c k"], sink: Float[Array, " h"],
) -> Float[Array, "b c h d"]:
    """Pallas form of `sink_attention_reference`: the keys are gathered rows of `pool`."""
    return _attend(q, pool, jnp.where(valid, ids, -1), sink)


def _attend(q, pool, ids, sink, extra=None, extra_ids=None):
    """The kernel call: keys `ids` of each row's `pool`, then (`extra` [N, d], one pool all rows share, e.g.
    flattened pages) its rows `extra_ids` [b, c, m] (-1: none); an empty shared pool or no shared ids (nothing
    compressed yet) is no shared pool."""
    if extra is not None and (extra.shape[0] == 0 or extra_ids.shape[-1] == 0):
        extra = extra_ids = None
    b, c, h, d = q.shape
    t = tuning.tiles()
    decode = c <= tuning.DECODE_MAX_QUERIES
    bk = t.attn_block_k
    pad = lambda x: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, 0), (0, -x.shape[-1] % bk)),  # noqa: E731
                            constant_values=-1)
    ids = pad(ids)
    extra_ids = None if extra is None else pad(extra_ids)
    blocks = ids.shape[-1] // bk + (0 if extra is None else extra_ids.shape[-1] // bk)
    splits = max(1, min(t.attn_decode_splits, blocks // SPLIT_MIN_BLOCKS)) if decode else 1
    hb = tuning.fit(t.attn_decode_heads, h) if decode else h
    grid = (b, c, h // hb, splits)
    kernel = functools.partial(_kernel, block_k=bk, splits=splits, has_extra=extra is not None, scale=d ** -0.5)
    in_specs = [
        pl.BlockSpec((None, None, hb, d), lambda i, j, g, s: (i, j, g, 0)),
        pl.BlockSpec((None, pool.shape[1], d), lambda i, j, g, s: (i, 0, 0)),
        pl.BlockSpec((None, None, ids.shape[-1]), lambda i, j, g, s: (i, j, 0)),
        pl.BlockSpec((hb,), lambda i, j, g, s: (g,)),
    ]
    operands = [q, pool, ids, sink.astype(jnp.float32)]
    if extra is not None:
        in_specs += [pl.BlockSpec(extra.shape, lambda i, j, g, s: (0, 0)),
                     pl.BlockSpec((None, None, extra_ids.shape[-1]), lambda i, j, g, s: (i, j, 0))]
        operands += [extra, extra_ids]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = pl.BlockSpec((None, None, hb, d), lambda i, j, g, s: (i, j, g, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((b, c, splits, h, d), q.dtype),
                     jax.ShapeDtypeStruct((b, c, splits, h), jnp.float32),
                     jax.ShapeDtypeStruct((b, c, splits, h), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, hb, d), lambda i, j, g, s: (i, j, s, g, 0)),
                     pl.BlockSpec((None, None, None, hb), lambda i, j, g, s: (i, j, s, g)),
                     pl.BlockSpec((None, None, None, hb), lambda i, j, g, s: (i, j, s, g)))
    out = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                         name="sparse_sink_attention", **tuning.call_options())(*operands)
    if splits == 1:
        return out
    part, m, l = out
    top = jnp.max(m, axis=2)  # >= sink: every split starts its running max there
    w = jnp.exp(m - top[:, :, None]) * l  # each split's share of the softmax mass
    den = jnp.exp(sink.astype(jnp.float32) - top) + jnp.sum(w, axis=2)
    return (jnp.sum(w[..., None] * part.astype(jnp.float32), axis=2) / den[..., None]).astype(q.dtype)


def _kernel(q_ref, pool_ref, ids_ref, sink_ref, *refs, block_k: int, splits: int, has_extra: bool, scale: float):
    """One (row, query, head block, split): online softmax over its share of key blocks (the row's pool, then
    the shared `extra` pool)."""
    extra_ref, extra_ids_ref = refs[:2] if has_extra else (None, None)
    out_refs = refs[2:] if has_extra else refs
    q = q_ref[...]
    sink = sink_ref[...]
    split = pl.program_id(3)

    def attend(carry, rows, ok, source=pool_ref):
        m, l, acc = carry
        keys = source[jnp.where(ok, rows, 0), :].astype(q.dtype)  # a page pool may be wider (fp32 pages)
        keys = jnp.where(ok[:, None], keys, jnp.zeros_like(keys))
        s = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        s = jnp.where(ok[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        pv = jnp.dot(p.astype(keys.dtype), keys, preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    def gathered(i, carry):
        rows = ids_ref[pl.ds((split + i * splits) * block_k, block_k)]
        return attend(carry, rows, rows >= 0)

    carry = (sink, jnp.zeros_like(sink), jnp.zeros(q.shape, jnp.float32))
    n_blocks = ids_ref.shape[0] // block_k
    carry = jax.lax.fori_loop(0, (n_blocks - split + splits - 1) // splits, gathered, carry)
    if has_extra:
        def shared(i, carry):
            rows = extra_ids_ref[pl.ds((split + i * splits) * block_k, block_k)]
            return attend(carry, rows, rows >= 0, extra_ref)

        extra_blocks = extra_ids_ref.shape[0] // block_k
        carry = jax.lax.fori_loop(0, (extra_blocks - split + splits - 1) // splits, shared, carry)
    m, l, acc = carry
    if splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = (acc / (l + jnp.exp(sink - m))[:, None]).astype(o_ref.dtype)
    else:
        part_ref, m_ref, l_ref = out_refs
        part_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(part_ref.dtype)
        m_ref[...], l_ref[...] = m, l


OPS = {"sink_attention": (sink_attention_reference, sink_attention)}
