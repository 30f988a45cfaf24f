"""Prefix caching in the engine (`serving.prefix_admission`): a hit gives the tokens and logits of a cold run of the
same prompt (tiny V4 and a 6-layer tiny V4.1, exact replay) while prefilling fewer tokens, concurrent hits share
pages, eviction and the host-memory tier keep results correct, and every page comes back once the cache is
cleared.

The reference is the same engine's cold run of each prompt (nothing cached; the cold path itself is checked
against the model in test_engine). A replay shorter than the exact one must change the logits, so the comparison
can fail. The tiny V4 engine has test_engine's shapes, so its steps come from the suite's compilation cache."""

import dataclasses
import types

import numpy as np
import pytest

from model.config import preset
from serving.engine import Engine
from serving.sampling import SamplingParams
from tests.helpers import random_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
RNG = np.random.default_rng(5)
V41 = dataclasses.replace(preset("tiny-v41"), num_hidden_layers=6, compress_ratios=(0, 2, 2, 1, 1, 1),
                          kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5), candidate_source_layer_id=3)


def prompts(vocab: int, length: int, shared: tuple[int, ...]) -> tuple[list[int], list[list[int]]]:
    """A random prompt A of `length` tokens and, per entry of `shared`, one of the same length sharing that many."""
    a = RNG.integers(0, vocab, length).tolist()
    return a, [a[:n] + RNG.integers(0, vocab, length - n).tolist() for n in shared]


@pytest.fixture(scope="module")
def tiny():
    """test_engine's engine (4 slots, 64 tokens, pages of 16: exact replay 37) with a host tier; A of 58 tokens,
    B and B2 sharing its first 50 and 49 (hits of 48), four unrelated prompts, and their cold runs."""
    model = random_model(preset("tiny"), seed=11, noise=0.05)
    engine = Engine(model, max_slots=4, max_len=64, page_tokens=16, prefill_chunk=16, max_prefill_rows=2,
                    num_top_logprobs=2, return_logits=True, host_pages=64)
    a, (b, b2) = prompts(model.config.vocab_size, 58, (50, 49))
    others = [RNG.integers(0, model.config.vocab_size, 58).tolist() for _ in range(4)]
    fresh(engine)
    cold = engine.generate([b, b2], GREEDY)  # admitted together: each caches its pages only after its prefill
    fresh(engine)
    cold_others = engine.generate(others, GREEDY)
    assert engine.prefix_cache_metrics()["hit_tokens"] == 0
    return types.SimpleNamespace(engine=engine, model=model, a=a, b=b, b2=b2, others=others, cold=cold,
                                 cold_others=cold_others)


def fresh(engine) -> None:
    """Nothing cached (device tree and host tier)."""
    engine.scheduler.prefix.clear()
    engine.scheduler.prefix.host.pages.clear()


def same(out, ref, atol=1e-4):
    assert out.token_ids == ref.token_ids
    np.testing.assert_allclose(np.stack(out.logits), np.stack(ref.logits), atol=atol, rtol=0)


def test_hits_equal_cold_runs_and_share_pages(tiny):
    engine, prefix, pages = tiny.engine, tiny.engine.scheduler.prefix, tiny.engine.scheduler.pages
    fresh(engine)
    engine.generate([tiny.a], GREEDY)
    before, prefilled = prefix.metrics(), engine.stats["prefill_tokens"]
    ids = [engine.add_request(p, GREEDY) for p in (tiny.b, tiny.b2)]
    engine.step()  # both admitted: they adopt A's first 3 pages
    shared = prefix.held[ids[0]].pages
    assert len(shared) == 3 and prefix.held[ids[1]].pages == shared
    assert [pages.refs[p] for p in shared] == [3, 3, 3]  # the tree, B and B2
    results = engine.run()
    for rid, ref in zip(ids, tiny.cold):
        same(results[rid], ref)
    assert prefix.metrics()["hit_tokens"] - before["hit_tokens"] == 2 * 48
    replayed = 2 * (58 - 48 + prefix.replay)  # each prefills from 48 - 37 = 11 on
    assert engine.stats["prefill_tokens"] - prefilled == replayed < 2 * 58
    exact = prefix.replay
    prefix.replay = engine.layout.ring  # the approximate replay: its windows miss keys, so the logits move
    try:
        out = engine.generate([tiny.b], GREEDY)[0]
    finally:
        prefix.replay = exact
    assert np.abs(np.stack(out.logits) - np.stack(tiny.cold[0].logits)).max() > 1e-3


def test_eviction_and_host_tier_keep_results_and_pages_come_back(tiny):
    engine, prefix, pages = tiny.engine, tiny.engine.scheduler.prefix, tiny.engine.scheduler.pages
    fresh(engine)
    engine.generate([tiny.a], GREEDY)  # A's 3 full pages cached
    evicted = prefix.metrics()["evicted_blocks"]
    for out, ref in zip(engine.generate(tiny.others, GREEDY), tiny.cold_others):  # they need all 16 pages
        same(out, ref)
    assert prefix.metrics()["evicted_blocks"] - evicted >= 3 and prefix.host.stored >= 3
    restored, hits = prefix.host.restored, prefix.metrics()["hit_tokens"]
    same(engine.generate([tiny.b], GREEDY)[0], tiny.cold[0])  # A's evicted pages come back from host memory
    assert prefix.host.restored - restored == 3 and prefix.metrics()["hit_tokens"] - hits == 48
    prefix.clear()
    assert len(pages.free) == engine.layout.num_pages and not any(pages.refs)  # no leaks


def test_v41_hit_equals_cold_run():
    """V4.1: shared entries and index keys of the KV sources, Engram history rebuilt on the host."""
    model = random_model(V41, seed=3, noise=0.05)
    engine = Engine(model, max_slots=1, max_len=160, prefill_chunk=32, max_prefill_rows=1, batch_invariant=True,
                    prefix_cache=True, return_logits=True)
    assert engine.layout.page_tokens == 64 and engine.scheduler.prefix.replay == 8 + 5 * 7
    a, (b,) = prompts(V41.vocab_size, 150, (140,))
    cold = engine.generate([b], GREEDY)[0]
    fresh(engine)
    engine.generate([a], GREEDY)
    prefilled = engine.stats["prefill_tokens"]
    same(engine.generate([b], GREEDY)[0], cold)
    assert engine.stats["prefill_tokens"] - prefilled == 150 - 128 + 43


def test_default_and_validation(tiny):
    model = tiny.model
    assert Engine(model, max_slots=1, max_len=64).scheduler.prefix is not None  # on by default
    assert Engine(model, max_slots=1, max_len=64, batch_invariant=True).scheduler.prefix is None
    with pytest.raises(ValueError, match="prefix_replay must be an integer >= the window ring"):
        Engine(model, max_slots=1, max_len=64, prefix_replay=tiny.engine.layout.ring - 1)
    with pytest.raises(ValueError, match="need prefix_cache=True"):
        Engine(model, max_slots=1, max_len=64, prefix_cache=False, host_pages=4)
    assert tiny.engine.prefix_cache_metrics()["hit_rate"] > 0
