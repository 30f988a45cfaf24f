"""The engine against the model's full-sequence forward (itself checked against the cached path in
tests/test_cached.py and the HF oracle in tests/test_parity.py): greedy tokens and logits, chunked prefill,
queueing, preemption, determinism, batch invariance, compilation count, stop conditions, bad input."""

import threading

import numpy as np
import pytest
from jax import monitoring

from model.config import preset
from serving.core.engine import Engine
from serving.base.engine_config import EngineConfig
from serving.base.sampling import SamplingParams
from tests.helpers import greedy_full_forward, random_model

CONFIG = preset("tiny")
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, CONFIG.vocab_size, n).tolist() for n in (5, 23, 40, 9, 17, 3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
COMPILES: list[str] = []
monitoring.register_event_duration_secs_listener(
    lambda name, _d, **_kw: COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=11, noise=0.05)


@pytest.fixture(scope="module")
def engine(model):
    """4 slots over a pool of 5 pages of 16 tokens (the longest request takes 4): requests are preempted."""
    eng = Engine(model, max_slots=4, max_len=64, num_pages=5, page_tokens=16, prefill_chunk=16, max_prefill_rows=2,
                 num_top_logprobs=2, return_logits=True)
    eng.warmup()
    return eng


@pytest.fixture(scope="module")
def reference(model):
    """reference(i, steps): the greedy tokens and logits of PROMPTS[i] by the full forward, computed once for 14
    steps (one [8, 64] batch, the shape tests/test_generate.py's reference runs: one compilation for both)."""
    every = greedy_full_forward(model, PROMPTS, 14)
    return lambda i, steps: (every[i][0][:steps], every[i][1][:steps])


def test_greedy_tokens_and_logits_equal_the_full_forward(engine, reference):
    compiled_before, events_before = len(engine.compiled), len(COMPILES)
    outputs = engine.generate(PROMPTS, GREEDY)  # 6 requests in 4 slots, 16-token prefill chunks
    assert len(engine.compiled) == compiled_before and len(COMPILES) == events_before  # nothing compiled
    for i, out in enumerate(outputs):
        tokens, logits = reference(i, 10)
        assert out.token_ids == tokens and out.finish_reason == "length"
        np.testing.assert_allclose(np.stack(out.logits), logits, atol=1e-5, rtol=0)


def test_the_first_buckets_run_every_step_until_the_background_compilation_reaches_theirs(model, reference):
    """What `jaxseek serve` compiles before it answers (the widest one-row prefill bucket) runs a request's
    prefill and decode steps while the background compilation has not reached their own buckets (here one that
    reaches none): nothing else compiles, and the tokens and logits are the full forward's. Once it is over, a
    step compiles its own bucket."""
    engine = Engine(model, max_slots=4, max_len=64, page_tokens=16, prefill_chunk=16, max_prefill_rows=2,
                    num_top_logprobs=2, return_logits=True)
    first = engine.first_buckets()
    assert first == [(1, 16, 1, engine.context_pages[0])]
    engine.warmup(first)
    hold = threading.Event()
    engine._background = threading.Thread(target=hold.wait, daemon=True)  # compiling, and at no bucket yet
    engine._background.start()
    try:
        out = engine.generate([PROMPTS[0]], GREEDY)[0]
    finally:
        hold.set()
        engine._background.join()
    assert list(engine.compiled) == first
    tokens, logits = reference(0, 10)
    assert out.token_ids == tokens
    np.testing.assert_allclose(np.stack(out.logits), logits, atol=1e-5, rtol=0)
    engine.generate([PROMPTS[5]], GREEDY)
    assert (1, 1, 1, engine.context_pages[0]) in engine.compiled


def test_preemption_and_resumption_keep_the_tokens(engine, reference):
    """The pool's 5 pages cannot hold these 4 requests at once: running requests go out and back in."""
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    chosen = (0, 1, 3, 4)
    outputs = engine.generate([PROMPTS[i] for i in chosen], params)
    assert sum(o.preemptions for o in outputs) > 0
    for i, out in zip(chosen, outputs):
        tokens, logits = reference(i, 14)
        assert out.token_ids == tokens
        np.testing.assert_allclose(np.stack(out.logits), logits, atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible(engine):
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=s, ignore_eos=True) for s in (7, 7, 8)]
    first = engine.generate([PROMPTS[0]] * 3, params)
    again = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [params[0], params[0], params[2]])
    assert first[0].token_ids == first[1].token_ids == again[1].token_ids
    assert first[2].token_ids != first[0].token_ids  # another seed, another path


def test_batch_invariant_logits_are_bit_identical(model):
    eng = Engine(model, max_slots=9, max_len=64, prefill_chunk=16, max_prefill_rows=2, batch_invariant=True,
                 return_logits=True)
    params = SamplingParams(temperature=0.8, max_tokens=6, seed=3, ignore_eos=True)
    target = PROMPTS[2]
    runs = []
    for others in (0, 1, 3, 8):
        batch = [target] + [RNG.integers(0, CONFIG.vocab_size, int(RNG.integers(2, 30))).tolist()
                            for _ in range(others)]
        runs.append(eng.generate(batch, [params] + [SamplingParams(max_tokens=5, seed=i) for i in range(others)])[0])
    for run in runs[1:]:
        assert run.token_ids == runs[0].token_ids
        np.testing.assert_array_equal(np.stack(run.logits), np.stack(runs[0].logits))


def test_stop_conditions(engine, reference):
    tokens, _ = reference(0, 10)
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[tokens[4]]))
    assert out[0].finish_reason == "stop" and out[0].token_ids == tokens[: tokens.index(tokens[4]) + 1]
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 3


def test_logprobs_are_returned(engine, reference):
    out = engine.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True))
    _, logits = reference(3, 3)
    expected = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    for step, lp in enumerate(out[0].logprobs):
        assert lp.token == int(logits[step].argmax())
        assert lp.logprob == pytest.approx(expected[step, lp.token], abs=1e-4)
        assert [t for t, _ in lp.top] == list(np.argsort(-logits[step])[:2])


def test_cancellation_frees_the_slot(engine, reference):
    keep = engine.add_request(PROMPTS[1], GREEDY)
    drop = engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.cancel(drop)
    results = engine.run()
    assert results[drop].finish_reason == "cancelled"
    assert results[keep].token_ids == reference(1, 10)[0]
    assert not engine.scheduler.running and len(engine.scheduler.free_slots) == engine.layout.max_slots


@pytest.mark.parametrize("prompt, params, message", [
    ([], None, "prompt is empty"),
    ([1, 2, 300], None, "outside the vocabulary"),
    ([1] * 60, SamplingParams(max_tokens=10), "exceeds the engine's max_len=64"),
    ([1, 2], SamplingParams(logprobs=5), "exceeds the engine's num_top_logprobs=2"),
])
def test_bad_requests_are_refused_and_others_keep_running(engine, reference, prompt, params, message):
    good = engine.add_request(PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert engine.run()[good].token_ids == reference(4, 4)[0]


def test_a_config_and_keywords_give_the_same_engine(model, engine):
    """`Engine(model, config)` and `Engine(model, **fields)` build the same settings; keywords given with a config
    replace its fields; a config pickles with its defaults intact (the prefill process of `serving.api.disagg`)."""
    import dataclasses
    import pickle

    settings = dict(max_slots=4, max_len=64, num_pages=5, page_tokens=16, prefill_chunk=16, max_prefill_rows=2,
                    num_top_logprobs=2, return_logits=True)
    config = EngineConfig(**settings)
    assert engine.config == config
    assert Engine(model, EngineConfig(max_slots=2), max_len=32).config == EngineConfig(max_slots=2, max_len=32)
    restored = pickle.loads(pickle.dumps(dataclasses.replace(config, verify_widths=[3, 2])))
    assert restored.verify_widths == (2, 3) and restored.replay is EngineConfig().replay


@pytest.mark.parametrize("settings, message", [
    (dict(max_slots=0), "max_slots must be an integer >= 1, got 0"),
    (dict(host_pages=-1), "host_pages must be a non-negative integer"),
    (dict(num_top_logprobs=21), r"num_top_logprobs must be in \[0, 20\]"),
    (dict(speculation="always"), "speculation must be one of none, fixed, dspark"),
    (dict(verify_widths=(1, 2)), "verify_widths must be integers >= 2"),
    (dict(batch_invariant=True, host_pages=4), "need prefix_cache=True"),
    (dict(eplb_every=4), "needs a mesh"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_unknown_setting_is_a_type_error(model):
    with pytest.raises(TypeError, match="max_slot"):
        Engine(model, max_slot=2)
    with pytest.raises(TypeError, match="max_slot"):
        Engine(model, EngineConfig(), max_slot=2)


def test_v41_with_engram_matches_its_full_forward():
    """V4.1: paged shared-KV entries and index keys, host-side Engram hashing per request."""
    v41 = random_model(preset("tiny-v41"), seed=3, noise=0.05)
    eng = Engine(v41, max_slots=2, max_len=48, prefill_chunk=16, max_prefill_rows=1, return_logits=True)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[4]]
    outputs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for (tokens, logits), out in zip(greedy_full_forward(v41, prompts, 8), outputs):
        assert out.token_ids == tokens
        np.testing.assert_allclose(np.stack(out.logits), logits, atol=1e-5, rtol=0)
