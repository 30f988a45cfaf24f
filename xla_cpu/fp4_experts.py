"""Routed experts stored packed FP4, in the forms XLA:CPU runs fastest: with fewer (token, expert) pairs than
experts each pair decodes its expert (the reference's form), else the pairs run in expert-aligned tiles, each
decoding its expert once (`xla_cpu.moe.expert_tiles`): the pairs' FLOPs, not a decoded expert per pair."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Float32, Int, Shaped

from pallas_kernels.fp4_experts import dequant_fp4, routed_experts_fp4 as reference
from pallas_kernels.moe import clamped_swiglu
from pallas_kernels.quant_linear import after
from xla_cpu.moe import expert_tiles, few_pairs


def routed_experts_fp4(
    x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"], w1: Shaped[Array, "e i hd"],
    s1: Shaped[Array, "e i gd"], w2: Shaped[Array, "e d hi"], s2: Shaped[Array, "e d gi"],
    w3: Shaped[Array, "e i hd"], s3: Shaped[Array, "e i gd"], limit: float, pairs: int | None = None,
) -> Float32[Array, "t d"]:
    """`pallas_kernels.fp4_experts.routed_experts_fp4`'s numbers; `pairs` sizes the tiles as in
    `xla_cpu.moe.expert_tiles`."""
    n_exp = w1.shape[0]
    if few_pairs(ids.size, n_exp):
        return reference(x, ids, weights, w1, s1, w2, s2, w3, s3, limit)
    x32 = x.astype(jnp.float32)
    x32, w1, s1, w3, s3 = after(x32, w1, s1, w3, s3)  # decoded when needed, not all at the step's start

    def expert(v, e):
        h = clamped_swiglu(v @ dequant_fp4(w1[e], s1[e]).T, v @ dequant_fp4(w3[e], s3[e]).T, limit)
        return h @ dequant_fp4(w2[e], s2[e]).T

    return expert_tiles(x32, ids, weights.astype(jnp.float32), n_exp, expert, pairs)


OPS = {"routed_experts_fp4": routed_experts_fp4}
