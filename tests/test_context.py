"""A step's cost follows the live context: the engine reads the first context bucket of each row's block
table that covers its longest row, equals the reference cached path (`Model.step`) across many pages of a long
`max_len`, and a compiled decode step's temporary memory does not grow with `max_len`."""

import dataclasses

import numpy as np
import pytest

from model.config import preset
from serving.core.engine import Engine, context_buckets
from serving.base.kv_cache import CacheLayout, page_bytes
from serving.base.sampling import SamplingParams
from serving.core.step import compile_step, empty_batch
from tests.helpers import random_model

CONFIG = dataclasses.replace(preset("tiny"), max_position_embeddings=65536)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_context_buckets_are_powers_of_two_from_the_least():
    layout = CacheLayout.for_model(CONFIG, 1, 4096, page_tokens=16)  # 256 pages a slot
    assert context_buckets(layout, 64) == (4, 8, 16, 32, 64, 128, 256)
    assert context_buckets(layout, 100) == (7, 14, 28, 56, 112, 224, 256)
    assert context_buckets(layout, 8192) == (256,)


def reference_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and logits by `Model.step`: the prompt in one chunk, then one token at a time."""
    cache = model.init_cache(1, len(prompt) + steps)
    logits, cache = model.step(np.array([prompt]), cache)
    tokens, kept = [], []
    for _ in range(steps):
        kept.append(np.asarray(logits[0, -1]))
        tokens.append(int(np.argmax(kept[-1])))
        logits, cache = model.step(np.array([[tokens[-1]]]), cache)
    return tokens, np.stack(kept)


def test_engine_equals_model_step_across_many_pages():
    model = random_model(CONFIG, seed=3, noise=0.05)
    engine = Engine(model, max_slots=1, max_len=4096, page_tokens=16, prefill_chunk=128, max_prefill_rows=1,
                    context_tokens=128, return_logits=True, prefix_cache=False)
    prompt = np.random.default_rng(4).integers(0, CONFIG.vocab_size, 300).tolist()
    out = engine.generate([prompt], GREEDY)[0]
    tokens, logits = reference_greedy(model, prompt, GREEDY.max_tokens)
    assert out.token_ids == tokens
    np.testing.assert_allclose(np.stack(out.logits), logits, atol=1e-5, rtol=0)
    used = sorted({bucket[3] for bucket in engine.compiled})
    assert used == [8, 16, 32], used  # 19 pages at most: never the 256-page table


def decode_temp_bytes(model, max_len: int, whole_table: bool = False) -> int:
    """Temporary memory of a one-row decode step at the least context bucket (or the whole table)."""
    engine = Engine(model, max_slots=1, max_len=max_len, page_tokens=16, prefix_cache=False)
    batch = empty_batch(engine.layout, 1, 1, pages=None if whole_table else engine.context_pages[0])
    compiled = compile_step(engine._halves.step, engine.weights, engine.cache, batch, 1)
    return compiled.memory_analysis().temp_size_in_bytes


def test_decode_temp_memory_does_not_grow_with_max_len():
    model = random_model(CONFIG, seed=3, noise=0.05)
    short, long = decode_temp_bytes(model, 1024), decode_temp_bytes(model, 65536)
    assert abs(long - short) <= 0.1 * short, (short, long)


def test_decode_step_reads_the_pages_in_place():
    """At a live context of 16384 tokens (the whole block table) a decode step's temporary memory stays below
    one row's compressed entries and index keys: the step never copies a row's paged state (it gathers the picked
    entries, the visible HCA entries and scores the index keys in place, and writes only completed entries)."""
    model = random_model(CONFIG, seed=3, noise=0.05)
    row_state = page_bytes(model.module(), 16) * 16384 // 16
    temp = decode_temp_bytes(model, 16384, whole_table=True)
    assert temp < 0.5 * row_state, (temp, row_state)


def test_kv_cache_memory_sizes_the_pools():
    """Tiny's main layers (0, 4, 16, 4) keep per 16-token page: each CSA layer 4 entries of 32 + 4 index keys
    of 16 floats, the HCA layer one entry of 32: 416 fp32 values."""
    model = random_model(preset("tiny"), seed=0)
    assert page_bytes(model.module(), 16) == 416 * 4
    engine = Engine(model, max_slots=4, max_len=64, page_tokens=16, kv_cache_memory=5 * 416 * 4 + 100)
    assert engine.layout.num_pages == 5
    assert "5 pages of 16 tokens (1664 bytes each), 80 tokens at most" in engine.startup_summary()
    with pytest.raises(ValueError, match="cannot hold even one request"):
        Engine(model, max_slots=4, max_len=64, page_tokens=16, kv_cache_memory=3 * 416 * 4)
