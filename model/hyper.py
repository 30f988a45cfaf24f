"""mHC: manifold-constrained hyper-connections mixing `hc_mult` residual streams around each block."""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from model.norms import rms_normalize
from pallas_kernels import registry


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


class HyperConnection(nnx.Module):
    """Per-token pre / post / comb weights of one mHC site, computed from the normalised flattened streams."""

    def __init__(self, n: int, dim: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float, rngs: nnx.Rngs):
        width = (2 + n) * n
        self.fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), (width, n * dim), jnp.float32))
        self.base = nnx.Param(jnp.zeros((width,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps

    def site(self, streams: Float[Array, "b s n d"], collapse_pre: Float[Array, "b s n"] | None = None):
        """(pre, post, comb, block input): this site's weights and the streams collapsed by `pre` (or by
        `collapse_pre`, V4.1's weights from the previous site), through the kernel registry's `hc_site`."""
        return registry.op("hc_site")(streams, self.fn[...], self.base[...], self.scale[...], collapse_pre,
                                      self.iters, self.hc_eps, self.norm_eps)


def hc_site(
    streams: Float[Array, "b s n d"], fn: Float[Array, "w nd"], base: Float[Array, " w"], scale: Float[Array, " 3"],
    collapse_pre: Float[Array, "b s n"] | None, iters: int, hc_eps: float, norm_eps: float,
):
    """(pre [b,s,n], post [b,s,n], comb [b,s,n,n], block input [b,s,d]) of one mHC site: the weights from
    the normalised flattened streams, and the streams collapsed by `pre` (or by `collapse_pre` if given)."""
    n = streams.shape[-2]
    flat = rms_normalize(streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32), norm_eps)
    mix = jnp.einsum("...k,ok->...o", flat, fn)
    pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = mix[..., 2 * n:] * scale[2] + base[2 * n:]
    comb = sinkhorn(comb_logits.reshape(*comb_logits.shape[:-1], n, n), iters, hc_eps)
    return pre, post, comb, collapse(streams, pre if collapse_pre is None else collapse_pre)


def collapse(streams: Float[Array, "b s n d"], pre: Float[Array, "b s n"]) -> Float[Array, "b s d"]:
    """Weighted sum of the streams (the block input)."""
    return jnp.einsum("bsn,bsnd->bsd", pre, streams.astype(jnp.float32)).astype(streams.dtype)


def expand(
    streams: Float[Array, "b s n d"], y: Float[Array, "b s d"], post: Float[Array, "b s n"],
    comb: Float[Array, "b s n n"],
) -> Float[Array, "b s n d"]:
    """New streams X'_j = post_j * y + sum_i comb[i, j] * X_i (the transposed comb)."""
    mixed = jnp.einsum("bsij,bsid->bsjd", comb, streams.astype(jnp.float32))
    return (post[..., None] * y[..., None, :].astype(jnp.float32) + mixed).astype(streams.dtype)


class HyperHead(nnx.Module):
    """Final collapse of the streams before the output norm and head (sigmoid weights, no Sinkhorn)."""

    def __init__(self, n: int, dim: int, hc_eps: float, norm_eps: float, rngs: nnx.Rngs):
        self.fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), (n, n * dim), jnp.float32))
        self.base = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((1,), jnp.float32))
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def __call__(self, streams: Float[Array, "b s n d"]) -> Float[Array, "b s d"]:
        flat = rms_normalize(streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32), self.norm_eps)
        pre = jax.nn.sigmoid(jnp.einsum("...k,ok->...o", flat, self.fn[...]) * self.scale[0] + self.base[...]) + self.hc_eps
        return collapse(streams, pre)
