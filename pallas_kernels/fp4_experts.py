"""Routed experts whose weights stay packed FP4 as DeepSeek stores them: E2M1 codes two per byte (input 2j in
the low nibble of byte j, 2j+1 in the high one) with one UE8M0 scale per `group` (32) inputs of a row.

Reference (`routed_experts_fp4`): decodes inside the computation each pair's expert and computes the clamped
SwiGLU experts in fp32, as DeepSeek's reference does (the XLA:CPU form, `xla_cpu.fp4_experts`, decodes each
expert tile's weights once). Pallas
(`routed_experts_fp4_pallas`): the grouped matmuls of `pallas_kernels.moe` (pairs sorted into expert-aligned
tiles, rows gathered inside the kernel, SwiGLU and routing weight fused) with the weight tile decoded in
registers one scale group per K step: the even and odd inputs multiply the low and high nibbles' values, each
scaled by its row's group scale.

Glossary: t tokens, k experts per token, e experts, i intermediate, d hidden, h = inputs / 2 bytes per row,
g scale groups per row, M padded sorted rows.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Float32, Int, Shaped

from pallas_kernels import tuning
from pallas_kernels.moe import clamped_swiglu, sort_pairs, unpermute
from pallas_kernels.quant_linear import after


def e2m1_values(codes: Int[Array, "..."]) -> Float32[Array, "..."]:
    """E2M1 values of the low four bits of `codes`: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa
    (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), computed without a table lookup."""
    c = codes.astype(jnp.int32) & 0xF
    e, m = (c >> 1) & 3, (c & 1).astype(jnp.float32)
    power = jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0))
    magnitude = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * power)
    return jnp.where(c >= 8, -magnitude, magnitude)


def e8m0_values(scale: Shaped[Array, "..."]) -> Float32[Array, "..."]:
    """UE8M0 bytes (float8_e8m0fnu or their uint8 bits) as fp32 2^(b - 127), by placing b in the exponent
    field (b = 0, 2^-127, becomes 0: an fp32 subnormal, which XLA:CPU flushes anyway)."""
    if scale.dtype != jnp.uint8:
        scale = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    return jax.lax.bitcast_convert_type(scale.astype(jnp.int32) << 23, jnp.float32)


def dequant_fp4(packed: Shaped[Array, "... o h"], scale: Shaped[Array, "... o g"]) -> Float32[Array, "... o i"]:
    """Packed FP4 rows to fp32 (each group of inputs times its scale; the last group may be partial)."""
    codes = packed.astype(jnp.int32)
    values = jnp.stack([e2m1_values(codes), e2m1_values(codes >> 4)], axis=-1).reshape(*packed.shape[:-1], -1)
    group = -(-values.shape[-1] // scale.shape[-1])
    return values * jnp.repeat(scale.astype(jnp.float32), group, axis=-1)[..., : values.shape[-1]]


def routed_experts_fp4(
    x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"], w1: Shaped[Array, "e i hd"],
    s1: Shaped[Array, "e i gd"], w2: Shaped[Array, "e d hi"], s2: Shaped[Array, "e d gi"],
    w3: Shaped[Array, "e i hd"], s3: Shaped[Array, "e i gd"], limit: float, pairs: int | None = None,
) -> Float32[Array, "t d"]:
    """Sum over each token's chosen experts of weight * w2 (silu(min(w1 x, limit)) * clip(w3 x, +-limit)),
    in fp32, each pair's expert decoded from packed FP4 inside the computation (after x exists: `after`).
    `pairs` changes nothing here (the fast forms size their tiles by it)."""
    del pairs
    x32 = x.astype(jnp.float32)
    x32, w1, s1, w3, s3 = after(x32, w1, s1, w3, s3)  # decoded when needed, not all at the step's start
    chosen = lambda w, s: dequant_fp4(w[ids], s[ids])  # noqa: E731  [t, k, out, in]
    h = clamped_swiglu(jnp.einsum("td,tkid->tki", x32, chosen(w1, s1)), jnp.einsum("td,tkid->tki", x32, chosen(w3, s3)),
                       limit)
    h, w2, s2 = after(h, w2, s2)
    y = jnp.einsum("tki,tkdi->tkd", h, chosen(w2, s2))
    return jnp.einsum("tk,tkd->td", weights.astype(jnp.float32), y)


def routed_experts_fp4_pallas(
    x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"], w1: Shaped[Array, "e i hd"],
    s1: Shaped[Array, "e i gd"], w2: Shaped[Array, "e d hi"], s2: Shaped[Array, "e d gi"],
    w3: Shaped[Array, "e i hd"], s3: Shaped[Array, "e i gd"], limit: float, pairs: int | None = None,
) -> Float32[Array, "t d"]:
    """Pallas form of `routed_experts_fp4` (inputs must fill whole scale groups). Its tiles are the tuning
    table's `moe_block_m` rows, whatever `pairs` expects; weight-0 pairs run (their output is weighted 0)."""
    for name, w, s in (("w1", w1, s1), ("w2", w2, s2), ("w3", w3, s3)):
        if 2 * w.shape[-1] != 32 * s.shape[-1]:
            raise ValueError(f"the FP4 expert kernel needs one scale per 32 inputs; {name} has {2 * w.shape[-1]} "
                             f"inputs and {s.shape[-1]} scales per row")
    n_exp = w1.shape[0]
    tiles = tuning.tiles()
    tm = tiles.moe_block_m
    rows, row_pair, tile_expert, slot = sort_pairs(ids, n_exp, tm)
    row_weight = jnp.where(row_pair >= 0, weights.reshape(-1)[row_pair], 0.0).astype(jnp.float32)
    x32 = x.astype(jnp.float32)
    h = _grouped(_gate_up_kernel, (x32[:, 0::2], x32[:, 1::2]), rows, tile_expert, (w1, s1, w3, s3), limit, tm,
                 tiles)
    y = _grouped(_down_kernel, (h[:, 0::2], h[:, 1::2]), row_weight, tile_expert, (w2, s2), None, tm, tiles)
    return unpermute(y, slot, tiles)


def _grouped(kernel, halves, per_row, tile_expert, weights, limit, tm, tiles):
    """One grouped-matmul pass over the sorted rows: `halves` are the even and odd input columns (of the
    tokens for gate/up, gathered by `per_row` row -> token; of the sorted rows for down, where `per_row`
    holds the routing weights)."""
    out, half = weights[0].shape[1:]
    tn, n_tiles = tuning.fit(tiles.moe_block_n, out), tile_expert.shape[0]
    rows_total = n_tiles * tm
    ints = [w if w.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(w, jnp.uint8) for w in weights]
    gather = kernel is _gate_up_kernel
    half_spec = (pl.BlockSpec(halves[0].shape, lambda m, n: (0, 0)) if gather
                 else pl.BlockSpec((tm, half), lambda m, n: (m, 0)))
    return pl.pallas_call(
        functools.partial(kernel, block_n=tn, **({"limit": limit} if gather else {})),
        out_shape=jax.ShapeDtypeStruct((rows_total, out), jnp.float32), grid=(n_tiles, out // tn),
        in_specs=[pl.BlockSpec((tm,), lambda m, n: (m,)), pl.BlockSpec((n_tiles,), lambda m, n: (0,)),
                  half_spec, half_spec] + [pl.BlockSpec(w.shape, lambda m, n: (0, 0, 0)) for w in ints],
        out_specs=pl.BlockSpec((tm, tn), lambda m, n: (m, n)),
        name="fp4_moe_gate_up" if gather else "fp4_moe_down", **tuning.call_options(),
    )(per_row, tile_expert, *halves, *ints)


def _fp4_product(even, odd, w_ref, s_ref, e, n0, block_n: int, g):
    """even / odd input columns [rows, 16] of scale group g times the decoded [block_n, 32] weight tile."""
    packed = w_ref[e, pl.ds(n0, block_n), pl.ds(g * 16, 16)].astype(jnp.int32)
    scale = e8m0_values(s_ref[e, pl.ds(n0, block_n), pl.ds(g, 1)])  # [block_n, 1]
    dims = (((1,), (1,)), ((), ()))
    return (jax.lax.dot_general(even, e2m1_values(packed) * scale, dims, preferred_element_type=jnp.float32)
            + jax.lax.dot_general(odd, e2m1_values(packed >> 4) * scale, dims, preferred_element_type=jnp.float32))


def _gate_up_kernel(rows_ref, te_ref, xe_ref, xo_ref, w1_ref, s1_ref, w3_ref, s3_ref, h_ref, *, block_n: int,
                    limit: float):
    """One tile's rows gathered from the tokens, times one column block of its expert's w1 and w3; SwiGLU."""
    e = te_ref[pl.program_id(0)]
    n0 = pl.program_id(1) * block_n

    @pl.when(e >= 0)
    def _():
        rows = rows_ref[...]
        ok = rows >= 0
        safe = jnp.where(ok, rows, 0)

        def step(g, acc):
            cols = pl.ds(g * 16, 16)
            even = jnp.where(ok[:, None], xe_ref[safe, cols], 0.0)
            odd = jnp.where(ok[:, None], xo_ref[safe, cols], 0.0)
            return (acc[0] + _fp4_product(even, odd, w1_ref, s1_ref, e, n0, block_n, g),
                    acc[1] + _fp4_product(even, odd, w3_ref, s3_ref, e, n0, block_n, g))

        zeros = jnp.zeros(h_ref.shape, jnp.float32)
        gate, up = jax.lax.fori_loop(0, xe_ref.shape[1] // 16, step, (zeros, zeros))
        h_ref[...] = jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)

    @pl.when(e < 0)
    def _():
        h_ref[...] = jnp.zeros(h_ref.shape, h_ref.dtype)


def _down_kernel(rw_ref, te_ref, he_ref, ho_ref, w2_ref, s2_ref, y_ref, *, block_n: int):
    """One tile's activations times one row block of its expert's w2, scaled by each pair's routing weight."""
    e = te_ref[pl.program_id(0)]
    n0 = pl.program_id(1) * block_n

    @pl.when(e >= 0)
    def _():
        def step(g, acc):
            cols = pl.ds(g * 16, 16)
            return acc + _fp4_product(he_ref[:, cols], ho_ref[:, cols], w2_ref, s2_ref, e, n0, block_n, g)

        acc = jax.lax.fori_loop(0, he_ref.shape[1] // 16, step, jnp.zeros(y_ref.shape, jnp.float32))
        y_ref[...] = acc * rw_ref[...][:, None]

    @pl.when(e < 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)


OPS = {"routed_experts_fp4": (routed_experts_fp4, routed_experts_fp4_pallas)}
