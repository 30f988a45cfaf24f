"""DeepSeek-V4 FP8 / FP4 weight formats: hand-computed decodes, round trips, shape errors."""

import ml_dtypes
import numpy as np
import pytest

from model.quant import (
    dequant_fp4_packed,
    dequant_fp8_blocks,
    e8m0_to_float,
    quantize_fp4_packed,
    quantize_fp8_blocks,
)


def e8m0(byte_values) -> np.ndarray:
    return np.array(byte_values, np.uint8).view(ml_dtypes.float8_e8m0fnu)


def test_e8m0_to_float_is_two_to_the_byte_minus_127():
    got = e8m0_to_float(e8m0([0, 100, 126, 127, 128, 130]))
    np.testing.assert_array_equal(got, np.float32([2.0**-127, 2.0**-27, 0.5, 1.0, 2.0, 8.0]))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(e8m0_to_float(np.uint8([129])), [4.0])
    with pytest.raises(TypeError, match="float32"):
        e8m0_to_float(np.float32([1.0]))


# ---- FP4 ------------------------------------------------------------------------------------

def test_fp4_hand_built_2x4():
    # Byte 0x21: low nibble 0x1 (+0.5) is column 0, high nibble 0x2 (+1.0) is column 1.
    # Byte 0xF9: low 0x9 (-0.5) -> column 2, high 0xF (-6.0) -> column 3.     Row scale 2^(128-127) = 2.
    # Byte 0x7C: low 0xC (-2.0) -> column 0, high 0x7 (+6.0) -> column 1.
    # Byte 0x35: low 0x5 (+3.0) -> column 2, high 0x3 (+1.5) -> column 3.     Row scale 2^(126-127) = 0.5.
    packed = np.array([[0x21, 0xF9], [0x7C, 0x35]], np.uint8)
    scale = e8m0([[128], [126]])  # 4 columns < 32: one (partial) group per row
    expected = np.float32([[1.0, 2.0, -1.0, -12.0],
                           [-1.0, 3.0, 1.5, 0.75]])
    for as_dtype in (np.uint8, np.int8):
        got = dequant_fp4_packed(packed.view(as_dtype), scale)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected)


def test_fp4_scale_group_boundary():
    packed = np.full((1, 32), 0x22, np.uint8)  # every element is code 0x2 = +1.0
    got = dequant_fp4_packed(packed, e8m0([[127, 130]]))
    np.testing.assert_array_equal(got[0, :32], 1.0)
    np.testing.assert_array_equal(got[0, 32:], 8.0)


def test_fp4_quantize_puts_even_column_in_low_nibble():
    packed, scale = quantize_fp4_packed(np.float32([[1.0, 6.0, -0.5, 3.0]]))
    assert packed.dtype == np.int8 and scale.dtype == ml_dtypes.float8_e8m0fnu
    assert scale.view(np.uint8).tolist() == [[127]]  # max 6 / 6 = 1
    assert packed.view(np.uint8).tolist() == [[0x72, 0x59]]  # 1.0 = 0x2 low, 6.0 = 0x7 high; -0.5 = 0x9, 3.0 = 0x5


def test_fp4_grid_values_round_trip_exactly():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(8, 64))
    codes[:, ::32] = 7  # a +6.0 in each group pins the scale to the chosen power of two
    exps = rng.integers(-5, 6, size=(8, 2))
    w = np.float32([0, .5, 1, 1.5, 2, 3, 4, 6] * 2)[codes] * np.where(codes >= 8, -1, 1)
    w = (w * np.repeat(2.0**exps, 32, axis=1)).astype(np.float32)
    packed, scale = quantize_fp4_packed(w)
    np.testing.assert_array_equal(scale.view(np.uint8), exps + 127)
    np.testing.assert_array_equal(dequant_fp4_packed(packed, scale), w)


def test_fp4_round_trip_error_bound():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((16, 96)) * np.repeat(10.0 ** rng.uniform(-3, 3, (16, 3)), 32, axis=1)).astype(np.float32)
    packed, scale = quantize_fp4_packed(w)
    assert packed.shape == (16, 48) and scale.shape == (16, 3)
    s = np.repeat(e8m0_to_float(scale), 32, axis=1)
    amax = np.abs(w).reshape(16, 3, 32).max(axis=-1)
    ratio = amax / e8m0_to_float(scale)
    assert np.all((ratio > 3) & (ratio <= 6))  # the smallest power of two that fits
    err = np.abs(dequant_fp4_packed(packed, scale) - w)
    # E2M1 spacing is 0.5 below 2, 1 below 4 and 2 up to 6: half of it is <= max(|q|, 1) / 4.
    assert np.all(err <= np.maximum(np.abs(w), s) / 4)


def test_fp4_wrong_scale_shape():
    packed = np.zeros((4, 32), np.int8)  # 64 inputs -> 2 groups of 32
    with pytest.raises(ValueError, match=r"expected scale of shape \(4, 2\), got \(4, 1\)"):
        dequant_fp4_packed(packed, e8m0(np.full((4, 1), 127)))
    with pytest.raises(ValueError, match="even number of columns"):
        quantize_fp4_packed(np.zeros((2, 3), np.float32))


# ---- FP8 ------------------------------------------------------------------------------------

def test_fp8_hand_built_130x260():
    # 130x260 with 128x128 blocks: a 2x3 grid whose last row and column of blocks are partial.
    scale = e8m0([[127, 128, 129],     # 1, 2, 4
                  [120, 131, 100]])    # 2^-7, 16, 2^-27
    w = np.zeros((130, 260), np.float32)
    picks = {  # (row, col): (e4m3 value, expected decoded value)
        (0, 0): (1.5, 1.5),
        (127, 255): (-3.0, -6.0),         # block (0, 1), scale 2
        (5, 256): (2.25, 9.0),            # block (0, 2), scale 4
        (128, 0): (0.5, 2.0**-8),         # block (1, 0), scale 2^-7
        (128, 130): (-0.875, -14.0),      # block (1, 1), scale 16
        (129, 259): (448.0, 448 * 2.0**-27),  # block (1, 2), scale 2^-27, last element
    }
    for (i, j), (v, _) in picks.items():
        w[i, j] = v
    got = dequant_fp8_blocks(w.astype(ml_dtypes.float8_e4m3fn), scale)
    assert got.dtype == np.float32 and got.shape == (130, 260)
    for (i, j), (_, expected) in picks.items():
        assert got[i, j] == np.float32(expected), (i, j)
    assert np.count_nonzero(got) == len(picks)


def test_fp8_round_trip_error_bound():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((130, 260)) * np.repeat(np.repeat(10.0 ** rng.uniform(-4, 4, (2, 3)), 128, 0), 128, 1)[:130, :260]
    w = w.astype(np.float32)
    w[128:, 256:] = 0  # an all-zero (partial) block
    q, scale = quantize_fp8_blocks(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == ml_dtypes.float8_e8m0fnu and scale.shape == (2, 3)
    s = e8m0_to_float(scale)
    for bi, bj in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        ratio = np.abs(w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]).max() / s[bi, bj]
        assert 224 < ratio <= 448
    back = dequant_fp8_blocks(q, scale)
    full_s = np.repeat(np.repeat(s, 128, 0), 128, 1)[:130, :260]
    # e4m3 keeps 3 mantissa bits (relative error <= 2^-4); below 2^-6 it is subnormal, step 2^-9.
    assert np.all(np.abs(back - w) <= np.maximum(np.abs(w) * 2.0**-4, full_s * 2.0**-10))
    np.testing.assert_array_equal(back[128:, 256:], 0)


def test_fp8_wrong_scale_shape():
    w = np.zeros((130, 260), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected scale of shape \(2, 3\), got \(1, 2\)"):
        dequant_fp8_blocks(w, e8m0(np.full((1, 2), 127)))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequant_fp8_blocks(np.zeros((4, 4), np.float32), e8m0([[127]]))
