"""RMS normalisations: the weighted RMSNorm and the unweighted one used per head and by mHC."""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from model.axes import param


def rms_normalize(x: Float[Array, "... d"], eps: float) -> Float[Array, "... d"]:
    """Scale the last axis to unit root-mean-square (computed in fp32, returned in x's dtype)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Weighted RMSNorm; the weight is kept in fp32 as in the reference checkpoints."""

    def __init__(self, dim: int, eps: float):
        self.weight = param(jnp.ones((dim,), jnp.float32), "norm")
        self.eps = eps

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...] * normed).astype(x.dtype)
