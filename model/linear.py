"""Bias-free linear maps stored as checkpoints store them: weight [out, in] (float, or FP8 with block scales)."""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from model import registry
from model.axes import param


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    """The initialisation of every random matrix of a fresh model (truncation-free normal, std 0.02)."""
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x W^T with W [out, in], accumulated in fp32 and returned in `compute_dtype` if given (fp32: the
    inputs kept in fp32 too), else in the weight's dtype."""

    def __init__(self, in_dim: int, out_dim: int, dtype, rngs: nnx.Rngs, compute_dtype=None):
        self.weight = param(normal_init(rngs, (out_dim, in_dim), dtype), "out", "in")
        self.compute_dtype = compute_dtype

    def __call__(self, x: Float[Array, "... i"]) -> Float[Array, "... o"]:
        w = self.weight[...]
        return registry.op("dot_f32")(x, w, round_inputs=self.compute_dtype is None).astype(self.compute_dtype or w.dtype)


class Fp8Linear(Linear):
    """A linear map in DeepSeek's stored FP8 form (`model.stored`): E4M3 `weight` [out, in] with a UE8M0 `scale`
    per `block` of it, decoded inside the matmul (the kernel registry's `fp8_linear`); returned in
    `compute_dtype` if given, else in the input's dtype."""

    def __init__(self, weight: nnx.Param, scale: nnx.Param, block: tuple[int, int], compute_dtype=None):
        self.weight, self.scale, self.block, self.compute_dtype = weight, scale, tuple(block), compute_dtype

    def __call__(self, x: Float[Array, "... i"]) -> Float[Array, "... o"]:
        y = registry.op("fp8_linear")(x, self.weight[...], self.scale[...], self.block)
        return y.astype(self.compute_dtype or x.dtype)


class GroupedLinear(nnx.Module):
    """Block-diagonal projection: group g of the input maps through its own [out, in/groups] slice."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int, dtype, rngs: nnx.Rngs):
        self.weight = param(normal_init(rngs, (groups * out_per_group, in_per_group), dtype), "out", "in")
        self.groups = groups

    def __call__(self, x: Float[Array, "... g i"]) -> Float[Array, "... g o"]:
        w = self.weight[...]
        return registry.op("dot_f32")(x, w.reshape(self.groups, -1, w.shape[-1])).astype(w.dtype)
