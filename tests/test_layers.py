"""Layer math against hand-computed values and plain numpy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.attention import window_ids
from pallas_kernels.sparse_attention import sink_attention_reference as sink_attention
from model.compressor import Compressor, Indexer
from model.config import preset
from model.hyper import expand
from model.paged import row_pages, store_windows
from pallas_kernels.hyper import sinkhorn
from model.rope import apply_rope, inv_frequencies


def test_yarn_ramp_matches_the_published_span():
    """V4 compressed layers: rope 64 dims, theta 1.6e5, factor 16, original 65536 -> ramp over pairs 15..25."""
    flash = preset("v4-flash")
    base = 1.0 / 160000.0 ** (np.arange(0, 64, 2) / 64)
    yarn = inv_frequencies(64, 160000.0, flash.rope_scaling)
    ratio = yarn / base
    np.testing.assert_allclose(ratio[:16], 1.0, rtol=1e-6)            # pairs 0..15 keep their frequency
    np.testing.assert_allclose(ratio[25:], 1 / 16, rtol=1e-6)          # pairs 25..31 are interpolated x16
    ramp = (np.arange(16, 25) - 15) / 10                               # linear in between
    np.testing.assert_allclose(ratio[16:25], 1 - ramp + ramp / 16, rtol=1e-5)
    np.testing.assert_allclose(inv_frequencies(64, 10000.0, None), 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64),
                               rtol=1e-6)


def test_rope_rotates_interleaved_pairs_of_the_trailing_dims():
    freqs = np.array([0.5, 0.25], np.float32)
    x = jnp.arange(1.0, 7.0).reshape(1, 1, 1, 6)  # nope dims [1, 2], rope pairs (3, 4), (5, 6)
    out = np.asarray(apply_rope(x, jnp.array([[2]]), freqs))[0, 0, 0]
    a, b = 2 * 0.5, 2 * 0.25
    expected = [1, 2, 3 * math.cos(a) - 4 * math.sin(a), 4 * math.cos(a) + 3 * math.sin(a),
                5 * math.cos(b) - 6 * math.sin(b), 6 * math.cos(b) + 5 * math.sin(b)]
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    back = apply_rope(apply_rope(x, jnp.array([[7]]), freqs), jnp.array([[7]]), freqs, inverse=True)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), rtol=1e-6)


def test_sinkhorn_is_doubly_stochastic():
    logits = jax.random.normal(jax.random.key(0), (5, 4, 4)) * 3
    m = np.asarray(sinkhorn(logits, 20, 1e-6))
    np.testing.assert_allclose(m.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(m.sum(-1), 1.0, atol=5e-3)  # rows converge more slowly


def test_expand_uses_the_transposed_comb():
    streams = jax.random.normal(jax.random.key(1), (1, 1, 3, 2))
    comb = jnp.array([[[[1.0, 2.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]]]])
    out = np.asarray(expand(streams, jnp.zeros((1, 1, 2)), jnp.zeros((1, 1, 3)), comb))[0, 0]
    x = np.asarray(streams)[0, 0]
    np.testing.assert_allclose(out, [x[0], 2 * x[0] + x[1], 3 * x[2]], rtol=1e-6)


def test_sink_attention_equals_dense_numpy():
    rng = np.random.default_rng(0)
    b, c, h, d, n, k = 2, 3, 4, 8, 10, 5
    q, pool = rng.normal(size=(b, c, h, d)), rng.normal(size=(b, n, d))
    ids = rng.integers(0, n, (b, c, k))
    valid = rng.random((b, c, k)) > 0.3
    sink = rng.normal(size=h)
    out = np.asarray(sink_attention(*map(jnp.asarray, (q, pool, ids, valid, sink))))
    for bi in range(b):
        for ci in range(c):
            keys = pool[bi, ids[bi, ci][valid[bi, ci]]]
            for hi in range(h):
                s = keys @ q[bi, ci, hi] / math.sqrt(d)
                e = np.exp(s - max(s.max(initial=-np.inf), sink[hi]))
                denom = e.sum() + np.exp(sink[hi] - max(s.max(initial=-np.inf), sink[hi]))
                np.testing.assert_allclose(out[bi, ci, hi], e @ keys / denom, rtol=1e-5, atol=1e-6)


def test_window_ids_cover_exactly_the_last_w_positions():
    window = 4
    ring_pos = jnp.array([8, 9, 6, 7])  # positions 6..9 in slots (pos % 4)
    ids, ok = (np.asarray(a)[0] for a in window_ids(ring_pos[None], jnp.arange(10, 13), window))
    pool_pos = np.concatenate([np.asarray(ring_pos), np.arange(10, 13)])
    for i, t in enumerate(range(10, 13)):
        assert sorted(pool_pos[ids[i][ok[i]]]) == list(range(t - window + 1, t + 1))


def test_window_ignores_ring_slots_of_rolled_back_positions():
    ring_pos = jnp.array([6, 7, 8, 9, 10, 11])  # 10, 11: speculative tokens, rolled back; the chunk restarts at 10
    ids, ok = (np.asarray(a)[0] for a in window_ids(ring_pos[None], jnp.arange(10, 12), 4))
    pool_pos = np.concatenate([np.asarray(ring_pos), np.arange(10, 12)])
    for i, t in enumerate(range(10, 12)):
        assert sorted(pool_pos[ids[i][ok[i]]]) == list(range(t - 3, t + 1))


def _compressor_reference(x, wkv, wgate, ape, norm_w, eps, ratio, overlap, freqs):
    """Entries of every complete window, straight from the formula (numpy, no state)."""
    kv, gate = x @ wkv.T, x @ wgate.T
    s, d = x.shape[0], wkv.shape[0] // (2 if overlap else 1)
    entries = []
    for w in range(s // ratio):
        rows = slice(w * ratio, (w + 1) * ratio)
        g, v = gate[rows] + ape, kv[rows]
        if overlap:
            prev = slice((w - 1) * ratio, w * ratio)
            ga = gate[prev, :d] + ape[:, :d] if w else np.full((ratio, d), -np.inf)
            va = kv[prev, :d] if w else np.zeros((ratio, d))
            g, v = np.concatenate([ga, g[:, d:]]), np.concatenate([va, v[:, d:]])
        p = np.exp(g - g.max(0))
        p /= p.sum(0)
        e = (p * v).sum(0)
        e = norm_w * e / np.sqrt(np.mean(e * e) + eps)
        ang = w * ratio * freqs
        rd = 2 * len(freqs)
        ev, od = e[-rd:][0::2].copy(), e[-rd:][1::2].copy()
        e[-rd:][0::2], e[-rd:][1::2] = ev * np.cos(ang) - od * np.sin(ang), od * np.cos(ang) + ev * np.sin(ang)
        entries.append(e)
    return np.array(entries)


def feed(comp: Compressor, state: dict, x, start: int, freqs) -> dict:
    """A one-sequence compressor state after chunk `x` at `start`: the windows it completes stored."""
    windows, recent = comp(x, jnp.asarray(start), state, freqs)
    entries = store_windows(state["entries"], windows, jnp.asarray(start), x.shape[1], comp.ratio)
    return {**state, **recent, "entries": entries}


@pytest.mark.parametrize("ratio, overlap", [(4, True), (16, False)])
@pytest.mark.parametrize("chunks", [[37], [5, 1, 1, 9, 3, 18]])
def test_compressor_matches_formula_whole_and_chunked(ratio, overlap, chunks):
    cfg = preset("tiny")
    comp = Compressor(cfg, ratio, 32, overlap, jnp.float32, nnx.Rngs(3))
    comp.ape[...] = jax.random.normal(jax.random.key(4), comp.ape.shape)
    comp.norm.weight[...] = 1 + 0.1 * jax.random.normal(jax.random.key(5), (32,))
    x = jax.random.normal(jax.random.key(6), (1, 37, cfg.hidden_size))
    freqs = inv_frequencies(8, 160000.0, cfg.rope_scaling)
    state, start = comp.init_state(1, 37), 0
    for c in chunks:
        state = feed(comp, state, x[:, start:start + c], start, freqs)
        start += c
    ref = _compressor_reference(np.asarray(x[0], np.float64), *(np.asarray(a, np.float64) for a in (
        comp.wkv.weight[...], comp.wgate.weight[...], comp.ape[...], comp.norm.weight[...])),
        cfg.rms_norm_eps, ratio, overlap, freqs.astype(np.float64))
    np.testing.assert_allclose(np.asarray(state["entries"].pages[0]), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ratio, overlap", [(4, True), (16, False)])
@pytest.mark.parametrize("accepted", [0, 2, 5])
def test_compressor_rolls_back_rejected_tokens(ratio, overlap, accepted):
    """Feed 6 tokens of which only the first `accepted` are the real ones (a verify block with rejected
    drafts), restart after the accepted ones, go on: the entries equal the formula on the real sequence."""
    cfg = preset("tiny")
    comp = Compressor(cfg, ratio, 32, overlap, jnp.float32, nnx.Rngs(3))
    comp.ape[...] = jax.random.normal(jax.random.key(4), comp.ape.shape)
    x = jax.random.normal(jax.random.key(6), (1, 37, cfg.hidden_size))
    junk = jax.random.normal(jax.random.key(7), (1, 6, cfg.hidden_size))
    freqs = inv_frequencies(8, 160000.0, cfg.rope_scaling)
    state = feed(comp, comp.init_state(1, 37, backtrack=6), x[:, :14], 0, freqs)
    block = jnp.concatenate([x[:, 14:14 + accepted], junk[:, accepted:]], axis=1)
    state = feed(comp, state, block, 14, freqs)
    state = feed(comp, state, x[:, 14 + accepted:], 14 + accepted, freqs)
    ref = _compressor_reference(np.asarray(x[0], np.float64), *(np.asarray(a, np.float64) for a in (
        comp.wkv.weight[...], comp.wgate.weight[...], comp.ape[...], comp.norm.weight[...])),
        cfg.rms_norm_eps, ratio, overlap, freqs.astype(np.float64))
    np.testing.assert_allclose(np.asarray(state["entries"].pages[0]), ref, rtol=2e-5, atol=2e-5)


def test_indexer_breaks_ties_towards_lower_entries():
    cfg = preset("tiny")
    idx = Indexer(cfg, jnp.float32, nnx.Rngs(0))
    keys = row_pages(jnp.zeros((1, 6, cfg.index_head_dim)))  # every score exactly 0
    x, q_lat = jnp.ones((1, 1, cfg.hidden_size)), jnp.ones((1, 1, cfg.q_lora_rank))
    freqs = inv_frequencies(8, 160000.0, None)
    picks = np.asarray(idx.select(x, q_lat, jnp.array([23]), keys, freqs))[0, 0]
    assert picks.tolist() == [0, 1, 2, 3]
    picks = np.asarray(idx.select(x, q_lat, jnp.array([9]), keys, freqs))[0, 0]  # only entries 0, 1 visible
    assert picks.tolist() == [0, 1, -1, -1]
