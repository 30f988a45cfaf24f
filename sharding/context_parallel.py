"""Balanced ("zigzag", DeepInfer's mirror) context parallelism for long prefill.

A sequence is cut into 2·cp chunks and rank r takes chunks r and 2·cp−1−r: an early and a late chunk, so
every rank holds the same causal attention work (a query at position p sees p+1 keys). Each rank projects
its own tokens' keys; one all-gather over `cp` gives every rank the whole sequence's keys (reordered to
sequence order by a fixed permutation), and each rank attends for its queries only.

`cp_attention` is the attention core of a prefill under this split: shared-KV multi-query attention with
per-head sinks over a causal sliding window (or every earlier token), the SWA core of `model.attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from model.attention import sink_attention


def zigzag_order(seq_len: int, cp: int) -> Int[np.ndarray, " s"]:
    """Sequence positions in rank order: rank r's chunk r then its chunk 2·cp−1−r, for r = 0..cp−1."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(f"a zigzag split needs the sequence ({seq_len} tokens) divisible by 2·cp = {2 * cp}")
    chunks = np.arange(seq_len).reshape(2 * cp, -1)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def causal_work_per_rank(seq_len: int, cp: int, zigzag: bool = True) -> Int[np.ndarray, " cp"]:
    """Query-key pairs of causal attention each rank computes (contiguous split when not `zigzag`)."""
    order = zigzag_order(seq_len, cp) if zigzag else np.arange(seq_len)
    return (order.reshape(cp, -1) + 1).sum(axis=1)


def attention_ids(positions: Int[Array, " c"], seq_len: int, window: int | None):
    """Key ids (sequence positions) and validity of causal attention for queries at `positions`: the last
    `window` tokens up to the query, or every earlier token when `window` is None."""
    span = seq_len if window is None else window
    ids = positions[:, None] - jnp.arange(span)[None, :]
    return jnp.maximum(ids, 0), ids >= 0


def cp_attention(
    mesh: Mesh, q: Float[Array, "b s h d"], kv: Float[Array, "b s d"], sink: Float[Array, " h"],
    window: int | None,
) -> Float[Array, "b s h d"]:
    """Attention of a whole sequence with its queries and keys split zigzag over `mesh`'s `cp` axis.

    Inputs and output are in sequence order; the split, the all-gather of keys and the permutations are
    internal, so the result equals the single-device computation."""
    cp, seq_len = mesh.shape["cp"], q.shape[1]
    order = zigzag_order(seq_len, cp)
    inverse = np.argsort(order)

    def local(q, kv, positions, sink):
        keys = jax.lax.all_gather(kv, "cp", axis=1, tiled=True)[:, inverse]  # whole sequence, in order
        ids, valid = attention_ids(positions, seq_len, window)
        b = q.shape[0]
        return sink_attention(q, keys, jnp.broadcast_to(ids, (b, *ids.shape)),
                              jnp.broadcast_to(valid, (b, *valid.shape)), sink)

    split = functools.partial(jnp.take, indices=order, axis=1)
    out = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "cp"), P(None, "cp"), P("cp"), P()),
                        out_specs=P(None, "cp"))(split(q), split(kv), jnp.asarray(order, jnp.int32), sink)
    return jnp.take(out, inverse, axis=1)
