"""The compiled step's verify-length buckets: a row sampled at its last v positions, against the plain model."""

import jax
import numpy as np
import pytest

from model.config import preset
from serving.kv_cache import CacheLayout, PageAllocator, init_engine_cache
from serving.sampling import SamplingBatch, SamplingParams
from serving.step import COUNTED, DRAFT, PROMPT, build_step, empty_batch
from tests.helpers import random_model

CONFIG = preset("tiny")
PENALTY = -2.0  # a frequency *bonus*: drafted tokens win the later positions, so miscounting shows


@pytest.fixture(scope="module")
def setup():
    model = random_model(CONFIG, seed=5, noise=0.05)
    layout = CacheLayout.for_model(CONFIG, max_slots=2, max_len=64, page_tokens=16)
    module = model.module()
    empty = module.init_cache(1, layout.pages_per_slot * layout.page_tokens, layout.ring)["layers"]
    step = jax.jit(build_step(model.graphdef, jax.tree.structure(model.params), empty, layout.page_tokens, 2,
                              True), donate_argnums=1)
    pages = PageAllocator(layout)
    pages.grow(0, layout.max_len)
    return model, layout, step, jax.tree.leaves(model.params), pages.table(0)


def _row(layout, table, width, verify, tokens, kinds, start, params, **flags):
    batch = empty_batch(layout, 1, width, verify)
    n = len(tokens)
    batch.tokens[0, :n], batch.kinds[0, :n] = tokens, kinds
    batch.slots[0], batch.starts[0], batch.counts[0], batch.block_tables[0] = 0, start, n, table
    batch.sample[0, verify - min(verify, n):] = True
    batch.reset[0], batch.from_prev[0] = flags.get("reset", False), flags.get("from_prev", False)
    return batch._replace(sampling=SamplingBatch.from_params([params], 1))


@pytest.mark.parametrize("draft", [3, 7, 30])
def test_verify_bucket_samples_every_position_with_drafts_counted(setup, draft):
    """Prefill (v = 1), then a verify row [last token, d, d, d] (v = 4) with a frequency penalty: its logits
    equal the plain model's at those positions, and its greedy token at position j is the argmax of the logits
    penalised by the outputs so far, the drafts before j included."""
    model, layout, step, weights, table = setup
    prompt = np.random.default_rng(draft).integers(0, CONFIG.vocab_size, 11).tolist()
    params = SamplingParams(temperature=0.0, frequency_penalty=PENALTY, seed=0)
    cache = init_engine_cache(model.module(), layout)
    out, cache = step(weights, cache, _row(layout, table, 16, 1, prompt, [PROMPT] * 11, 0, params, reset=True))
    first = int(out.tokens[0, -1])
    block = [first, draft, draft, draft]
    out, cache = step(weights, cache, _row(layout, table, 4, 4, [0, draft, draft, draft],
                                           [COUNTED, DRAFT, DRAFT, DRAFT], 11, params, from_prev=True))

    expected_logits = np.asarray(model.logits(np.array([prompt + block])))[0, 11 + np.arange(4)]
    got = np.asarray(out.logits[0])
    np.testing.assert_allclose(got, expected_logits, rtol=1e-4, atol=1e-4)
    counts = np.zeros((4, CONFIG.vocab_size))
    counts[:, first] += 1
    counts[np.arange(4), draft] += np.arange(4)  # drafts at row positions 1..j precede position j's token
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), np.argmax(got - PENALTY * counts, axis=-1))
    assert int(out.tokens[0, 3]) == draft  # three drafts before the last position: a bonus of 6
