"""Prefix caching in the engine (`serving.prefix.prefix_admission`, `serving.prefix.window_snapshots`): a hit gives the tokens
and logits of a cold run of the same prompt (tiny V4; a 6-layer tiny V4.1 with bounded replay) while prefilling
fewer tokens, whether it starts from a window-state snapshot or replays; concurrent hits share pages; eviction,
the snapshot LRU and the host-memory tier keep results correct; every page comes back once the cache is cleared;
a hit under speculative decoding gives plain greedy decoding's tokens. The engine's bounded replay (V4.1) gives
the model's numbers for the same `Replay`.

The reference is the same engine's cold run of each prompt (nothing cached; the cold path itself is checked
against the model in test_engine), the model's own bounded-replay prefill and decode (`Model.step`), or the
model's full forwards. A replay shorter than the exact one, and a bounded replay below `exact_keep`, must change
the logits, so the comparisons can fail. The tiny V4 engine has test_engine's shapes and the speculative one
test_spec_engine's, so their steps come from the suite's compilation cache."""

import dataclasses
import types

import numpy as np
import pytest

from model.initialize import init_model
from model.config import preset
from model.dspark import init_drafter
from model.replay import ENGINE_DEFAULT, Replay, exact_keep, for_engine
from serving.core.engine import Engine
from serving.base.sampling import SamplingParams
from serving.prefix.window_snapshots import prefix_key
from tests.helpers import prompt_logprobs_by_forward, random_model
from tests.test_dspark import CONFIG as DRAFTER, TARGET as SPEC_TARGET
from tests.typecheck import unchecked

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
RNG = np.random.default_rng(5)
V41 = dataclasses.replace(preset("tiny-v41"), num_hidden_layers=6, compress_ratios=(0, 2, 2, 1, 1, 1),
                          kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5), candidate_source_layer_id=3)
KEEP = 12  # >= the ring (8) and < exact_keep (15): the bounded replay moves the last logits


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
    """Nothing cached (device tree, its snapshots and the host tier)."""
    engine.scheduler.prefix.clear()
    engine.scheduler.prefix.host.pages.clear()


def same(out, ref, atol=1e-4):
    assert out.token_ids == ref.token_ids
    np.testing.assert_allclose(np.stack(out.logits), np.stack(ref.logits), atol=atol, rtol=0)


def delta(engine, before: dict) -> dict:
    """How much each prefix-cache counter (and the prefilled tokens) grew since `before` (`counters`)."""
    return {k: v - before[k] for k, v in counters(engine).items()}


def counters(engine) -> dict:
    return {**engine.prefix_cache_metrics(), "prefilled": engine.stats["prefill_tokens"]}


def test_hits_equal_cold_runs_and_share_pages(tiny):
    engine, prefix, pages = tiny.engine, tiny.engine.scheduler.prefix, tiny.engine.scheduler.pages
    fresh(engine)
    engine.generate([tiny.a], GREEDY)
    assert prefix.metrics()["snapshots"] == 3  # A's slot state after its chunks ending at 16, 32 and 48
    before = counters(engine)
    ids = [engine.add_request(p, GREEDY) for p in (tiny.b, tiny.b2)]
    engine.step()  # both admitted: they adopt A's first 3 pages
    shared = prefix.held[ids[0]].pages
    assert len(shared) == 3 and prefix.held[ids[1]].pages == shared
    assert [pages.refs[p] for p in shared] == [3, 3, 3]  # the tree, B and B2
    results = engine.run()
    for rid, ref in zip(ids, tiny.cold):
        same(results[rid], ref)
        assert results[rid].cached_tokens == 48 and ref.cached_tokens == 0  # its prefill skipped 48 tokens
    grew = delta(engine, before)
    assert grew["hit_tokens"] == 2 * 48 and grew["snapshot_hits"] == 2
    assert grew["prefilled"] == 2 * (58 - 48)  # from A's snapshot at 48: nothing replayed
    prefix.snapshots.entries.clear()  # without a snapshot, the exact replay: from 48 - 37 = 11 on
    before = counters(engine)
    replayed = engine.generate([tiny.b], GREEDY)[0]
    same(replayed, tiny.cold[0])
    assert delta(engine, before)["prefilled"] == 58 - 48 + prefix.replay
    assert replayed.cached_tokens == 48 - prefix.replay  # what it did not prefill: the replay recomputed the rest
    exact = prefix.replay
    prefix.replay = engine.layout.ring  # the approximate replay: its windows miss keys, so the logits move
    try:
        out = engine.generate([tiny.b], GREEDY)[0]
    finally:
        prefix.replay = exact
    assert np.abs(np.stack(out.logits) - np.stack(tiny.cold[0].logits)).max() > 1e-3


def test_snapshot_lru_and_an_earlier_boundary_keep_results_and_pages(tiny):
    engine, prefix, pages = tiny.engine, tiny.engine.scheduler.prefix, tiny.engine.scheduler.pages
    store, capacity = prefix.snapshots, prefix.snapshots.capacity
    fresh(engine)
    store.capacity = 2
    try:
        before = counters(engine)
        engine.generate([tiny.a], GREEDY)  # snapshots at 16, 32, 48: the least recently used (16) goes
        assert list(store.entries) == [prefix_key(tiny.a[:32]), prefix_key(tiny.a[:48])]
        store.drop(prefix_key(tiny.a[:48]))  # the deepest usable one is now 32: pages 32..48 adopted, recomputed
        same(engine.generate([tiny.b], GREEDY)[0], tiny.cold[0])
        grew = delta(engine, before)
        assert grew["snapshot_hits"] == 1 and grew["prefilled"] == 58 + 58 - 32 and grew["snapshots_dropped"] == 2
    finally:
        store.capacity = capacity
    fresh(engine)
    assert not store.entries  # dropped with their blocks
    assert len(pages.free) == engine.layout.num_pages and not any(pages.refs)  # no leaks


def test_eviction_and_host_tier_keep_results_and_pages_come_back(tiny):
    engine, prefix, pages = tiny.engine, tiny.engine.scheduler.prefix, tiny.engine.scheduler.pages
    fresh(engine)
    engine.generate([tiny.a], GREEDY)  # A's 3 full pages cached
    evicted = prefix.metrics()["evicted_blocks"]
    for out, ref in zip(engine.generate(tiny.others, GREEDY), tiny.cold_others):  # they need all 16 pages
        same(out, ref)
    assert prefix.metrics()["evicted_blocks"] - evicted >= 3 and prefix.host.stored >= 3
    assert prefix_key(tiny.a[:48]) not in prefix.snapshots  # gone with A's evicted blocks
    restored, before = prefix.host.restored, counters(engine)
    same(engine.generate([tiny.b], GREEDY)[0], tiny.cold[0])  # A's evicted pages come back from host memory
    grew = delta(engine, before)
    assert prefix.host.restored - restored == 3 and grew["hit_tokens"] == 48 and grew["snapshot_hits"] == 0
    prefix.clear()
    assert len(pages.free) == engine.layout.num_pages and not any(pages.refs)  # no leaks


@pytest.fixture(scope="module")
def v41():
    """A 6-layer tiny V4.1 engine (pages of 16, chunks of 32) with compact bounded replay, keep 12 < exact_keep;
    A of 150 tokens and B of 138 sharing its first 130 (a hit of 128), B's cold run."""
    model = random_model(V41, seed=3, noise=0.05)
    assert exact_keep(V41, V41.sliding_window) == 15 > KEEP
    engine = Engine(model, max_slots=1, max_len=160, page_tokens=16, prefill_chunk=32, max_prefill_rows=1,
                    batch_invariant=True, prefix_cache=True, return_logits=True, replay=Replay("compact", KEEP))
    a = RNG.integers(0, V41.vocab_size, 150).tolist()
    b = a[:130] + RNG.integers(0, V41.vocab_size, 8).tolist()
    cold = engine.generate([b], GREEDY)[0]
    return types.SimpleNamespace(engine=engine, model=model, a=a, b=b, cold=cold)


def test_v41_engine_bounded_replay_gives_the_models_numbers(v41):
    """The engine's chunked prefill with per-row prompt ends, then decode, gives `Model.logits` of the prompt and
    its greedy continuation with the same bounded replay (`mask`: it runs rows past the prompt's end, whose
    windows lie past the floor, so one forward shows every step); the engine's `mask` gives `compact`'s numbers;
    a full forward (replay off) moves the logits, since keep < exact_keep."""
    model, prompt, out = v41.model, v41.b, v41.cold
    sequence = np.array([prompt + out.token_ids[:-1]])
    positions = slice(len(prompt) - 1, None)
    replayed = np.asarray(model.logits(sequence, replay=Replay("mask", KEEP),
                                       prompt_end=np.array([len(prompt)], np.int32)))[0, positions]
    same(out, types.SimpleNamespace(token_ids=replayed.argmax(-1).tolist(), logits=list(replayed)))
    full = np.asarray(model.logits(sequence))[0, positions]
    assert np.abs(full - replayed).max() > 1e-3
    masked = Engine(model, max_slots=1, max_len=160, page_tokens=16, prefill_chunk=32, max_prefill_rows=1,
                    batch_invariant=True, return_logits=True, replay=Replay("mask", KEEP))
    same(masked.generate([prompt], GREEDY)[0], out, atol=1e-5)


def test_v41_prompt_logprobs_run_every_position_through_the_replay_layers(v41):
    """Compact replay keeps 12 of a chunk's 32 tokens: a prompt-logprob request's chunks are cut to 12, which
    the replay layers run whole, so its entries are the full forward's (replay off), not the bounded ones."""
    out = v41.engine.generate([v41.b], dataclasses.replace(GREEDY, prompt_logprobs=1))[0]
    same_prompt_logprobs(out, v41.model, v41.b)


def test_v41_snapshot_hit_equals_cold_run(v41):
    """Bounded replay: a snapshot at b is usable only for b <= P - keep = 126, so B starts from A's snapshot at 96
    (the one at 128 lacks B's replay-layer keys 126, 127), not replaying."""
    engine = v41.engine
    fresh(engine)
    engine.generate([v41.a], GREEDY)
    before = counters(engine)
    same(engine.generate([v41.b], GREEDY)[0], v41.cold)
    grew = delta(engine, before)
    assert grew["hit_tokens"] == 128 and grew["snapshot_hits"] == 1 and grew["prefilled"] == 138 - 96
    prefix = engine.scheduler.prefix
    prefix.bounded_keep = 0  # without the rule B would start from A's snapshot at 128, and its logits move
    try:
        before = counters(engine)
        out = engine.generate([v41.b], GREEDY)[0]
    finally:
        prefix.bounded_keep = KEEP
    assert delta(engine, before)["prefilled"] == 138 - 128
    assert np.abs(np.stack(out.logits) - np.stack(v41.cold.logits)).max() > 1e-3


def same_prompt_logprobs(out, model, prompt: list[int]) -> None:
    """`out`'s prompt logprobs (asked with one alternative) are the full forward's, the alternative its argmax."""
    want, argmax = prompt_logprobs_by_forward(model, prompt)
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    assert [e.token for e in entries[1:]] == prompt[1:] and [e.top[0][0] for e in entries[1:]] == argmax.tolist()
    np.testing.assert_allclose([e.logprob for e in entries[1:]], want, atol=1e-4, rtol=0)


def test_prompt_logprobs_cold_and_from_a_hit_are_the_full_forwards(tiny):
    """Prompt logprobs (a completion's echo) come from the engine's prefill: cold, from a hit that prefills its
    prompt's tail only (the entries of the cached pages come from the prompt-logprob store, and the prefill starts
    where the state is exact by the first entry it computes: a snapshot or the exact replay), and for a prompt
    wholly cached."""
    engine, model, prefix = tiny.engine, tiny.model, tiny.engine.scheduler.prefix
    params = dataclasses.replace(GREEDY, prompt_logprobs=1)
    fresh(engine)
    engine.prompt_store.pages.clear()
    a = engine.generate([tiny.a], params)[0]
    same_prompt_logprobs(a, model, tiny.a)
    assert a.token_ids == engine.generate([tiny.a], GREEDY)[0].token_ids  # scoring changes no token
    before = counters(engine)
    b = engine.generate([tiny.b], params)[0]
    same_prompt_logprobs(b, model, tiny.b)
    same(b, tiny.cold[0])
    assert b.cached_tokens == 48  # the store covers 48 entries, A's snapshot at 48 gives the state there
    prefix.snapshots.entries.clear()  # without it, the replay reaches exact state by the first entry it computes
    replayed = engine.generate([tiny.b], params)[0]
    same_prompt_logprobs(replayed, model, tiny.b)
    assert replayed.cached_tokens == 48 - prefix.exact_replay
    assert delta(engine, before)["prefilled"] == 2 * 58 - b.cached_tokens - replayed.cached_tokens
    again = engine.generate([tiny.a], params)[0]
    same_prompt_logprobs(again, model, tiny.a)
    assert again.cached_tokens > 0


def test_prefix_hit_under_speculation_equals_plain_greedy():
    """A hit restores the drafter's context ring with the windows: fixed speculation (greedy) then emits the
    tokens of a cold run, which test_spec_engine checks against plain greedy decoding (same engine shapes)."""
    model = init_model(SPEC_TARGET, seed=0)
    model.drafter = init_drafter(SPEC_TARGET, DRAFTER, seed=1)
    engine = Engine(model, max_slots=2, max_len=64, page_tokens=16, prefill_chunk=16, max_prefill_rows=1,
                    speculation="fixed", zero_overhead=True, verify_widths=(2, 4), num_drafts=3)
    a = RNG.integers(0, SPEC_TARGET.vocab_size, 40).tolist()
    b = a[:36] + RNG.integers(0, SPEC_TARGET.vocab_size, 4).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cold = engine.generate([b], params)[0]
    fresh(engine)
    engine.generate([a], params)
    before = counters(engine)
    assert engine.generate([b], params)[0].token_ids == cold.token_ids
    assert delta(engine, before)["snapshot_hits"] == 1 and engine.speculation_metrics()["accepted_per_step"] > 0


def test_default_and_validation(tiny):
    model = tiny.model
    engine = Engine(model, max_slots=1, max_len=64)
    assert engine.scheduler.prefix is not None and engine.scheduler.prefix.snapshots.capacity == 8  # on by default
    assert engine.replay is None  # V4: no replay layers
    assert Engine(model, max_slots=1, max_len=64, batch_invariant=True).scheduler.prefix is None
    with pytest.raises(ValueError, match="prefix_replay must be an integer >= the window ring"):
        Engine(model, max_slots=1, max_len=64, prefix_replay=tiny.engine.layout.ring - 1)
    with pytest.raises(ValueError, match="need prefix_cache=True"):
        Engine(model, max_slots=1, max_len=64, prefix_cache=False, host_pages=4)
    with pytest.raises(ValueError, match="prefix_snapshots must be a non-negative integer"):
        Engine(model, max_slots=1, max_len=64, prefix_snapshots=-1)
    with pytest.raises(ValueError, match="needs a causal encoder-decoder"):
        Engine(model, max_slots=1, max_len=64, replay=Replay("compact"))
    assert tiny.engine.prefix_cache_metrics()["hit_rate"] > 0


def test_engine_replay_validation(v41):
    model = v41.model
    assert Engine(model, max_slots=1, max_len=64).replay == Replay("compact", 140)  # V4.1's default
    assert Engine(model, max_slots=1, max_len=64, replay=None).replay is None
    with pytest.raises(ValueError, match=r"keep=9 must be >= window \+ backtracking = 8 \+ 2 = 10"):
        Engine(model, max_slots=1, max_len=64, backtrack=2, replay=Replay("mask", 9))
    with pytest.raises(ValueError, match="replay must be a model.replay.Replay or None"), unchecked():
        Engine(model, max_slots=1, max_len=64, replay="compact")
    # a DSpark drafter reading a replay layer (4, 5 here) needs keep >= its context ring
    assert for_engine(V41, Replay("compact", 11), ring=10, drafter_ring=13, tapped=(1, 3)) == Replay("compact", 11)
    with pytest.raises(ValueError, match=r"keep=11 must cover the DSpark drafter's context ring \(13 positions\)"):
        for_engine(V41, Replay("compact", 11), ring=10, drafter_ring=13, tapped=(3, 5))
    assert for_engine(V41, ENGINE_DEFAULT, ring=10, drafter_ring=150, tapped=(5,)) == Replay("compact", 150)
