"""Rotary position embedding on the trailing dims of a head, interleaved pairs (2i, 2i+1), with YaRN."""

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from model.config_base import YarnScaling


def inv_frequencies(rope_dim: int, theta: float, yarn: YarnScaling | None) -> np.ndarray:
    """Per-pair angular frequencies [rope_dim/2]; YaRN blends interpolated and original frequencies."""
    base_freq = 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float32) / rope_dim))
    if yarn is None:
        return base_freq.astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep_original = 1 - ramp
    return (base_freq / yarn.factor * ramp + base_freq * keep_original).astype(np.float32)


def layer_frequencies(config, layer: int) -> np.ndarray:
    """Sliding-only layers (compress ratio 0) use plain RoPE at `rope_theta`; layers with a compressed branch
    YaRN at `compress_rope_theta` (V4 and V4.1 configs alike)."""
    if config.compress_ratios[layer] == 0:
        return inv_frequencies(config.qk_rope_head_dim, config.rope_theta, None)
    return inv_frequencies(config.qk_rope_head_dim, config.compress_rope_theta, config.rope_scaling)


def apply_rope(
    x: Float[Array, "*b s h d"], positions: Int[Array, "*pb s"], freqs: Float[Array | np.ndarray, " f"],
    inverse: bool = False,
) -> Float[Array, "*b s h d"]:
    """Rotate the last 2*len(freqs) dims of every head by position*freq (by minus that when `inverse`);
    `positions` broadcast against x's leading dims."""
    rope_dim = 2 * freqs.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)  # [*b, s, rd/2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].astype(jnp.float32)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)
