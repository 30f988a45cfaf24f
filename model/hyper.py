"""mHC: manifold-constrained hyper-connections mixing `hc_mult` residual streams around each block."""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from model.axes import param
from model.norms import rms_normalize
from model import registry
from pallas_kernels.hyper import collapse


class HyperConnection(nnx.Module):
    """Per-token pre / post / comb weights of one mHC site, computed from the normalised flattened streams."""

    def __init__(self, n: int, dim: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float, rngs: nnx.Rngs):
        width = (2 + n) * n
        self.fn = param(0.02 * jax.random.normal(rngs.params(), (width, n * dim), jnp.float32), "hc", "embed")
        self.base = param(jnp.zeros((width,), jnp.float32), "hc")
        self.scale = param(jnp.ones((3,), jnp.float32), "hc_scale")
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps

    def site(self, streams: Float[Array, "b s n d"], collapse_pre: Float[Array, "b s n"] | None = None):
        """(pre, post, comb, block input): this site's weights and the streams collapsed by `pre` (or by
        `collapse_pre`, V4.1's weights from the previous site), through the kernel registry's `hc_site`."""
        return registry.op("hc_site")(streams, self.fn[...], self.base[...], self.scale[...], collapse_pre,
                                      self.iters, self.hc_eps, self.norm_eps)


def expand(
    streams: Float[Array, "b s n d"], y: Float[Array, "b s d"], post: Float[Array, "b s n"],
    comb: Float[Array, "b s n n"],
) -> Float[Array, "b s n d"]:
    """New streams X'_j = post_j * y + sum_i comb[i, j] * X_i (the transposed comb)."""
    x = streams.astype(jnp.float32)
    # n broadcast products summed: one elementwise fusion (XLA:CPU ran the einsum as a slow tiny matmul)
    mixed = sum(comb[..., i, :, None] * x[..., i, None, :] for i in range(x.shape[-2]))
    return (post[..., None] * y[..., None, :].astype(jnp.float32) + mixed).astype(streams.dtype)


class HyperHead(nnx.Module):
    """Final collapse of the streams before the output norm and head (sigmoid weights, no Sinkhorn)."""

    def __init__(self, n: int, dim: int, hc_eps: float, norm_eps: float, rngs: nnx.Rngs):
        self.fn = param(0.02 * jax.random.normal(rngs.params(), (n, n * dim), jnp.float32), "hc", "embed")
        self.base = param(jnp.zeros((n,), jnp.float32), "hc")
        self.scale = param(jnp.ones((1,), jnp.float32), "hc_scale")
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def __call__(self, streams: Float[Array, "b s n d"]) -> Float[Array, "b s d"]:
        flat = rms_normalize(streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32), self.norm_eps)
        pre = jax.nn.sigmoid(jnp.einsum("...k,ok->...o", flat, self.fn[...]) * self.scale[0] + self.base[...]) + self.hc_eps
        return collapse(streams, pre)
