"""Linear maps y = x W^T in the forms XLA:CPU runs fastest: one row through a small weight split over the cores,
and weights held transposed (`xla_cpu.transposed_weights`). Each computes `pallas_kernels.quant_linear.dot_f32`'s
numbers (figures: docs/benchmarks.md, "The XLA:CPU forms")."""

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float32

from pallas_kernels import quant_linear
from pallas_kernels.tuning import host_cores
from xla_cpu.transposed_weights import TransposedWeight


SPLIT_GEMV_BYTES = 2**22
"""Below this many bytes of fp32 weight, XLA:CPU runs a one-row product x W^T on one thread."""


def gemv_groups(w: Float[Array, "*g o i"]) -> int:
    """Into how many groups of rows `dot_f32` splits fp32 weight `w` for a one-row product: one per core this
    process may use (the largest such count dividing W's rows) for a small 2-D weight on the CPU backend, where
    XLA:CPU spreads a batched product over its threads; 1 otherwise."""
    if jax.default_backend() != "cpu" or w.ndim != 2 or w.size * 4 >= SPLIT_GEMV_BYTES:
        return 1
    return max(g for g in range(1, min(host_cores(), w.shape[0]) + 1) if w.shape[0] % g == 0)


def dot_f32(x: Float[Array, "... i"], w: Float[Array, "*g o i"] | TransposedWeight, round_inputs: bool = True
            ) -> Float32[Array, "... o"]:
    """`quant_linear.dot_f32`, with one row through a small fp32 weight as a product batched over groups of W's
    rows (`gemv_groups`: each output the same dot product) and a `TransposedWeight` contracted in its own layout
    (`transposed_dot`)."""
    if isinstance(w, TransposedWeight):
        return transposed_dot(x, w)
    rows = math.prod(x.shape[:x.ndim - w.ndim + 1])
    groups = gemv_groups(w) if rows == 1 and w.dtype == jnp.float32 else 1
    if groups > 1:
        one = jnp.broadcast_to(x.reshape(1, 1, -1).astype(jnp.float32), (groups, 1, x.shape[-1]))
        y = jnp.einsum("gti,goi->tgo", one, w.reshape(groups, -1, w.shape[-1]))
        return y.reshape(*x.shape[:-1], w.shape[0])
    return quant_linear.dot_f32(x, w, round_inputs)


def transposed_dot(x: Float[Array, "... i"], w: TransposedWeight) -> Float32[Array, "... o"]:
    """x W^T for W held as W^T [i, o] (or [g, i, o], applied to x's group axis), in fp32. A grouped weight's
    group axis is moved in front of the rows, so each group is one product with its rows (with the group axis
    left among the rows XLA:CPU runs it several times slower). One row through a small 2-D weight is split along
    i into one group per core, the groups' partial products summed (`gemv_groups` of W^T)."""
    t = w.t.astype(jnp.float32)
    x = x.astype(jnp.float32)
    if t.ndim == 3:
        y = jnp.einsum("g...i,gio->g...o", jnp.moveaxis(x, -2, 0), t)
        return jnp.moveaxis(y, 0, -2)
    groups = gemv_groups(t) if math.prod(x.shape[:-1]) == 1 else 1
    if groups > 1:
        parts = x.reshape(groups, 1, -1)
        y = jnp.einsum("gti,gio->gto", parts, t.reshape(groups, -1, t.shape[-1])).sum(0)
        return y.reshape(*x.shape[:-1], t.shape[-1])
    return jnp.einsum("...i,io->...o", x, t)


OPS = {"dot_f32": dot_f32, "fp8_linear": functools.partial(quant_linear.fp8_linear, dot=dot_f32)}
