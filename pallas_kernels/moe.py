"""Routed experts as a grouped matmul over (token, expert) pairs sorted by expert.

Permute: pairs are sorted by expert and each expert's group is padded to whole tiles of `moe_block_m` rows,
so every tile belongs to one expert (its weights are chosen per tile, read once per tile and column block).
Grouped matmuls: gate / up projections with the clamped SwiGLU fused (rows gathered from the tokens inside
the kernel, so the permuted activations are never written), then the down projection scaled by each pair's
routing weight. Un-permute: each token sums its k rows. Empty tiles (past the last group) write zeros.
Reference: `routed_experts_reference` below (per-pair expert slices for decode, dense all-experts combine else).

Written here rather than taken from a library: tokamax is not a dependency (and the GPU check machine
cannot install it), and `lax.ragged_dot` needs the permuted activations materialised and leaves the SwiGLU
and the routing weight to separate passes.

Glossary: t tokens, k experts per token, P = t*k pairs, e experts, i intermediate, d hidden, M padded rows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Float32, Int

from pallas_kernels import tuning
from pallas_kernels.expert_views import ExpertViews
from pallas_kernels.quant_linear import dot_f32
from pallas_kernels.transposed_weights import TransposedWeight, logical


def clamped_swiglu(gate: Float[Array, "..."], up: Float[Array, "..."], limit: float) -> Float[Array, "..."]:
    """silu(min(gate, limit)) * clip(up, -limit, limit)."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def few_pairs(pairs: int, n_exp: int) -> bool:
    """Whether `routed_experts_reference` runs `pairs` (token, expert) pairs one by one, each reading only its
    expert's weights (fewer pairs than experts: decode of a token or two)."""
    return pairs < n_exp


VIEWED_BRANCHES = 128
"""The most (pairs x experts) switch branches `pair_by_pair` is given to compile per MoE layer: the `small` preset's
batch-1 decode has 16, a V4-Flash-sized one (6 of 256) would have 1,536, and keeps the stacked experts."""


DENSE_PAIRS_PER_EXPERT = 8
"""Up to this many (token, expert) pairs per expert, `routed_experts_reference` runs every token through every
expert: on XLA:CPU (small preset, decode shapes) that beats the sorted tiles up to 32 tokens x top-2 of 8."""
DENSE_FLOPS_RATIO = 4
"""... and only while that costs at most this many times the pairs' FLOPs (experts over experts per token): V4's
top-6 of 256, or an expert shard's received pairs (one expert each), take the sorted tiles."""


def routed_experts_reference(
    x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"],
    w1: Float[Array, "e i d"] | ExpertViews | TransposedWeight,
    w2: Float[Array, "e d i"] | ExpertViews | TransposedWeight,
    w3: Float[Array, "e i d"] | ExpertViews | TransposedWeight, limit: float, pairs: int | None = None,
) -> Float[Array, "t d"]:
    """Sum over each token's chosen experts of weight * expert(x), accumulated in fp32 (`dot_f32`).

    The stacks may be held transposed (`TransposedWeight`, `model.host_layout`): every form below contracts
    them in that layout. Given `ExpertViews` (the CPU engine's decode: `serving.layer_programs`), possibly of
    transposed stacks, each pair runs its expert through a
    switch over the experts' own arrays, read where they lie (`pair_by_pair`). Otherwise three forms by the
    number of pairs P = t*k (each pair's numbers are its expert's on its token either way).
    With fewer pairs than experts (decode of a token or two), each pair indexes its expert's weights and reads
    only those (XLA:CPU copies the slice once, where a gather of the pairs' expert weights ran at a tenth of the
    speed; a `switch` over slices of the stack ran no faster, the slices being copied too, and compiled one
    branch per expert, 24x slower at 64).
    Up to `DENSE_PAIRS_PER_EXPERT` pairs per expert with at most `DENSE_FLOPS_RATIO` experts per chosen one
    (batched decode of a model with few experts), the experts run as batched matmuls over the stacked weights
    (each expert read once, no sort or weight copy): every token through every expert when there are few tokens,
    else in passes of about twice the mean pairs per expert (`expert_passes`: half the FLOPs at 16 tokens x
    top-2 of 8, usually one pass); each pair takes its expert's row, so an expert
    nobody chose never reaches the output. Otherwise the pairs are sorted into expert-aligned tiles
    (`sort_pairs`) of about one expert's mean share of rows, and each tile that holds pairs runs its expert once,
    contracting the stored weights on their last axis (no transposed copies); empty tiles are skipped.
    `pairs`, when given, says that only about that many pairs are real and the others carry weight 0 (an expert
    shard's receive buffer, sized for the worst case): the tiles are sized for the real pairs and the
    weight-0 pairs take none (their output is 0).
    The Pallas form is `routed_experts` below (the same tiles as grouped matmul kernels)."""
    n_exp, inter, dim = w1.shape

    def mlp(v, w1, w2, w3):  # v [..., d] through one expert's weights, or v [..., g, d] through stacked ones [g, ...]
        return dot_f32(clamped_swiglu(dot_f32(v, w1), dot_f32(v, w3), limit), w2)

    if isinstance(w1, ExpertViews) or isinstance(getattr(w1, "t", None), ExpertViews):
        parts = [expert_parts(w) for w in (w1, w2, w3)]
        branches = [functools.partial(mlp, w1=a, w2=b, w3=c) for a, b, c in zip(*parts)]
        return pair_by_pair(x, ids, weights, lambda v, e: jax.lax.switch(e, branches, v))
    if few_pairs(ids.size, n_exp):
        return pair_by_pair(x, ids, weights, lambda v, e: mlp(v, w1[e], w2[e], w3[e]))
    if ids.size <= DENSE_PAIRS_PER_EXPERT * n_exp and n_exp <= DENSE_FLOPS_RATIO * ids.shape[1]:
        rows = min(x.shape[0], pl.next_power_of_2(-(-2 * ids.size // n_exp)))
        if rows == x.shape[0] or rows < 8:  # every token through every expert (few rows: reading is the cost)
            y = mlp(jnp.broadcast_to(x[:, None], (x.shape[0], n_exp, dim)), w1, w2, w3)  # [t, e, d]
            return jnp.sum(jnp.take_along_axis(y, ids[..., None], axis=1) * weights[..., None], axis=1)
        per_pair = expert_passes(x, ids, lambda xs: mlp(xs, w1, w2, w3), n_exp, rows)
        return jnp.sum(per_pair * weights[..., None], axis=1)
    return expert_tiles(x, ids, weights, n_exp, lambda v, e: mlp(v, w1[e], w2[e], w3[e]), pairs)


def expert_parts(w: ExpertViews | TransposedWeight) -> tuple:
    """The per-expert weights of a stack given as views: the views' arrays, each still transposed if the stack
    was."""
    if isinstance(w, TransposedWeight):
        return tuple(TransposedWeight(part) for part in w.t.parts)
    return w.parts


def pair_by_pair(x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"], expert
                 ) -> Float32[Array, "t d"]:
    """Sum over each token's pairs of weight * `expert(token [d], expert id)` -> [d], pair by pair in order,
    unrolled. With a switch over `ExpertViews` per pair, pairs x experts branches compile (a loop over the
    pairs compiles them once but ran 1.13x slower at batch 1, `small`), so callers keep that product small
    (`VIEWED_BRANCHES`)."""
    out = jnp.zeros(x.shape, jnp.float32)
    for t, j in np.ndindex(ids.shape):
        out = out.at[t].add(weights[t, j] * expert(x[t], ids[t, j]))
    return out


def expert_tiles(x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"], n_exp: int, expert,
                 pairs: int | None = None) -> Float32[Array, "t d"]:
    """Sum over each token's pairs of weight * expert output, the pairs sorted into expert-aligned tiles of
    about one expert's mean share of rows (`pairs / n_exp` when given, with weight-0 pairs left out, else all
    pairs); each tile that holds pairs runs `expert(rows [tile, d], e)` -> [tile, d] fp32 once, empty ones
    are skipped."""
    dim = x.shape[-1]
    tile = max(8, pl.next_power_of_2(-(-(ids.size if pairs is None else pairs) // n_exp)))
    rows, row_pair, tile_expert, slot = sort_pairs(ids, n_exp, tile, None if pairs is None else weights != 0)
    xs = jnp.where((rows >= 0)[:, None], x[jnp.maximum(rows, 0)], 0).reshape(-1, tile, dim)
    # an empty tile's zeros are made from its rows, so they vary over the same mesh axes inside a shard_map
    y = jax.lax.map(lambda a: jax.lax.cond(a[1] >= 0, lambda: expert(a[0], a[1]),
                                           lambda: jnp.zeros_like(a[0], jnp.float32)), (xs, tile_expert))
    row_weight = jnp.where(row_pair >= 0, weights.reshape(-1)[jnp.maximum(row_pair, 0)], 0.0)
    weighted = jnp.concatenate([y.reshape(-1, dim) * row_weight[:, None], jnp.zeros((1, dim), y.dtype)])
    return jnp.sum(weighted[slot], axis=1)  # a pair without a row reads the zero row past the tiles


def expert_passes(x: Float[Array, "t d"], ids: Int[Array, "t k"], experts, n_exp: int, rows: int
                  ) -> Float[Array, "t k d"]:
    """Each pair's expert output: in passes of `rows` pairs per expert, each pass one batched matmul over the
    stacked experts (`experts`: [rows, e, d] -> [rows, e, d]) of the pairs ranked [p * rows, (p + 1) * rows)
    among their expert's; as many passes as the busiest expert needs (one when no expert has more than
    `rows`). A pair's numbers do not depend on which other pairs share its pass."""
    t, k = ids.shape
    dim = x.shape[-1]
    flat = ids.reshape(-1)
    hit = flat[:, None] == jnp.arange(n_exp)  # [P, e]
    rank = jnp.sum(jnp.cumsum(hit, axis=0) * hit, axis=1) - 1  # among its expert's pairs, in pair order
    token = jnp.arange(t * k) // k
    cells = rows * n_exp  # a pass's [rows, e] grid

    def one_pass(p, out):
        inside = (rank >= p * rows) & (rank < (p + 1) * rows)
        cell = jnp.where(inside, (rank - p * rows) * n_exp + flat, cells)  # the pair's (row, expert) or none
        source = jnp.full((cells + 1,), -1, jnp.int32).at[cell].set(token.astype(jnp.int32))[:cells]
        xs = jnp.where((source >= 0)[:, None], x[jnp.maximum(source, 0)], 0).reshape(rows, n_exp, dim)
        y = experts(xs).reshape(cells, dim)
        return out + jnp.where(inside[:, None], y[jnp.minimum(cell, cells - 1)], 0)

    passes = (jnp.max(rank) + rows) // rows
    zeros = jnp.repeat(jnp.zeros_like(x, jnp.float32), k, axis=0)  # varies like x inside a shard_map
    return jax.lax.fori_loop(0, passes, one_pass, zeros).reshape(t, k, dim)


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
    w1: Float[Array, "e i d"] | TransposedWeight, w2: Float[Array, "e d i"] | TransposedWeight,
    w3: Float[Array, "e i d"] | TransposedWeight, limit: float, pairs: int | None = None,
) -> Float[Array, "t d"]:
    """Pallas form of `routed_experts_reference`. Its tiles are the tuning table's `moe_block_m` rows, whatever
    `pairs` expects; weight-0 pairs run (their output is weighted 0). Transposed stacks (a CPU engine's
    `model.host_layout`) are put back in the checkpoint layout first, a copy per call."""
    w1, w2, w3 = (logical(w) for w in (w1, w2, w3))
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
