"""Quantise-dequantise of activations into the storage formats DeepSeek-V4.1 caches use (QAT simulation).

FP8 window KV: e4m3 with one power-of-two (UE8M0) scale per 32 channels. FP4 latents: e2m1 with one e4m3
scale per 16 channels. FP4 indexer q / k: e2m1 with one UE8M0 scale per 32 channels. Semantics follow the
reference's quantisers as transcribed by transformers' V4.1 model (huggingface/transformers
`models/deepseek_v41/modular_deepseek_v41.py`, `_fake_quant_fp8_block` / `_fake_quant_fp4_block`).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

FP8_MAX, FP4_MAX = 448.0, 6.0
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)  # numpy: importing starts no backend
# midpoints between e2m1 magnitudes; a tie rounds to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, ...)
_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_TIE_ROUNDS_UP = np.array([False, True, False, True, False, True, False])


def pow2_ceil(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """2^ceil(log2 x) for positive normal fp32 x, exact (from the exponent and mantissa bits)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jnp.exp2(exponent.astype(jnp.float32))


def _blocks(x, block: int):
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fake_quant_fp8(x: Float[Array, "... n"], block: int = 32) -> Float[Array, "... n"]:
    """Round each block of `block` channels to e4m3 under a power-of-two scale (unchanged if n % block)."""
    if x.shape[-1] % block:
        return x
    blocks = _blocks(x, block)
    scale = pow2_ceil(jnp.maximum(jnp.max(jnp.abs(blocks), -1, keepdims=True), 1e-4) / FP8_MAX)
    q = jnp.clip(blocks / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (q * scale).reshape(x.shape).astype(x.dtype)


def e2m1_round(q: Float[Array, "..."]) -> Float[Array, "..."]:
    """Nearest e2m1 value of pre-clipped q (ties to the even code)."""
    mag = jnp.abs(q)[..., None]
    above = jnp.where(_TIE_ROUNDS_UP, mag >= _MIDPOINTS, mag > _MIDPOINTS)
    return jnp.sign(q) * jnp.asarray(_E2M1)[jnp.sum(above, axis=-1)]


def fake_quant_fp4(x: Float[Array, "... n"], block: int, e4m3_scales: bool = False) -> Float[Array, "... n"]:
    """Round each block to e2m1 under a UE8M0 (power-of-two) or e4m3 scale (unchanged if n % block)."""
    if x.shape[-1] % block:
        return x
    blocks = _blocks(x, block)
    amax = jnp.max(jnp.abs(blocks), -1, keepdims=True)
    if e4m3_scales:
        scale = (jnp.maximum(amax, FP4_MAX * 2.0**-9) / FP4_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        scale = pow2_ceil(jnp.maximum(amax, FP4_MAX * 2.0**-126) / FP4_MAX)
    q = e2m1_round(jnp.clip(blocks / scale, -FP4_MAX, FP4_MAX))
    return (q * scale).reshape(x.shape).astype(x.dtype)
