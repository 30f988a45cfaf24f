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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Float32, Shaped

from pallas_kernels import tuning
from pallas_kernels.transposed_weights import TransposedWeight


SPLIT_GEMV_BYTES = 2**22
"""Below this many bytes of fp32 weight, XLA:CPU runs a one-row product x W^T on one thread (measured on 2 cores:
about 10 GB/s for weights of 0.25 to 2 MB, about 20 GB/s from 4 MB up, where it uses both)."""


def gemv_groups(w: Float[Array, "*g o i"]) -> int:
    """Into how many groups of rows `dot_f32` splits fp32 weight `w` for a one-row product: one per core this
    process may use (the largest such count dividing W's rows) for a small 2-D weight on the CPU backend, where
    XLA:CPU spreads a batched product over its threads (about 20 GB/s at 1 MB on 2 cores); 1 otherwise."""
    if jax.default_backend() != "cpu" or w.ndim != 2 or w.size * 4 >= SPLIT_GEMV_BYTES:
        return 1
    return max(g for g in range(1, min(tuning.host_cores(), w.shape[0]) + 1) if w.shape[0] % g == 0)


def dot_f32(x: Float[Array, "... i"], w: Float[Array, "*g o i"] | TransposedWeight, round_inputs: bool = True
            ) -> Float32[Array, "... o"]:
    """x W^T accumulated in fp32 for a float weight [o, i], or a grouped one [g, o, i] applied to x's group axis.
    A narrower weight (bf16) takes the forms XLA:CPU fuses (reference/quantized-weights.md (d)): one row is a
    reduction over the weight upcast in the same fusion, more rows a dot in the weight's dtype accumulating in
    fp32, the activations rounded to it (unless `round_inputs` is False: then an fp32 dot of the upcast
    weight). One row through a small fp32 weight is a product batched over groups of W's rows
    (`gemv_groups`); each output is the same dot product either way. A `TransposedWeight` is contracted in its
    own layout (`transposed_dot`)."""
    if isinstance(w, TransposedWeight):
        return transposed_dot(x, w)
    spec = "...i,oi->...o" if w.ndim == 2 else "...gi,goi->...go"
    rows = math.prod(x.shape[:x.ndim - w.ndim + 1])
    if w.dtype == jnp.float32 or (not round_inputs and rows > 1):
        groups = gemv_groups(w) if rows == 1 and w.dtype == jnp.float32 else 1
        if groups > 1:
            one = jnp.broadcast_to(x.reshape(1, 1, -1).astype(jnp.float32), (groups, 1, x.shape[-1]))
            y = jnp.einsum("gti,goi->tgo", one, w.reshape(groups, -1, w.shape[-1]))
            return y.reshape(*x.shape[:-1], w.shape[0])
        return jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32))
    if rows == 1:  # the weight first: XLA:CPU runs `x * w` several times slower (measured, 4096 x 4096)
        lead, one = x.shape[:x.ndim - w.ndim + 1], x.reshape(x.shape[x.ndim - w.ndim + 1:]).astype(jnp.float32)
        return (w.astype(jnp.float32) * one[..., None, :]).sum(-1).reshape(*lead, *w.shape[:-1])
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def transposed_dot(x: Float[Array, "... i"], w: TransposedWeight) -> Float32[Array, "... o"]:
    """x W^T for W held as W^T [i, o] (or [g, i, o], applied to x's group axis), in fp32. A grouped weight's
    group axis is moved in front of the rows, so each group is one product with its rows (the form XLA:CPU runs
    fast: with the group axis left among the rows, a `small` batch-16 decode step took 3x as long). One row
    through a small 2-D weight is split along i into one group per core, the groups' partial products summed
    (`gemv_groups` of W^T: the reshape is free in this layout, the batched product uses every core)."""
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


def block_scales(scale: Shaped[Array, "rb cb"], block: tuple[int, int], shape: tuple[int, int]
                 ) -> Float32[Array, "rows cols"]:
    """Per-block scales (UE8M0 or fp32) as fp32, broadcast to every element of a `shape` matrix."""
    full = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block[0], axis=0), block[1], axis=1)
    return full[: shape[0], : shape[1]]


def fp8_linear(x: Float[Array, "... i"], w: Shaped[Array, "o i"], scale: Shaped[Array, "ob ib"],
               block: tuple[int, int]) -> Float32[Array, "... o"]:
    """x W^T for an FP8 weight with block scales, decoded inside the computation; fp32 out. The decoding waits
    for x (`after`), so a step holds the decodings of the weights it is using, never the whole model's."""
    x, w, scale = after(x, w, scale)
    return dot_f32(x, w.astype(jnp.float32) * block_scales(scale, block, w.shape))


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


OPS = {"fp8_linear": (fp8_linear, fp8_linear_pallas)}
