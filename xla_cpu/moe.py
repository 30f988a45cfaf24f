"""Routed experts in the forms XLA:CPU runs fastest, for a batch of any size and for expert stacks held as the
CPU engine holds them (transposed, `xla_cpu.transposed_weights`; per-expert views, `xla_cpu.expert_views`). Each
form computes `pallas_kernels.moe.routed_experts_reference`'s numbers; which one runs depends on the shapes only.

Glossary: t tokens, k experts per token, P = t*k pairs, e experts, i intermediate, d hidden.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Float32, Int

from pallas_kernels.moe import clamped_swiglu, sort_pairs
from pallas_kernels.tuning import next_pow2
from xla_cpu.expert_views import ExpertViews
from xla_cpu.linear import dot_f32
from xla_cpu.transposed_weights import TransposedWeight


def few_pairs(pairs: int, n_exp: int) -> bool:
    """Whether `routed_experts` runs `pairs` (token, expert) pairs one by one, each reading only its
    expert's weights (fewer pairs than experts: decode of a token or two)."""
    return pairs < n_exp


VIEWED_BRANCHES = 128
"""The most (pairs x experts) switch branches `pair_by_pair` is given to compile per MoE layer (the `small`
preset's batch-1 decode has 16; a V4-Flash-sized one, 6 of 256, would have 1,536 and keeps the stacks)."""


DENSE_PAIRS_PER_EXPERT = 8
"""Up to this many (token, expert) pairs per expert `routed_experts` runs the stacks as batched matmuls ..."""
DENSE_FLOPS_RATIO = 4
"""... while that costs at most this many times the pairs' FLOPs (experts over experts per token)."""


def routed_experts(
    x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"],
    w1: Float[Array, "e i d"] | ExpertViews | TransposedWeight,
    w2: Float[Array, "e d i"] | ExpertViews | TransposedWeight,
    w3: Float[Array, "e i d"] | ExpertViews | TransposedWeight, limit: float, pairs: int | None = None,
) -> Float[Array, "t d"]:
    """`pallas_kernels.moe.routed_experts_reference` in one of five forms chosen by the shapes, fp32 accumulation
    (`dot_f32`); stacks held transposed (`TransposedWeight`) are contracted in that layout by every form.

    - `ExpertViews` (the CPU engine's decode, `serving.core.layer_programs`): each pair runs its expert through a switch
      over the experts' own arrays, read where they lie (`pair_by_pair`).
    - Fewer pairs than experts (`few_pairs`): each pair indexes its expert's weights and reads only those.
    - At most `DENSE_PAIRS_PER_EXPERT` pairs per expert and `DENSE_FLOPS_RATIO` experts per chosen one: batched
      matmuls over the stacks, every token through every expert when there are few tokens, else in passes of
      about twice the mean pairs per expert (`expert_passes`); each pair takes its own expert's row.
    - Otherwise: the pairs sorted into expert-aligned tiles (`expert_tiles`), each tile holding pairs running its
      expert once; empty tiles skipped. `pairs` (how many are real, the others weighing 0: an expert shard's
      receive buffer) sizes the tiles, and the weight-0 pairs take no row.

    Figures behind the thresholds: docs/benchmarks.md, "The XLA:CPU forms"."""
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
        rows = min(x.shape[0], next_pow2(-(-2 * ids.size // n_exp)))
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
    unrolled (a loop over the pairs runs slower). With a switch over `ExpertViews` per pair, pairs x experts
    branches compile, so callers keep that product small (`VIEWED_BRANCHES`)."""
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
    tile = max(8, next_pow2(-(-(ids.size if pairs is None else pairs) // n_exp)))
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


def viewed(pairs: int, n_exp: int) -> bool:
    """Whether a call with `pairs` (token, expert) pairs over `n_exp` float experts runs faster given the stacks as
    `ExpertViews`: few enough pairs to run one by one, their switches over the experts within `VIEWED_BRANCHES`."""
    return few_pairs(pairs, n_exp) and pairs * n_exp <= VIEWED_BRANCHES


OPS = {"routed_experts": routed_experts}
