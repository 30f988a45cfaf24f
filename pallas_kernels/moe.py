"""Routed experts as a grouped matmul over (token, expert) pairs sorted by expert.

Permute: pairs are sorted by expert and each expert's group is padded to whole tiles of `moe_block_m` rows,
so every tile belongs to one expert (its weights are chosen per tile, read once per tile and column block).
Grouped matmuls: gate / up projections with the clamped SwiGLU fused (rows gathered from the tokens inside
the kernel, so the permuted activations are never written), then the down projection scaled by each pair's
routing weight. Un-permute: each token sums its k rows. Empty tiles (past the last group) write zeros.
Reference: `routed_experts_reference` below (each pair through its expert's weights, gathered per pair); the
XLA:CPU forms are `xla_cpu.moe`'s.

Written here rather than taken from a library: tokamax is not a dependency (and the GPU check machine
cannot install it), and `lax.ragged_dot` needs the permuted activations materialised and leaves the SwiGLU
and the routing weight to separate passes.

Glossary: t tokens, k experts per token, P = t*k pairs, e experts, i intermediate, d hidden, M padded rows.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Float32, Int

from pallas_kernels import tuning


def clamped_swiglu(gate: Float[Array, "..."], up: Float[Array, "..."], limit: float) -> Float[Array, "..."]:
    """silu(min(gate, limit)) * clip(up, -limit, limit)."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def routed_experts_reference(
    x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"], w1: Float[Array, "e i d"],
    w2: Float[Array, "e d i"], w3: Float[Array, "e i d"], limit: float, pairs: int | None = None,
) -> Float32[Array, "t d"]:
    """Sum over each token's chosen experts of weight * w2 (silu(min(w1 x, limit)) * clip(w3 x, +-limit)), in
    fp32: each (token, expert) pair through its expert's weights, gathered per pair. `pairs` (how many pairs are
    real, the others weighing 0) changes nothing here; the fast forms size their tiles by it."""
    del pairs
    f32 = jnp.float32
    w1, w2, w3 = (w[ids].astype(f32) for w in (w1, w2, w3))  # each pair's expert [t, k, out, in]
    x = x.astype(f32)
    h = clamped_swiglu(jnp.einsum("td,tkid->tki", x, w1), jnp.einsum("td,tkid->tki", x, w3), limit)
    return jnp.einsum("tk,tkd->td", weights.astype(f32), jnp.einsum("tki,tkdi->tkd", h, w2))


def sort_pairs(ids: Int[Array, "t k"], n_exp: int, tile: int, valid: Bool[Array, "t k"] | None = None):
    """Permutation of the pairs into expert-aligned tiles: (row -> token or -1 [M], row -> pair or -1 [M],
    tile -> expert or -1 [n_tiles], pair -> row [t, k]). Pairs not `valid` take no row: their row is M."""
    t, k = ids.shape
    pairs = t * k
    flat = ids.reshape(-1) if valid is None else jnp.where(valid.reshape(-1), ids.reshape(-1), n_exp)
    order = jnp.argsort(flat, stable=True)  # pairs that are not valid sort last, as expert n_exp
    counts = jnp.bincount(flat, length=n_exp + 1)
    padded = ((counts + tile - 1) // tile * tile).at[n_exp].set(0)
    expert = flat[order]
    dest = (jnp.cumsum(padded) - padded)[expert] + jnp.arange(pairs) - (jnp.cumsum(counts) - counts)[expert]
    n_tiles = pairs // tile + min(n_exp, pairs)  # each non-empty group adds at most one partial tile
    dest = jnp.where(expert < n_exp, dest, n_tiles * tile)
    padded = padded[:n_exp]
    row_pair = jnp.full((n_tiles * tile,), -1, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
    tile_expert = jnp.searchsorted(jnp.cumsum(padded) // tile, jnp.arange(n_tiles), side="right")
    tile_expert = jnp.where(tile_expert < n_exp, tile_expert, -1).astype(jnp.int32)
    slot = jnp.zeros((pairs,), jnp.int32).at[order].set(dest.astype(jnp.int32)).reshape(t, k)
    return jnp.where(row_pair >= 0, row_pair // k, -1), row_pair, tile_expert, slot


def routed_experts(
    x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"],
    w1: Float[Array, "e i d"], w2: Float[Array, "e d i"], w3: Float[Array, "e i d"], limit: float,
    pairs: int | None = None,
) -> Float[Array, "t d"]:
    """Pallas form of `routed_experts_reference`. Its tiles are the tuning table's `moe_block_m` rows, whatever
    `pairs` expects; weight-0 pairs run (their output is weighted 0)."""
    t, k = ids.shape
    n_exp, inter, dim = w1.shape
    tiles = tuning.tiles()
    tm = tiles.moe_block_m
    rows, row_pair, tile_expert, slot = sort_pairs(ids, n_exp, tm)
    row_weight = jnp.where(row_pair >= 0, weights.reshape(-1)[row_pair], 0.0).astype(jnp.float32)
    h = _gate_up(x.astype(w1.dtype), rows, tile_expert, w1, w3, limit, tm, tiles)
    y = _down(h, tile_expert, row_weight, w2, tm, tiles)
    return unpermute(y, slot, tiles)


def _gate_up(x, rows, tile_expert, w1, w3, limit, tm, tiles):
    n_exp, inter, dim = w1.shape
    tn, tk = tuning.fit(tiles.moe_block_n, inter), tuning.fit(tiles.moe_block_k, dim)
    n_tiles = tile_expert.shape[0]
    kernel = functools.partial(_gate_up_kernel, block_n=tn, block_k=tk, limit=limit)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows.shape[0], inter), w1.dtype), grid=(n_tiles, inter // tn),
        in_specs=[pl.BlockSpec((tm,), lambda m, n: (m,)),
                  pl.BlockSpec((n_tiles,), lambda m, n: (0,)),
                  pl.BlockSpec(x.shape, lambda m, n: (0, 0)),
                  pl.BlockSpec(w1.shape, lambda m, n: (0, 0, 0)),
                  pl.BlockSpec(w3.shape, lambda m, n: (0, 0, 0))],
        out_specs=pl.BlockSpec((tm, tn), lambda m, n: (m, n)),
        name="moe_gate_up", **tuning.call_options(),
    )(rows, tile_expert, x, w1, w3)


def _gate_up_kernel(rows_ref, te_ref, x_ref, w1_ref, w3_ref, h_ref, *, block_n: int, block_k: int, limit: float):
    """One tile's rows gathered from the tokens, times one column block of its expert's w1 and w3; SwiGLU."""
    e = te_ref[pl.program_id(0)]
    n0 = pl.program_id(1) * block_n

    @pl.when(e >= 0)
    def _():
        rows = rows_ref[...]
        ok = rows >= 0
        safe = jnp.where(ok, rows, 0)

        def step(kb, acc):
            cols = pl.ds(kb * block_k, block_k)
            xs = jnp.where(ok[:, None], x_ref[safe, cols], jnp.zeros((), x_ref.dtype))
            gate = _dot_t(xs, w1_ref[e, pl.ds(n0, block_n), cols])
            up = _dot_t(xs, w3_ref[e, pl.ds(n0, block_n), cols])
            return acc[0] + gate, acc[1] + up

        zeros = jnp.zeros(h_ref.shape, jnp.float32)
        gate, up = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, (zeros, zeros))
        h_ref[...] = clamped_swiglu(gate, up, limit).astype(h_ref.dtype)

    @pl.when(e < 0)
    def _():
        h_ref[...] = jnp.zeros(h_ref.shape, h_ref.dtype)


def _down(h, tile_expert, row_weight, w2, tm, tiles):
    n_exp, dim, inter = w2.shape
    tn, tk = tuning.fit(tiles.moe_block_n, dim), tuning.fit(tiles.moe_block_k, inter)
    n_tiles = tile_expert.shape[0]
    kernel = functools.partial(_down_kernel, block_n=tn, block_k=tk)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((h.shape[0], dim), jnp.float32), grid=(n_tiles, dim // tn),
        in_specs=[pl.BlockSpec((tm, inter), lambda m, n: (m, 0)),
                  pl.BlockSpec((n_tiles,), lambda m, n: (0,)),
                  pl.BlockSpec((tm,), lambda m, n: (m,)),
                  pl.BlockSpec(w2.shape, lambda m, n: (0, 0, 0))],
        out_specs=pl.BlockSpec((tm, tn), lambda m, n: (m, n)),
        name="moe_down", **tuning.call_options(),
    )(h, tile_expert, row_weight, w2)


def _down_kernel(h_ref, te_ref, rw_ref, w2_ref, y_ref, *, block_n: int, block_k: int):
    """One tile's activations times one row block of its expert's w2, scaled by each pair's routing weight."""
    e = te_ref[pl.program_id(0)]
    n0 = pl.program_id(1) * block_n

    @pl.when(e >= 0)
    def _():
        def step(kb, acc):
            cols = pl.ds(kb * block_k, block_k)
            return acc + _dot_t(h_ref[:, cols], w2_ref[e, pl.ds(n0, block_n), cols])

        acc = jax.lax.fori_loop(0, h_ref.shape[1] // block_k, step, jnp.zeros(y_ref.shape, jnp.float32))
        y_ref[...] = acc * rw_ref[...][:, None]

    @pl.when(e < 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)


def unpermute(y, slot, tiles):
    """Each token's sum of its k rows of `y` (rows placed by `sort_pairs`' pair -> row map `slot`)."""
    t, k = slot.shape
    dim = y.shape[1]
    tt, tn = tiles.moe_block_m, tuning.fit(tiles.moe_block_n, dim)
    padded = pl.cdiv(t, tt) * tt
    slot_kt = jnp.pad(slot.T, ((0, 0), (0, padded - t)))  # padding tokens read row 0 and are sliced off
    out = pl.pallas_call(
        _unpermute_kernel, out_shape=jax.ShapeDtypeStruct((padded, dim), jnp.float32),
        grid=(padded // tt, dim // tn),
        in_specs=[pl.BlockSpec((k, tt), lambda i, n: (0, i)),
                  pl.BlockSpec((y.shape[0], tn), lambda i, n: (0, n))],
        out_specs=pl.BlockSpec((tt, tn), lambda i, n: (i, n)),
        name="moe_unpermute", **tuning.call_options(),
    )(slot_kt, y)
    return out[:t]


def _unpermute_kernel(slot_ref, y_ref, o_ref):
    """Each token's sum over its k sorted rows."""
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for j in range(slot_ref.shape[0]):
        acc = acc + y_ref[slot_ref[j], :]
    o_ref[...] = acc


def _dot_t(a, b):
    """a @ b.T with fp32 accumulation (weights stay in their stored [out, in] layout)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


OPS = {"routed_experts": (routed_experts_reference, routed_experts)}
