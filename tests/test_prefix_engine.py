"""Prefix caching in the engine (`serving.prefix_admission`): a hit gives the tokens and logits of a cold run of the
same prompt (tiny V4 and tiny V4.1, exact replay) while prefilling fewer tokens, concurrent hits share pages,
eviction and the host-memory tier keep results correct, and every page comes back once the cache is cleared.

References: the same engine's cold run of each prompt (nothing cached), and the model's own cached path
(`Model.step`, no engine) for the eviction run. A replay shorter than the exact one must change the logits, so
the comparison can fail."""

import types

import numpy as np
import pytest

from model.config import preset
from serving.engine import Engine
from serving.sampling import SamplingParams
from tests.helpers import random_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# per config: the page size and prompt lengths, so hits end on page boundaries past the exact replay
SETUPS = {"tiny": dict(page_tokens=16, max_len=176, num_pages=20, lengths=(150, 135, 100)),
          "tiny-v41": dict(page_tokens=64, max_len=256, num_pages=8, lengths=(210, 195, 150))}


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request):
    """The config's engine and model, prompt A, B sharing its first lengths[1] tokens, B2 its first lengths[2]."""
    name = request.param
    config, s = preset(name), SETUPS[name]
    model = random_model(config, seed=11, noise=0.05)
    engine = Engine(model, max_slots=2, max_len=s["max_len"], num_pages=s["num_pages"], page_tokens=s["page_tokens"],
                    prefill_chunk=32, max_prefill_rows=2, batch_invariant=True, prefix_cache=True, host_pages=64,
                    return_logits=True)
    rng = np.random.default_rng(5)
    a_len, b_shared, b2_shared = s["lengths"]
    a = rng.integers(0, config.vocab_size, a_len).tolist()
    b = a[:b_shared] + rng.integers(0, config.vocab_size, a_len - b_shared).tolist()
    b2 = a[:b2_shared] + rng.integers(0, config.vocab_size, 12).tolist()
    return types.SimpleNamespace(name=name, engine=engine, model=model, a=a, b=b, b2=b2)


def fresh(engine) -> None:
    """Nothing cached (device tree and host tier)."""
    engine.scheduler.prefix.clear()
    engine.scheduler.prefix.host.pages.clear()


@pytest.fixture(scope="module")
def cold(setup):
    """Cold runs of B and B2, admitted together (each caches its pages only once its prefill was dispatched)."""
    fresh(setup.engine)
    ref_b, ref_b2 = setup.engine.generate([setup.b, setup.b2], GREEDY)
    assert setup.engine.prefix_cache_metrics()["hit_tokens"] == 0
    return ref_b, ref_b2


def same(out, ref, atol=1e-4):
    assert out.token_ids == ref.token_ids
    np.testing.assert_allclose(np.stack(out.logits), np.stack(ref.logits), atol=atol, rtol=0)


def test_hits_equal_cold_runs_and_share_pages(setup, cold):
    engine, a, b, b2 = setup.engine, setup.a, setup.b, setup.b2
    prefix, pages, block = engine.scheduler.prefix, engine.scheduler.pages, engine.layout.page_tokens
    ref_b, ref_b2 = cold
    fresh(engine)
    engine.generate([a], GREEDY)
    before, prefilled = prefix.metrics(), engine.stats["prefill_tokens"]
    ids = [engine.add_request(p, GREEDY) for p in (b, b2)]
    hits = [common(a, p) // block * block for p in (b, b2)]
    engine.step()  # both admitted: B and B2 adopt A's pages
    shared = prefix.held[ids[0]].pages[:hits[1] // block]
    assert [pages.refs[p] for p in shared] == [3] * len(shared)  # the tree, B and B2
    results = engine.run()
    same(results[ids[0]], ref_b)
    same(results[ids[1]], ref_b2)
    assert prefix.metrics()["hit_tokens"] - before["hit_tokens"] == sum(hits) > 0
    replay = prefix.replay
    computed = sum(len(p) - h + min(h, replay) for p, h in zip((b, b2), hits))
    assert engine.stats["prefill_tokens"] - prefilled == computed < len(b) + len(b2)
    prefix.replay = engine.layout.ring  # the approximate replay: its windows miss keys, so the logits move
    try:
        out = engine.generate([b], GREEDY)[0]
    finally:
        prefix.replay = replay
    assert np.abs(np.stack(out.logits) - np.stack(ref_b.logits)).max() > 1e-3


def common(x: list[int], y: list[int]) -> int:
    """The length of the common prefix of two token lists."""
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def reference(model, prompt, steps):
    """Greedy tokens of the model's cached path (no engine)."""
    cache = model.init_cache(1, len(prompt) + steps)
    logits, cache = model.step(np.array([prompt]), cache)
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.asarray(logits)[0, -1].argmax()))
        logits, cache = model.step(np.array([[tokens[-1]]]), cache)
    return tokens


def test_eviction_and_host_tier_keep_results_and_pages_come_back(setup, cold):
    if setup.name != "tiny":
        pytest.skip("the tiny V4 engine covers eviction (host code shared by both models)")
    engine, model, a, b = setup.engine, setup.model, setup.a, setup.b
    prefix, pages = engine.scheduler.prefix, engine.scheduler.pages
    ref_b = cold[0]
    fresh(engine)
    engine.generate([a], GREEDY)  # A's pages cached
    rng = np.random.default_rng(9)
    others = [rng.integers(0, engine.config.vocab_size, len(a)).tolist() for _ in range(2)]
    evicted = prefix.metrics()["evicted_blocks"]
    outs = engine.generate(others, GREEDY)  # two unrelated requests need nearly the whole pool
    assert prefix.metrics()["evicted_blocks"] > evicted and prefix.host.stored > 0
    for prompt, out in zip(others, outs):
        assert out.token_ids == reference(model, prompt, GREEDY.max_tokens)
    restored, hits = prefix.host.restored, prefix.metrics()["hit_tokens"]
    same(engine.generate([b], GREEDY)[0], ref_b)  # A's evicted prefix comes back from host memory
    assert prefix.host.restored > restored and prefix.metrics()["hit_tokens"] > hits
    prefix.clear()
    assert len(pages.free) == engine.layout.num_pages and not any(pages.refs)  # no leaks


def test_default_and_validation(setup):
    if setup.name != "tiny":
        pytest.skip("engine options: checked once")
    engine, model = setup.engine, setup.model
    assert Engine(model, max_slots=1, max_len=64).scheduler.prefix is not None  # on by default
    assert Engine(model, max_slots=1, max_len=64, batch_invariant=True).scheduler.prefix is None
    with pytest.raises(ValueError, match="prefix_replay must be an integer >= the window ring"):
        Engine(model, max_slots=1, max_len=64, prefix_replay=engine.layout.ring - 1)
    with pytest.raises(ValueError, match="need prefix_cache=True"):
        Engine(model, max_slots=1, max_len=64, prefix_cache=False, host_pages=4)
    assert engine.prefix_cache_metrics()["hit_rate"] > 0
