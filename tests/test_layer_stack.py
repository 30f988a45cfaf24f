"""Stacked layers (`model.layer_stack`): runs of repeats found as by hand, and a stacked model gives the numbers of
the same model unstacked (the reference: itself checked against the oracle and the cached path) through the full
forward, the cached path, the taps a drafter reads, and the engine (paged pools, preemption, a prefix-cache hit);
unstacking, the checkpoint names and the stored form give back the unstacked model's."""

import dataclasses

import jax
import numpy as np
import pytest

from model.checkpoint import to_native, to_stored
from model.config import CSA_RATIO, preset
from model.layer_stack import LayerStack, is_stacked, layer_runs, stack_layers, unstack_layers
from serving.engine import Engine
from serving.sampling import SamplingParams
from tests.helpers import greedy_full_forward, random_model

# a sliding hash layer, (CSA, HCA) twice, a sliding layer; MTP: one sliding layer
CONFIG = dataclasses.replace(preset("tiny"), num_hidden_layers=6, compress_ratios=(0, 4, 16, 4, 16, 0, 0))
RNG = np.random.default_rng(2)
PROMPTS = [RNG.integers(0, CONFIG.vocab_size, n).tolist() for n in (5, 23, 40)]


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=11, noise=0.05)


@pytest.fixture(scope="module")
def stacked(model):
    return stack_layers(model)


def test_runs_take_the_longest_repeats():
    assert layer_runs(list("ssabababc")) == [(0, 1, 2), (2, 2, 3), (8, 1, 1)]
    assert layer_runs(list("abcabcab")) == [(0, 3, 2), (6, 1, 1), (7, 1, 1)]
    flash = preset("v4-flash")  # 2 sliding + 1 CSA hash layers, then (HCA, CSA) x 20 to layer 42
    keys = [(flash.compress_ratios[i], flash.is_hash_layer(i)) for i in range(flash.num_hidden_layers)]
    assert keys[2] == (CSA_RATIO, True) and keys[3] == (128, False)
    assert layer_runs(keys) == [(0, 1, 2), (2, 1, 1), (3, 2, 20)]


def test_stacked_structure(stacked):
    kinds = [type(entry).__name__ for entry in stacked.module().layers]
    assert kinds == ["Block", "LayerStack", "Block"] and is_stacked(stacked)
    stack = stacked.module().layers[1]
    assert isinstance(stack, LayerStack) and stack.repeats == 2 and stack.depth == 4
    assert stack.blocks[0].attn.wq_a.weight.shape[0] == 2


def test_forward_cached_path_and_taps_equal_the_unstacked_model(model, stacked):
    tokens = RNG.integers(0, CONFIG.vocab_size, (2, 40))
    np.testing.assert_array_equal(stacked.logits(tokens), model.logits(tokens))
    caches = model.init_cache(2, 40), stacked.init_cache(2, 40)
    for lo, hi in [(0, 14), (14, 15)]:
        (a, cache_a), (b, cache_b) = (m.step(tokens[:, lo:hi], c) for m, c in zip((model, stacked), caches))
        caches = cache_a, cache_b
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)
    collect = (0, 2, 3, 5)  # unstacked, two inside the stack (different repeats and blocks), unstacked
    taps = [m.module().streams(jax.numpy.asarray(tokens), m.init_cache(2, 40), collect=collect)[2]
            for m in (model, stacked)]
    np.testing.assert_allclose(taps[1], taps[0], atol=2e-5, rtol=0)


def test_unstacking_and_checkpoint_names_give_back_the_model(model, stacked):
    back = unstack_layers(stacked)
    assert not is_stacked(back)
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(a, b)
    native, want = to_native(stacked), to_native(model)
    assert native.keys() == want.keys()
    assert all(np.array_equal(native[k], want[k]) for k in want)


def test_stored_form_stays_stacked_and_quantizes_every_layer(model, stacked):
    stored = to_stored(stacked)
    assert is_stacked(stored)
    want = to_native(to_stored(model))
    got = to_native(stored)
    assert got.keys() == want.keys() and any(v.dtype.itemsize == 1 for v in want.values())
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_engine_on_a_stacked_model_gives_the_full_forwards_tokens(model, stacked):
    """3 requests in 2 slots over 5 pages of 16 tokens (preemption), then the longest prompt again (a hit)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = greedy_full_forward(model, PROMPTS, 8)
    engine = Engine(stacked, max_slots=2, max_len=64, num_pages=5, page_tokens=16, prefill_chunk=16,
                    return_logits=True, prefix_cache=True)
    outputs = engine.generate(PROMPTS, greedy) + engine.generate(PROMPTS[2:], greedy)
    assert engine.prefix_cache_metrics()["hit_tokens"] > 0
    for out, (tokens, logits) in zip(outputs, reference + reference[2:]):
        assert out.token_ids == tokens
        np.testing.assert_allclose(np.stack(out.logits), logits, atol=2e-5, rtol=0)


def test_unsupported_uses_are_refused_by_name(stacked):
    with pytest.raises(ValueError, match="V4 models"):
        stack_layers(random_model(preset("tiny-v41")))
    with pytest.raises(ValueError, match="stacked layers"):
        Engine(stacked, max_slots=2, max_len=64, mesh="dp=1")
