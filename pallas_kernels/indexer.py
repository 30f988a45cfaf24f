"""Lightning-indexer scores with causal visibility, tiled over (query block, key block): the per-head ReLU
products never leave the kernel, and key blocks no query of the tile can see are skipped (written as -inf).
Reference: `visible_index_scores_reference` below. Top-k selection stays `model.compressor.top_visible`
(XLA's stable `top_k`: ties go to the lower entry) for both implementations.

Glossary: b rows, c queries, h index heads, d index head dim, t index keys.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels import tuning

QUERY_BLOCK = 8  # queries sharing one key block read


def index_scores(
    q: Float[Array, "b c h d"], keys: Float[Array, "b t d"], head_weights: Float[Array, "b c h"]
) -> Float[Array, "b c t"]:
    """Lightning-indexer score: sum over heads of w_h * h^-1/2 * d^-1/2 * ReLU(q_h . k)."""
    per_head = jax.nn.relu(jnp.einsum("bchd,btd->bcht", q, keys)) * q.shape[-1] ** -0.5
    return jnp.einsum("bcht,bch->bct", per_head, head_weights * q.shape[-2] ** -0.5)


def visible_index_scores_reference(
    q: Float[Array, "b c h d"], keys: Float[Array, "b t d"], head_weights: Float[Array, "b c h"],
    visible: Int[Array, " c"],
) -> Float[Array, "b c t"]:
    """`index_scores` where each query sees its first `visible` keys; -inf for the rest."""
    scores = index_scores(q, keys, head_weights)
    return jnp.where(jnp.arange(keys.shape[1]) < visible[:, None], scores, -jnp.inf)


def visible_index_scores(
    q: Float[Array, "b c h d"], keys: Float[Array, "b t d"], head_weights: Float[Array, "b c h"],
    visible: Int[Array, " c"],
) -> Float[Array, "b c t"]:
    """Pallas form of `visible_index_scores_reference`."""
    b, c, h, d = q.shape
    t = keys.shape[1]
    if t == 0:  # no complete window yet
        return jnp.zeros((b, c, 0), jnp.float32)
    bt = min(tuning.tiles().index_block_t, tuning.next_pow2(t))
    tq = tuning.fit(QUERY_BLOCK, c)
    kernel = functools.partial(_kernel, queries=tq, block_t=bt, scale=d ** -0.5 * h ** -0.5)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((b, c, t), jnp.float32), grid=(b, c // tq, pl.cdiv(t, bt)),
        in_specs=[pl.BlockSpec((None, tq, h, d), lambda i, j, k: (i, j, 0, 0)),
                  pl.BlockSpec((None, t, d), lambda i, j, k: (i, 0, 0)),
                  pl.BlockSpec((None, tq, h), lambda i, j, k: (i, j, 0)),
                  pl.BlockSpec((tq,), lambda i, j, k: (j,))],
        out_specs=pl.BlockSpec((None, tq, t), lambda i, j, k: (i, j, 0)),
        name="index_scores", **tuning.call_options(),
    )(q, keys, head_weights.astype(jnp.float32), visible.astype(jnp.int32))


def _kernel(q_ref, k_ref, w_ref, vis_ref, o_ref, *, queries: int, block_t: int, scale: float):
    """Scores of `queries` queries against key block `program_id(2)`; blocks past every query's visible count
    skip work. Keys and scores are whole rows: the last block's loads and stores are masked to the t keys
    (a power-of-two block need not divide t)."""
    first = pl.program_id(2) * block_t
    cols = first + jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    inside = cols < k_ref.shape[0]
    visible = vis_ref[...]

    @pl.when(first < jnp.max(visible))
    def _():
        keys = pltriton.load(k_ref.at[pl.ds(first, block_t), :], mask=inside[:, None], other=0.0)
        for i in range(queries):
            s = jax.lax.dot_general(q_ref[i], keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            score = jnp.sum(jax.nn.relu(s) * w_ref[i][:, None], axis=0) * scale
            pltriton.store(o_ref.at[pl.ds(i, 1), pl.ds(first, block_t)],
                           jnp.where(cols < vis_ref[i], score, -jnp.inf)[None], mask=inside[None])

    @pl.when(first >= jnp.max(visible))
    def _():
        pltriton.store(o_ref.at[:, pl.ds(first, block_t)], jnp.full((queries, block_t), -jnp.inf, o_ref.dtype),
                       mask=inside[None, :])


OPS = {"index_scores": (visible_index_scores_reference, visible_index_scores)}
