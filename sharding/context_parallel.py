"""Balanced ("zigzag", DeepInfer's mirror) context parallelism for long prefill.

A sequence is cut into 2·cp chunks and rank r takes chunks r and 2·cp−1−r: an early and a late chunk, so
every rank holds the same causal attention work (a query at position p sees p+1 keys). Each rank attends
for its own queries against the whole sequence's keys, which are gathered across `cp`.

`context_parallel(mesh)` runs the model's attention cores (`CORES` of the kernel registry) traced inside it
this way: the queries and their key lists are permuted into rank order and split over `cp`
(`zigzag_attention`), the window key pool is gathered over `cp` (the page pools are read whole), and the
output is permuted back to sequence order; projections, compressors and experts stay sequence-sharded. It
serves whole-sequence prefills (`sharding.mesh.logits_on_mesh`), whose length must divide by 2·cp.

Inside a program that is already one rank's (the serving engine's `shard_map` step, `serving.core.engine_dp`),
`rank_context_parallel(cp)` does the same for each prefill chunk: every context rank computes the attention cores
and the indexer's scores (`RANK_SPLITS`) for its zigzag share of the chunk's queries, against keys every rank
holds, and the shares are gathered over `cp` (`split_queries`).
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


# the chunk axis of each argument of the ops a rank splits its queries for (None: read whole): an attention
# core's (q, pool, ids, valid, sink, *rest of `CORES`), the indexer's (q, pages, table, head weights, visible)
_CHUNK_AXIS = {QUERY: 0, QUERIES: 1}
RANK_SPLITS = {**{name: (1, None, 1, 1, None, *[_CHUNK_AXIS.get(kind) for kind in kinds])
                  for name, kinds in CORES.items()},
               "paged_index_scores": (1, None, None, 1, 0)}


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


def split_queries(core: Callable, axes: tuple[int | None, ...], cp: int) -> Callable:
    """`core` (an op of `RANK_SPLITS`, its arguments' chunk `axes`) inside a `shard_map` over a `cp` axis of
    `cp` ranks: each context rank computes it for its zigzag share of the chunk's queries (chunks r and
    2·cp−1−r of 2·cp), and the shares are gathered over `cp` in sequence order. A chunk that does not divide by
    2·cp is computed whole by every rank."""

    def run(*args):
        chunk = args[0].shape[1]
        if chunk % (2 * cp):
            return core(*args)
        order = zigzag_order(chunk, cp)
        mine = jnp.asarray(order.reshape(cp, -1))[jax.lax.axis_index("cp")]
        share = [a if axis is None else jnp.take(a, mine, axis=axis) for a, axis in zip(args, axes, strict=True)]
        gathered = jax.lax.all_gather(core(*share), "cp", axis=1, tiled=True)  # rank order
        return jnp.take(gathered, np.argsort(order), axis=1)

    return run


@contextlib.contextmanager
def rank_context_parallel(cp: int):
    """Trace the ops of `RANK_SPLITS` inside this block split over the `cp` context ranks of the `shard_map`
    they run in (`split_queries`)."""
    with contextlib.ExitStack() as stack:
        for name, axes in RANK_SPLITS.items():
            stack.enter_context(registry.wrap(name, lambda core, axes=axes: split_queries(core, axes, cp)))
        yield
