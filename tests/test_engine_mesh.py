"""The mesh engine against the single-device engine, feature by feature, on emulated CPU devices
(tests/conftest.py): V4.1 with its experts split over `ep` (a rank left idle by an odd number of requests: V4.1's
compact replay is a `lax.cond` whose branch runs MoE layers, so the ranks must take it together) with prompt
logprobs, the prefix
cache per rank with its host tier and fixed speculation by V4's MTP drafter over dp and ep (a hit equals a cold
prefill; the rank holding a prefix takes the requests sharing it; drafts verified, tokens lossless), and
structured outputs under DSpark. Greedy tokens are compared exactly, logits within 1e-5 where the engine keeps them."""

import dataclasses
import re

import numpy as np
import pytest

from model.config import preset
from serving.core.engine import Engine
from serving.base.sampling import SamplingParams
from tests.helpers import random_model
from tests.test_disagg import handed_off
from tests.test_structured_engine import tiny  # noqa: F401  (a fixture: V4.1 with a character tokenizer)

# tiny-v41 cut to 6 layers (compiles faster): a sliding layer, a ratio-2 encoder group, the ratio-1 decoder KV
V41 = dataclasses.replace(preset("tiny-v41"), num_hidden_layers=6, compress_ratios=(0, 2, 2, 1, 1, 1),
                          kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5), candidate_source_layer_id=3)
RNG = np.random.default_rng(7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# batch-invariant buckets: one decode and one prefill step per engine
ENGINE = dict(max_slots=4, max_len=48, page_tokens=16, prefill_chunk=16, max_prefill_rows=2, batch_invariant=True,
              num_top_logprobs=0, return_logits=True)


def same_outputs(mesh_outputs, single_outputs) -> None:
    """The mesh engine's greedy tokens equal the single device's; its logits within 1e-5."""
    for got, want in zip(mesh_outputs, single_outputs, strict=True):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def v41():
    return random_model(V41, seed=3, noise=0.05)


def test_v41_with_experts_over_ep_equals_single_device(v41):
    """dp=2,ep=2: three requests over two ranks, so one rank runs padding rows only in some steps (its compact
    replay would skip the MoE layers whose all-to-all the other rank waits in)."""
    prompts = [RNG.integers(0, V41.vocab_size, n).tolist() for n in (5, 23, 9)]
    scored = dataclasses.replace(GREEDY, prompt_logprobs=0)  # the second request's prompt logprobs (echo)
    single = Engine(v41, **ENGINE).generate(prompts, [GREEDY, scored, GREEDY])
    engine = Engine(v41, mesh="dp=2,ep=2", **ENGINE)
    outputs = engine.generate(prompts, [GREEDY, scored, GREEDY])
    same_outputs(outputs, single)
    got, want = ([e.logprob for e in o.prompt_logprobs[1:]] for o in (outputs[1], single[1]))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert engine.stats["eplb_balancedness"] > 0  # the expert loads were counted, the replay layers' too


V4 = preset("tiny")


@pytest.fixture(scope="module")
def v4():
    return random_model(V4, seed=5, noise=0.05)


def test_prefix_cache_and_mtp_speculation_on_dp_and_ep_equal_one_plain_device(v4):
    """dp=2,ep=2 with the prefix cache, a host tier and fixed speculation by V4's MTP drafter (its experts over
    `ep` too). A first request, sent beside one that takes rank 0, leaves a 32-token prefix and its window-state
    snapshot in rank 1's cache; a second sharing it goes to rank 1 although both ranks are idle (their loads tie,
    which would pick rank 0) and starts from rank 1's snapshot; evicted to rank 1's host tier, the prefix comes
    back into rank 1's pages for a third. Drafts are verified, and the tokens and logits are a plain
    single-device engine's (no prefix cache, no speculation)."""
    shared = RNG.integers(0, V4.vocab_size, 32).tolist()
    busy = RNG.integers(0, V4.vocab_size, 6).tolist()
    prompts = [shared + RNG.integers(0, V4.vocab_size, n).tolist() for n in (4, 3, 5)]
    order = [busy, prompts[0], prompts[1], busy, prompts[2]]
    single = Engine(v4, **ENGINE).generate(order, GREEDY)
    engine = Engine(v4, mesh="dp=2,ep=2", prefix_cache=True, host_pages=4, speculation="fixed", num_drafts=1,
                    **ENGINE)

    def run(batch: list[list[int]]) -> tuple[list[int], list]:
        ids, ranks, done = [engine.add_request(prompt, GREEDY) for prompt in batch], {}, {}
        while engine.has_work:
            done |= {out.request_id: out for out in engine.step()}
            ranks |= {r.request_id: engine.scheduler.rank(r) for r in engine.scheduler.running}
        return [ranks[i] for i in ids], [done[i] for i in ids]

    placed, outputs = run(order[:2])
    prefix = engine.scheduler.prefix.ranks
    assert placed == [0, 1] and [rank.tree.cached_blocks for rank in prefix] == [0, 2]
    placed, second = run(order[2:3])
    assert placed == [1] and prefix[1].metrics()["snapshot_hits"] == 1  # to the rank holding the prefix
    assert prefix[1].evict(2) == 2  # to rank 1's host tier
    placed, later = run(order[3:])
    assert placed == [0, 1]
    same_outputs(outputs + second + later, single)
    metrics = engine.prefix_cache_metrics()
    assert metrics["host_restored"] == 2 and metrics["rank1_hit_rate"] > 0 and metrics["rank0_hit_rate"] == 0
    assert engine.speculation_metrics()["verified_per_step"] > 0


def test_handoff_into_and_out_of_a_mesh_engine_continues_exactly(v4):
    """P/D hand-offs with a mesh engine (`Engine.export_slot` / `import_slot`): a request prefilled on one device
    goes to the dp=2,ep=2 engine's idle rank (rank 0 runs another request), on that rank's pages, the cache
    keeping its shardings; exported from there after a few tokens, it finishes on the single device. Both
    requests' tokens are a single engine's."""
    import jax

    prompts = [RNG.integers(0, V4.vocab_size, n).tolist() for n in (7, 21)]
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=11, ignore_eos=True), GREEDY]
    single = Engine(v4, zero_overhead=False, **ENGINE)  # each step read before the next: exports between steps
    reference = single.generate(prompts, params)
    moved = "moved"
    state = handed_off(single, prompts[1], params[1], moved)
    mesh = Engine(v4, mesh="dp=2,ep=2", zero_overhead=False, **ENGINE)
    busy = mesh.add_request(prompts[0], params[0])
    mesh.step()
    shardings = jax.tree.map(lambda x: x.sharding, mesh.cache)
    assert mesh.import_slot(state)
    handed = mesh.requests[moved]
    assert mesh.scheduler.rank(mesh.requests[busy]) == 0 and mesh.scheduler.rank(handed) == 1
    half = mesh.layout.num_pages // 2
    assert set(mesh.scheduler.pages.owned[handed.slot]) <= set(range(half, 2 * half))  # rank 1's pages
    assert jax.tree.map(lambda x: x.sharding, mesh.cache) == shardings
    outputs = {}
    while len(handed.output) < 3:
        outputs |= {out.request_id: out for out in mesh.step()}
    back = mesh.export_slot(moved)
    mesh.cancel(moved)
    outputs |= mesh.run()
    assert outputs[busy].token_ids == reference[0].token_ids
    assert single.import_slot(back)
    assert single.run()[moved].token_ids == reference[1].token_ids


def test_structured_outputs_under_dspark_on_a_mesh_equal_one_device(tiny):
    """dp=2 with DSpark (a cost table under which verifying pays; each rank plans its own rows) and greedy
    regex-constrained rows beside an unconstrained one (the masks need the tokens in flight, which the mesh step
    reads first): drafts are verified, the tokens are the single-device DSpark engine's (itself lossless against
    plain decoding, tests/test_spec_engine.py), and each constrained output matches its pattern."""
    from serving.structured.constraints import ConstraintSpec
    from serving.speculation.verify_plan import CostTable
    from tests.test_structured_engine import chars_text

    patterns = [r"[a-c]{3,6}(,[0-9]{1,3}){2}\.", r"\((x|y|z){1,5}\)", r"[0-9]{2}:[0-9]{2}"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    requests = [(RNG.integers(0, tiny.config.vocab_size, 7).tolist(), greedy, ConstraintSpec.regex(p))
                for p in patterns] + [([5, 6, 7], GREEDY, None)]
    config = dict(max_slots=4, max_len=48, page_tokens=16, prefill_chunk=16, max_prefill_rows=2, batch_invariant=True)
    results = []
    for mesh in (None, "dp=2"):
        engine = Engine(tiny, mesh=mesh, speculation="dspark", verify_widths=(2, 4), num_drafts=3, **config)
        engine.speculation.costs = CostTable({(r, w): 1.0 if w < 2 else 1.6 for r in engine.decode_rows
                                              for w in (0, 1) + engine.speculation.verify_widths}, window=0)
        ids = [engine.add_request(p, q, constraint=c) for p, q, c in requests]
        done = engine.run()
        results.append([done[i] for i in ids])
    for single, meshed in zip(*results, strict=True):
        assert meshed.token_ids == single.token_ids and meshed.finish_reason == single.finish_reason
    for pattern, out in zip(patterns, results[1]):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, chars_text(out.token_ids))
    assert engine.speculation_metrics()["verified_per_step"] > 0
