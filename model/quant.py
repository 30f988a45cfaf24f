"""DeepSeek-V4 checkpoint quantisation formats, decoded (and encoded) on the host with numpy.

FP8 weights: float8_e4m3fn values, one UE8M0 scale per 128x128 block.
FP4 routed experts: int8 bytes holding two E2M1 codes each, one UE8M0 scale per 32 inputs of a row.
UE8M0 (float8_e8m0fnu) is an exponent-only byte: the scale is 2^(byte - 127).
"""

import ml_dtypes
import numpy as np
from jaxtyping import Float, Float32, Int8, Shaped, UInt8

E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E2M1_MAGNITUDES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
E2M1_VALUES = np.concatenate([_E2M1_MAGNITUDES, -_E2M1_MAGNITUDES])  # 4-bit code -> value; 0x8 is the sign


def e8m0_to_float(scale: Shaped[np.ndarray, "*dims"]) -> Float32[np.ndarray, "*dims"]:
    """Decode UE8M0 scales (float8_e8m0fnu, or their raw uint8 bytes) to float32 2^(byte - 127)."""
    if scale.dtype == np.uint8:
        scale = scale.view(ml_dtypes.float8_e8m0fnu)
    if scale.dtype != ml_dtypes.float8_e8m0fnu:
        raise TypeError(f"a UE8M0 scale must be float8_e8m0fnu or uint8, got {scale.dtype}")
    return scale.astype(np.float32)


def dequant_fp8_blocks(
    w: Shaped[np.ndarray, "rows cols"],
    scale: Shaped[np.ndarray, "row_blocks col_blocks"],
    block: tuple[int, int] = (128, 128),
) -> Float32[np.ndarray, "rows cols"]:
    """Decode a block-scaled FP8 weight to float32: float(w[i, j]) * scale[i // 128, j // 128]."""
    if w.dtype != ml_dtypes.float8_e4m3fn or w.ndim != 2:
        raise TypeError(f"an FP8 weight must be a 2-D float8_e4m3fn array, got {w.dtype} {w.shape}")
    _check_scale_shape(scale, _num_blocks(w.shape, block), f"FP8 weight {w.shape} with block {block}")
    return w.astype(np.float32) * _expand(e8m0_to_float(scale), block, w.shape)


def dequant_fp4_packed(
    packed: Int8[np.ndarray, "rows half"] | UInt8[np.ndarray, "rows half"],
    scale: Shaped[np.ndarray, "rows groups"],
    block: int = 32,
) -> Float32[np.ndarray, "rows cols"]:
    """Decode packed FP4 (E2M1) expert weights, two per byte, with one UE8M0 scale per `block` inputs."""
    if packed.dtype not in (np.int8, np.uint8) or packed.ndim != 2:
        raise TypeError(f"packed FP4 weights must be a 2-D int8 or uint8 array, got {packed.dtype} {packed.shape}")
    shape = (packed.shape[0], 2 * packed.shape[1])
    _check_scale_shape(scale, _num_blocks(shape, (1, block)), f"FP4 weight {shape} with block {block}")
    # Input column 2k is the LOW nibble of byte k and column 2k + 1 the HIGH nibble. Source:
    # huggingface.co/deepseek-ai/DeepSeek-V4-Flash, inference/convert.py, cast_e2m1fn_to_e4m3fn,
    # which views the int8 weight as uint8 and stacks FP4_TABLE[x & 0x0F] before FP4_TABLE[x >> 4]
    # along the input dimension (the same order as torch.float4_e2m1fn_x2 and OCP MXFP4).
    raw = packed.view(np.uint8)
    codes = np.empty(shape, np.uint8)
    codes[:, 0::2] = raw & 0x0F
    codes[:, 1::2] = raw >> 4
    return E2M1_VALUES[codes] * _expand(e8m0_to_float(scale), (1, block), shape)


def quantize_fp8_blocks(
    w_f32: Float[np.ndarray, "rows cols"], block: tuple[int, int] = (128, 128)
) -> tuple[Shaped[np.ndarray, "rows cols"], Shaped[np.ndarray, "row_blocks col_blocks"]]:
    """Encode a weight as DeepSeek block FP8 (e4m3fn values, UE8M0 scales) for test and checkpoint writing."""
    w = _finite_matrix(w_f32)
    scale = _pow2_scales(_block_amax(w, block), E4M3_MAX)
    q = w / _expand(e8m0_to_float(scale), block, w.shape)
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def quantize_fp4_packed(
    w_f32: Float[np.ndarray, "rows cols"], block: int = 32
) -> tuple[Int8[np.ndarray, "rows half"], Shaped[np.ndarray, "rows groups"]]:
    """Encode a weight as DeepSeek packed FP4 (E2M1 pairs in int8, UE8M0 scales) for test and checkpoint writing."""
    w = _finite_matrix(w_f32)
    if w.shape[1] % 2:
        raise ValueError(f"packed FP4 needs an even number of columns, got shape {w.shape}")
    scale = _pow2_scales(_block_amax(w, (1, block)), E2M1_MAX)
    q = (w / _expand(e8m0_to_float(scale), (1, block), w.shape)).astype(ml_dtypes.float4_e2m1fn)
    codes = q.view(np.uint8) & 0x0F  # ml_dtypes keeps the 4-bit code in the low bits of a byte
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8), scale


def _finite_matrix(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("cannot quantise a weight containing inf or NaN")
    return w


def _num_blocks(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _check_scale_shape(scale: np.ndarray, expected: tuple[int, int], what: str) -> None:
    if scale.shape != expected:
        raise ValueError(f"{what}: expected scale of shape {expected}, got {scale.shape}")


def _expand(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, ...]) -> np.ndarray:
    """Broadcast a per-block scale to every element of a `shape` matrix (last blocks may be partial)."""
    return np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[: shape[0], : shape[1]]


def _block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    rows, cols = _num_blocks(w.shape, block)
    padded = np.zeros((rows * block[0], cols * block[1]), np.float32)
    padded[: w.shape[0], : w.shape[1]] = np.abs(w)
    return padded.reshape(rows, block[0], cols, block[1]).max(axis=(1, 3))


def _pow2_scales(amax: np.ndarray, qmax: float) -> np.ndarray:
    """UE8M0 scales: the smallest power of two s with amax / s <= qmax (2^-127 for an all-zero block)."""
    mantissa, exponent = np.frexp(amax.astype(np.float64) / qmax)  # ratio = mantissa * 2^exponent
    exponent = np.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power of two needs no rounding up
    exponent = np.where(amax == 0, -127, exponent)
    return (np.clip(exponent, -127, 127) + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
