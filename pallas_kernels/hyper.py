"""One mHC site fused: unweighted RMS norm of the flattened streams, the (2+n)*n-wide projection, sigmoids,
Sinkhorn, and the collapse of the streams into the block input, in one pass over tiles of tokens (the
normalised streams and the projection are never written). Reference: `hc_site_reference` below.

Glossary: T tokens (rows x sequence), n streams, d hidden, w = (2+n)*n projection width.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from pallas_kernels import tuning


def sinkhorn(logits: Float[Array, "... n n"], iters: int, eps: float) -> Float[Array, "... n n"]:
    """Near doubly-stochastic matrix: row softmax + eps, then alternate column / row normalisation.

    The first and last steps are column normalisations (`iters` column steps in all).
    """
    m = jax.nn.softmax(logits, axis=-1) + eps
    m = m / (jnp.sum(m, axis=-2, keepdims=True) + eps)

    def row_then_column(_, m):
        m = m / (jnp.sum(m, axis=-1, keepdims=True) + eps)
        return m / (jnp.sum(m, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, row_then_column, m)


def collapse(streams: Float[Array, "b s n d"], pre: Float[Array, "b s n"]) -> Float[Array, "b s d"]:
    """Weighted sum of the streams (the block input)."""
    x = streams.astype(jnp.float32)
    return sum(pre[..., j, None] * x[..., j, :] for j in range(x.shape[-2])).astype(streams.dtype)


def hc_site_reference(
    streams: Float[Array, "b s n d"], fn: Float[Array, "w nd"], base: Float[Array, " w"], scale: Float[Array, " 3"],
    collapse_pre: Float[Array, "b s n"] | None, iters: int, hc_eps: float, norm_eps: float,
):
    """(pre [b,s,n], post [b,s,n], comb [b,s,n,n], block input [b,s,d]) of one mHC site: the weights from
    the normalised flattened streams, and the streams collapsed by `pre` (or by `collapse_pre` if given)."""
    n = streams.shape[-2]
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)  # unweighted RMS norm
    mix = jnp.einsum("...k,ok->...o", flat, fn)
    pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = mix[..., 2 * n:] * scale[2] + base[2 * n:]
    comb = sinkhorn(comb_logits.reshape(*comb_logits.shape[:-1], n, n), iters, hc_eps)
    return pre, post, comb, collapse(streams, pre if collapse_pre is None else collapse_pre)


def hc_site(
    streams: Float[Array, "b s n d"], fn: Float[Array, "w nd"], base: Float[Array, " w"], scale: Float[Array, " 3"],
    collapse_pre: Float[Array, "b s n"] | None, iters: int, hc_eps: float, norm_eps: float,
):
    """Pallas form of `hc_site_reference`: (pre, post, comb, block input)."""
    *lead, n, d = streams.shape
    tokens = math.prod(lead)
    t = tuning.tiles()
    tt, dc = min(t.hc_block_t, tuning.next_pow2(tokens)), tuning.fit(t.hc_block_d, d)
    padded = pl.cdiv(tokens, tt) * tt  # whole tiles: no block runs past an array (zero rows, sliced off)

    def whole_tiles(x):
        x = x.reshape(tokens, *x.shape[len(lead):])
        return jnp.pad(x, ((0, padded - tokens),) + ((0, 0),) * (x.ndim - 1))

    kernel = functools.partial(_kernel, block_d=dc, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                               given_pre=collapse_pre is not None)
    rows = lambda i: (i, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((tt, n, d), lambda i: (i, 0, 0)), pl.BlockSpec(fn.shape, lambda i: (0, 0)),
                pl.BlockSpec(base.shape, lambda i: (0,)), pl.BlockSpec(scale.shape, lambda i: (0,))]
    args = [whole_tiles(streams), fn, base, scale]
    if collapse_pre is not None:
        in_specs.append(pl.BlockSpec((tt, n), rows))
        args.append(whole_tiles(collapse_pre.astype(jnp.float32)))
    pre, post, comb, h = pl.pallas_call(
        kernel, grid=(padded // tt,), in_specs=in_specs,
        out_shape=(jax.ShapeDtypeStruct((padded, n), jnp.float32), jax.ShapeDtypeStruct((padded, n), jnp.float32),
                   jax.ShapeDtypeStruct((padded, n * n), jnp.float32),
                   jax.ShapeDtypeStruct((padded, d), streams.dtype)),
        out_specs=(pl.BlockSpec((tt, n), rows), pl.BlockSpec((tt, n), rows), pl.BlockSpec((tt, n * n), rows),
                   pl.BlockSpec((tt, d), rows)),
        name="mhc_site", **tuning.call_options(),
    )(*args)
    return (pre[:tokens].reshape(*lead, n), post[:tokens].reshape(*lead, n), comb[:tokens].reshape(*lead, n, n),
            h[:tokens].reshape(*lead, d))


def _kernel(x_ref, fn_ref, base_ref, scale_ref, *refs, block_d: int, iters: int, hc_eps: float, norm_eps: float,
            given_pre: bool):
    """One tile of tokens: the projection accumulated over column blocks, the weights, then the collapse."""
    if given_pre:
        cpre_ref, pre_ref, post_ref, comb_ref, h_ref = refs
    else:
        pre_ref, post_ref, comb_ref, h_ref = refs
    tt, n, d = x_ref.shape
    nn = n * n

    def project(cb, acc):
        sumsq, m_pre, m_post, m_comb = acc
        for j in range(n):
            xj = x_ref[:, j, pl.ds(cb * block_d, block_d)].astype(jnp.float32)
            cols = pl.ds(j * d + cb * block_d, block_d)
            sumsq = sumsq + jnp.sum(xj * xj, axis=1)
            m_pre = m_pre + jnp.sum(xj[:, None, :] * fn_ref[pl.ds(0, n), cols][None], axis=2)
            m_post = m_post + jnp.sum(xj[:, None, :] * fn_ref[pl.ds(n, n), cols][None], axis=2)
            m_comb = m_comb + jax.lax.dot_general(xj, fn_ref[pl.ds(2 * n, nn), cols], (((1,), (1,)), ((), ())),
                                                  precision=jax.lax.Precision.HIGHEST,
                                                  preferred_element_type=jnp.float32)
        return sumsq, m_pre, m_post, m_comb

    zeros = jnp.zeros((tt, n), jnp.float32)
    sumsq, m_pre, m_post, m_comb = jax.lax.fori_loop(
        0, d // block_d, project, (jnp.zeros((tt,), jnp.float32), zeros, zeros, jnp.zeros((tt, nn), jnp.float32)))
    inv = jax.lax.rsqrt(sumsq / (n * d) + norm_eps)[:, None]
    pre = jax.nn.sigmoid(m_pre * inv * scale_ref[0] + base_ref[pl.ds(0, n)][None]) + hc_eps
    pre_ref[...] = pre
    post_ref[...] = 2 * jax.nn.sigmoid(m_post * inv * scale_ref[1] + base_ref[pl.ds(n, n)][None])
    logits = m_comb * inv * scale_ref[2] + base_ref[pl.ds(2 * n, nn)][None]
    comb_ref[...] = sinkhorn(logits.reshape(tt, n, n), iters, hc_eps).reshape(tt, nn)

    weights = cpre_ref[...] if given_pre else pre
    lanes = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
    per_stream = [jnp.sum(jnp.where(lanes == j, weights, 0.0), axis=1)[:, None] for j in range(n)]

    def collapse(cb, carry):
        cols = pl.ds(cb * block_d, block_d)
        h = sum(per_stream[j] * x_ref[:, j, cols].astype(jnp.float32) for j in range(n))
        h_ref[:, cols] = h.astype(h_ref.dtype)
        return carry

    jax.lax.fori_loop(0, d // block_d, collapse, 0)


OPS = {"hc_site": (hc_site_reference, hc_site)}
