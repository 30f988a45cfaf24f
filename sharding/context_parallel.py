"""Balanced ("zigzag", DeepInfer's mirror) context parallelism for long prefill.

A sequence is cut into 2·cp chunks and rank r takes chunks r and 2·cp−1−r: an early and a late chunk, so
every rank holds the same causal attention work (a query at position p sees p+1 keys). Each rank attends
for its own queries against the whole sequence's keys, which are gathered across `cp`.

`context_parallel(mesh)` runs the model's attention cores (`CORES` of the kernel registry) traced inside it
this way: the queries and their key lists are permuted into rank order and split over `cp`
(`zigzag_attention`), the window key pool is gathered over `cp` (the page pools are read whole), and the
output is permuted back to sequence order; projections, compressors and experts stay sequence-sharded. It
serves whole-sequence prefills (`sharding.mesh.logits_on_mesh`), whose length must divide by 2·cp.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.sparse_attention import sink_attention_reference as sink_attention
from model import registry

BATCH = ("dp", "ep")  # the mesh axes requests are split over (sharding.mesh.RULES["batch"])
# each core's arguments after (q, pool, ids, valid, sink): per-query arrays [c] (QUERY) or [b, c, m] (QUERIES),
# a page pool every rank reads whole (POOL), per-row block tables (ROW)
QUERY, QUERIES, POOL, ROW = "query", "queries", "pool", "row"
CORES = {"sink_attention": (), "paged_sink_attention": (POOL, ROW, QUERIES),
         "paged_hca_attention": (POOL, ROW, QUERY)}


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


def zigzag_attention(mesh: Mesh, core: Callable, kinds: tuple[str, ...] = ()) -> Callable:
    """`core(q, pool, ids, valid, sink, *rest)` (an attention core: queries [b, c, h, d], key pool [b, n, d],
    per-query key ids and validity [b, c, k]; `rest` of `kinds`, see `CORES`) with the queries split zigzag
    over `mesh`'s `cp` axis and the pool gathered over it. Inputs and output are in sequence order; the batch
    is split over the attention ranks."""
    cp = mesh.shape["cp"]
    rows = P(BATCH, "cp")
    specs = {QUERY: P("cp"), QUERIES: rows, POOL: P(), ROW: P(BATCH)}

    def run(q: Float[Array, "b c h d"], pool: Float[Array, "b n d"], ids: Int[Array, "b c k"],
            valid: Bool[Array, "b c k"], sink: Float[Array, " h"], *rest) -> Float[Array, "b c h d"]:
        order = zigzag_order(q.shape[1], cp)
        axis = {QUERY: 0, QUERIES: 1}
        rest = [jnp.take(a, order, axis=axis[kind]) if kind in axis else a for a, kind in zip(rest, kinds)]
        split = functools.partial(jnp.take, indices=order, axis=1)
        out = jax.shard_map(core, mesh=mesh, out_specs=rows,
                            in_specs=(rows, P(BATCH), rows, rows, P(), *[specs[kind] for kind in kinds]))(
            split(q), pool, split(ids), split(valid), sink, *rest)
        return jnp.take(out, np.argsort(order), axis=1)

    return run


@contextlib.contextmanager
def context_parallel(mesh: Mesh):
    """Run the attention cores traced inside this block with zigzag context parallelism over `mesh`'s `cp`."""
    with contextlib.ExitStack() as stack:
        for name, kinds in CORES.items():
            stack.enter_context(registry.wrap(name, lambda core, kinds=kinds: zigzag_attention(mesh, core, kinds)))
        yield


def cp_attention(
    mesh: Mesh, q: Float[Array, "b s h d"], kv: Float[Array, "b s d"], sink: Float[Array, " h"],
    window: int | None,
) -> Float[Array, "b s h d"]:
    """Causal shared-KV attention of a whole sequence (over the last `window` tokens, or every earlier one)
    with its queries split zigzag over `mesh`'s `cp` axis: equal to the single-device computation."""
    b, s = q.shape[:2]
    ids, valid = attention_ids(jnp.arange(s), s, window)
    return zigzag_attention(mesh, sink_attention)(q, kv, jnp.broadcast_to(ids, (b, *ids.shape)),
                                                  jnp.broadcast_to(valid, (b, *valid.shape)), sink)
