"""Linear maps y = x W^T accumulated in fp32: float weights of any width, and FP8 weights as DeepSeek stores
them (E4M3 values [o, i], one UE8M0 scale per block of `block` = (rows, cols), ceil-sized at the edges).

Reference (`fp8_linear`): the weight is decoded inside the computation (a transient of one weight's fp32
size, never the model's) and contracted in fp32. Pallas (`fp8_linear_pallas`): a GEMM over (row tile, column
tile) programs stepping through K at most one scale block at a time; the FP8 tile is cast to the activation
dtype in registers, the partial product lands in fp32 and is scaled by its block's scale before it joins the
accumulator (the accumulation of DeepSeek's `fp8_gemm`, with activations left unquantized).

Glossary: m rows of activations, i inputs, o outputs, kb scale blocks along i.
"""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Float32, Shaped

from pallas_kernels import tuning


def dot_f32(x: Float[Array, "... i"], w: Float[Array, "*g o i"], round_inputs: bool = True
            ) -> Float32[Array, "... o"]:
    """x W^T accumulated in fp32 for a float weight [o, i], or a grouped one [g, o, i] applied to x's group axis.
    A narrower weight (bf16) takes the forms XLA fuses (reference/quantized-weights.md (d)): one row is a
    reduction over the weight upcast in the same fusion, more rows a dot in the weight's dtype accumulating in
    fp32, the activations rounded to it (unless `round_inputs` is False: then an fp32 dot of the upcast
    weight)."""
    spec = "...i,oi->...o" if w.ndim == 2 else "...gi,goi->...go"
    rows = math.prod(x.shape[:x.ndim - w.ndim + 1])
    if w.dtype == jnp.float32 or (not round_inputs and rows > 1):
        return jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32))
    if rows == 1:  # the weight first: `x * w` runs several times slower on XLA:CPU
        lead, one = x.shape[:x.ndim - w.ndim + 1], x.reshape(x.shape[x.ndim - w.ndim + 1:]).astype(jnp.float32)
        return (w.astype(jnp.float32) * one[..., None, :]).sum(-1).reshape(*lead, *w.shape[:-1])
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def block_scales(scale: Shaped[Array, "rb cb"], block: tuple[int, int], shape: tuple[int, int]
                 ) -> Float32[Array, "rows cols"]:
    """Per-block scales (UE8M0 or fp32) as fp32, broadcast to every element of a `shape` matrix."""
    full = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block[0], axis=0), block[1], axis=1)
    return full[: shape[0], : shape[1]]


def fp8_linear(x: Float[Array, "... i"], w: Shaped[Array, "o i"], scale: Shaped[Array, "ob ib"],
               block: tuple[int, int], dot: Callable = dot_f32) -> Float32[Array, "... o"]:
    """x W^T for an FP8 weight with block scales, decoded inside the computation; fp32 out (`dot`: the fp32
    product of x and the decoded weight). The decoding waits for x (`after`), so a step holds the decodings of
    the weights it is using, never the whole model's."""
    x, w, scale = after(x, w, scale)
    return dot(x, w.astype(jnp.float32) * block_scales(scale, block, w.shape))


def after(x: Array, *weights: Array) -> tuple[Array, ...]:
    """(x, *weights) such that what is computed from the weights cannot start before x exists: XLA would
    otherwise decode every stored weight of a step at its start (their inputs are all there) and hold them
    all (measured: +34 MB of temp per `small` layer at batch 16)."""
    return jax.lax.optimization_barrier((x, *weights))


def fp8_linear_pallas(x: Float[Array, "... i"], w: Shaped[Array, "o i"], scale: Shaped[Array, "ob ib"],
                      block: tuple[int, int]) -> Float32[Array, "... o"]:
    """Pallas form of `fp8_linear`."""
    *lead, i = x.shape
    o, rows = w.shape[0], math.prod(lead)
    t = tuning.tiles()
    tm = min(t.qlinear_block_m, tuning.next_pow2(rows))
    padded = pl.cdiv(rows, tm) * tm  # whole row tiles (zero rows, sliced off)
    tn = tuning.fit(t.qlinear_block_n, o)
    tk = tuning.fit(min(t.qlinear_block_k, block[1]), math.gcd(i, block[1]))  # a step stays inside one block
    x2 = jnp.pad(x.reshape(rows, i), ((0, padded - rows), (0, 0)))
    col_scale = jnp.repeat(scale.astype(jnp.float32), block[0], axis=0)[:o].T  # [kb, o]: each column's scales
    kernel = functools.partial(_fp8_kernel, block_k=tk, scale_block=block[1])
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((padded, o), jnp.float32), grid=(padded // tm, o // tn),
        in_specs=[pl.BlockSpec((tm, i), lambda m, n: (m, 0)),
                  pl.BlockSpec((tn, i), lambda m, n: (n, 0)),
                  pl.BlockSpec((col_scale.shape[0], tn), lambda m, n: (0, n))],
        out_specs=pl.BlockSpec((tm, tn), lambda m, n: (m, n)),
        name="fp8_linear", **tuning.call_options(),
    )(x2, w, col_scale)
    return out[:rows].reshape(*lead, o)


def _fp8_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k: int, scale_block: int):
    """One tile of rows times one column tile of the weight: per K step an fp32 partial product scaled by the
    step's block scales."""
    def step(kb, acc):
        cols = pl.ds(kb * block_k, block_k)
        xs = x_ref[:, cols]
        part = jax.lax.dot_general(xs, w_ref[:, cols].astype(xs.dtype), (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return acc + part * s_ref[pl.ds(kb * block_k // scale_block, 1), :]

    o_ref[...] = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, jnp.zeros(o_ref.shape, jnp.float32))


OPS = {"fp8_linear": (fp8_linear, fp8_linear_pallas), "dot_f32": (dot_f32, dot_f32)}
