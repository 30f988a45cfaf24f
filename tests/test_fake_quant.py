"""QAT storage simulation against hand-computed values."""

import jax.numpy as jnp
import numpy as np

from model.fake_quant import e2m1_round, fake_quant_fp4, fake_quant_fp8, pow2_ceil


def test_pow2_ceil():
    np.testing.assert_array_equal(np.asarray(pow2_ceil(jnp.array([1.0, 1.5, 3.0, 4.0, 0.3]))),
                                  [1.0, 2.0, 4.0, 4.0, 0.5])


def test_e2m1_rounding_ties_to_even_codes():
    q = jnp.array([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, -0.75, -2.6])
    np.testing.assert_array_equal(np.asarray(e2m1_round(q)),
                                  [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -3.0])


def test_fp4_ue8m0_block():
    x = jnp.array([[12.0, -3.0, 1.0, 0.4] * 8])  # amax 12 -> scale 2^ceil(log2 2) = 2
    out = np.asarray(fake_quant_fp4(x, 32))
    np.testing.assert_array_equal(out[0, :4], [12.0, -3.0, 1.0, 0.0])  # 0.4/2 = 0.2 -> 0


def test_fp4_e4m3_scale_block():
    x = jnp.array([[7.0, 3.5, -1.0, 0.3] * 4])  # scale = e4m3(7/6) = 1.125 (nearest e4m3 of 1.1667)
    out = np.asarray(fake_quant_fp4(x, 16, e4m3_scales=True))
    np.testing.assert_allclose(out[0, :4], [6 * 1.125, 3 * 1.125, -1 * 1.125, 0.5 * 1.125])  # 0.3/1.125 > 0.25


def test_fp8_block_keeps_e4m3_grid():
    x = jnp.array([[100.0, 0.1, -3.3] + [0.0] * 29])  # amax 100 -> scale 2^ceil(log2(100/448)) = 0.25
    out = np.asarray(fake_quant_fp8(x))
    np.testing.assert_allclose(out[0, :3], [96.0, 0.1015625, -3.25])  # 400 ties 384 / 416 -> even
    assert fake_quant_fp8(jnp.ones((2, 31))).shape == (2, 31)  # unblockable widths pass through
