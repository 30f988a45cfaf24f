"""The reference cached path (chunked prefill, then one token at a time) equals the full-sequence forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import preset
from tests.helpers import random_model
from tests.typecheck import unchecked

# HCA ratio 16 and CSA ratio 4 with an 8-token window: 80 tokens close 20 CSA and 5 HCA windows
CONFIG = dataclasses.replace(preset("tiny"), compress_ratios=(0, 4, 16, 4, 0))


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=11)


@pytest.mark.parametrize("prefill_chunks", [[23, 9, 16], [1, 2, 3, 47], [48]])
def test_chunked_prefill_then_decode_equals_full_forward(model, prefill_chunks):
    tokens = np.random.default_rng(5).integers(0, CONFIG.vocab_size, (2, 80))
    full = np.asarray(model.logits(tokens))
    cache, start, pieces = model.init_cache(2, 80), 0, []
    for size in prefill_chunks + [1] * (80 - sum(prefill_chunks)):  # >= 32 decode steps
        logits, cache = model.step(tokens[:, start:start + size], cache)
        pieces.append(np.asarray(logits))
        start += size
    assert int(cache["pos"]) == 80
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)


def test_step_rejects_overflow_and_bad_tokens(model):
    cache = model.init_cache(1, 8)
    with pytest.raises(ValueError, match="cache holds 8 tokens"):
        model.step(np.zeros((1, 9), np.int32), cache)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        model.logits(np.array([[1, 256]]))
    with pytest.raises(ValueError, match="shape \\[batch, seq\\]"), unchecked():
        model.logits(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="does not match the cache's batch"):
        model.step(np.zeros((2, 1), np.int32), cache)


def test_mtp_block_cached_equals_whole(model):
    """The MTP block runs through the same cached attention: per-token steps equal one whole chunk."""
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, CONFIG.vocab_size, (1, 41)))

    @jax.jit
    def main_then_mtp(params, chunk, next_chunk, cache):
        module = nnx.merge(model.graphdef, params)
        streams, cache = module.streams(chunk, cache)
        return module.mtp_logits(streams, next_chunk, cache)

    whole, _ = main_then_mtp(model.params, tokens[:, :40], tokens[:, 1:41], model.module().init_cache(1, 40))
    cache, pieces = model.module().init_cache(1, 40), []
    for t in range(40):
        logits, cache = main_then_mtp(model.params, tokens[:, t:t + 1], tokens[:, t + 1:t + 2], cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), np.asarray(whole), atol=1e-5, rtol=0)


@pytest.mark.parametrize("accepted", [0, 3, 6])
def test_rolling_back_rejected_drafts_keeps_the_cache_exact(model, accepted):
    """A verify block of 6 tokens of which only the first `accepted` are the real continuation, then a restart
    at the first rejected position (window ring and compressors sized for 6 tokens of backtracking): every
    later logit equals the full forward of the real sequence."""
    tokens = np.random.default_rng(6).integers(0, CONFIG.vocab_size, (1, 80))
    junk = np.random.default_rng(7).integers(0, CONFIG.vocab_size, (1, 6))
    full = np.asarray(model.logits(tokens))
    cache = {**model.module().init_cache(1, 80, ring=CONFIG.sliding_window + 6),
             "capacity": jnp.asarray(80, jnp.int32)}
    _, cache = model.step(tokens[:, :30], cache)
    block = np.concatenate([tokens[:, 30:30 + accepted], junk[:, accepted:]], axis=1)
    logits, cache = model.step(block, cache)
    np.testing.assert_allclose(np.asarray(logits)[:, :accepted], full[:, 30:30 + accepted], atol=1e-5, rtol=0)
    cache = {**cache, "pos": jnp.asarray(30 + accepted, jnp.int32)}
    pieces = []
    for start in range(30 + accepted, 80, 5):
        logits, cache = model.step(tokens[:, start:start + 5], cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full[:, 30 + accepted:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["tiny", "tiny-v41"])
def test_logits_at_chosen_positions_are_those_of_the_full_forward(model, name):
    """`at` projects only the chosen chunk offsets onto the vocabulary (the engine's step asks for the verify
    positions alone): the same numbers as the gathered logits of every position."""
    m = model if name == "tiny" else random_model(preset(name), seed=2)
    module = m.module()
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, m.config.vocab_size, (2, 12)), jnp.int32)
    extra = {"engram_rows": m.engram.lookup(np.asarray(tokens), m.engram.empty_history(2))[0]} if m.engram else {}
    at = jnp.array([[11, 3, 3], [0, 7, 10]], jnp.int32)
    full = module(tokens, module.init_cache(2, 12), **extra)[0]
    picked = module(tokens, module.init_cache(2, 12), at=at, **extra)[0]
    assert picked.shape == (2, 3, m.config.vocab_size)
    np.testing.assert_allclose(picked, np.take_along_axis(np.asarray(full), np.asarray(at)[:, :, None], axis=1),
                               atol=1e-5, rtol=0)
