"""The data-parallel engine on 8 emulated CPU devices (tests/conftest.py) against the single-device full forward
(itself checked against the engine in tests/test_engine.py): greedy tokens and logits on dp=2 and on dp=4 x ep=2
with EPLB rebalancing mid-run (the weights move with the maps; the shards' balance improves; float experts, and
stored FP4 codes with their scales), each rank's pages its own, no collective but the expert all-to-all in the compiled steps, and the balancedness metric."""

import numpy as np
import pytest

from model.api import Model
from model.checkpoint import load_model, save_checkpoint
from model.moe import Fp4Experts
from model.config import preset
from model.convert import convert
from serving.core.engine import Engine
from serving.base.kv_cache import CacheLayout
from serving.api.metrics import ServerMetrics
from serving.base.request import Request
from serving.base.sampling import SamplingParams
from serving.core.engine_dp import DataParallelScheduler
from tests.helpers import greedy_full_forward, random_model, widened_to_f32

CONFIG = preset("tiny")
RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(0, CONFIG.vocab_size, n).tolist() for n in (5, 23, 9, 17)]
STEPS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
# batch-invariant buckets: one decode and one prefill step per engine
ENGINE = dict(max_slots=4, max_len=48, page_tokens=16, prefill_chunk=16, max_prefill_rows=2, batch_invariant=True,
              num_top_logprobs=0, return_logits=True)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


@pytest.fixture(scope="module")
def model():
    """tiny with a router bias that sends every token of the top-k-routed layers to expert 0 (a skewed load)."""
    module = random_model(CONFIG, seed=11, noise=0.05).module()
    for blk in module.layers:
        if hasattr(blk.ffn.gate, "bias"):
            blk.ffn.gate.bias[...] = blk.ffn.gate.bias[...].at[0].add(10.0)
    return Model(module)


@pytest.fixture(scope="module")
def reference(model):
    return greedy_full_forward(model, PROMPTS, STEPS)


def _run(engine):
    """Greedy outputs of PROMPTS, checking after every iteration that each running request's pages lie in its
    rank's range; also the rank each request ran on."""
    dp = engine.placement
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    ranks, results = {}, {}
    while engine.has_work:
        for out in engine.step():
            results[out.request_id] = out
        for request in engine.scheduler.running:
            rank = request.slot // dp.layout.max_slots
            ranks[request.request_id] = rank
            pages = np.asarray(engine.scheduler.pages.owned.get(request.slot, []))
            assert ((pages // dp.layout.num_pages) == rank).all(), (request.slot, pages)
    return [results[i] for i in ids], [ranks[i] for i in ids]


def _check(outputs, reference):
    for out, (tokens, logits) in zip(outputs, reference, strict=True):
        assert out.token_ids == tokens
        np.testing.assert_allclose(np.stack(out.logits), logits, atol=1e-5, rtol=0)


def _collectives(engine) -> set[str]:
    return {op for step in engine.compiled.values() for op in COLLECTIVES if op in step.step.as_text()}


def test_dp2_engine_equals_single_device_and_keeps_ranks_apart(model, reference):
    engine = Engine(model, mesh="dp=2", **ENGINE)
    outputs, ranks = _run(engine)
    _check(outputs, reference)
    assert ranks == [0, 1, 0, 1]  # the least-loaded rank takes each new request
    assert _collectives(engine) == set()  # every rank attends over its own slots and pages: nothing gathered
    assert "eplb_balancedness" not in engine.stats  # no expert shards


def test_dp4_ep2_engine_with_eplb_rebalancing_mid_run_equals_single_device(model, reference):
    """4 attention ranks, experts over 2 shards with 2 redundant slots: one run without rebalancing, one that
    rebalances every 2 steps; both give the single-device tokens and logits, and the hot expert gets replicas."""
    # one token per prefill row: with one slot per rank the prefill and decode steps share one compiled bucket
    engine = Engine(model, mesh="dp=4,ep=2", redundant_experts=2, eplb_every=0,
                    **ENGINE | dict(prefill_chunk=1, max_prefill_rows=4))
    _check(_run(engine)[0], reference)
    before = engine.stats["eplb_balancedness"]
    engine.placement.eplb_every = 2
    outputs, ranks = _run(engine)
    _check(outputs, reference)
    assert sorted(ranks) == [0, 1, 2, 3]
    assert engine.stats["eplb_rebalances"] >= 2
    after = engine.stats["eplb_balancedness"]
    hot = engine.placement.experts.logcnt[1:, 0]
    print(f"\nexpert-shard balancedness {before:.3f} before, {after:.3f} after rebalancing; expert 0 replicas "
          f"{hot.tolist()} of 6 slots")
    assert 0 < before < after <= 1 and (hot > 1).all()
    # the weights moved with the maps: every slot holds its logical expert's weights, split over ep
    w1 = model.params["layers"][1]["ffn"]["experts"]["w1"][...]
    moved = engine.placement.model.params["layers"][1]["ffn"]["experts"]["w1"][...]
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(w1)[engine.placement.experts.phy2log[1]])
    assert moved.sharding.spec[0] == "ep"
    assert list(engine.compiled) == [(1, 1, 1, engine.layout.pages_per_slot)] and _collectives(engine) == {"all-to-all"}  # the expert dispatch only; the caches stay on their ranks
    metrics = ServerMetrics("tiny")
    metrics.observe_eplb(engine.stats)
    line = next(l for l in metrics.render().decode().splitlines() if l.startswith("jaxseek:eplb_balancedness{"))
    assert float(line.split()[-1]) == pytest.approx(after)


@pytest.mark.parametrize("layer_programs", [False, True])
def test_dp4_ep2_engine_with_eplb_serves_stored_fp4_experts(model, tmp_path, layer_programs):
    """The model converted to DeepSeek's layout and loaded as stored (FP8 linears, packed FP4 experts; its BF16
    matrices widened to F32, so that bf16 rounding does not hide a wrong token): its expert codes and scales
    split over 2 shards with 2 redundant slots, rebalanced every 2 steps, give the tokens and logits of the same
    stored model on one device, as one program and as layer programs."""
    save_checkpoint(model, tmp_path / "fp32")
    convert(tmp_path / "fp32", tmp_path / "fp8", progress=False)
    stored = load_model(widened_to_f32(tmp_path / "fp8", tmp_path / "fp8_f32"), weights="checkpoint")
    assert isinstance(stored.module().layers[1].ffn.experts, Fp4Experts)
    engine = Engine(stored, mesh="dp=4,ep=2", redundant_experts=2, eplb_every=2, layer_programs=layer_programs,
                    **ENGINE | dict(prefill_chunk=1, max_prefill_rows=4))
    assert (engine.layer_plan is not None) == layer_programs
    _check(_run(engine)[0], greedy_full_forward(stored, PROMPTS, STEPS))
    assert engine.stats["eplb_rebalances"] >= 2
    scales = engine.placement.model.params["layers"][1]["ffn"]["experts"]["w1_scale"][...]
    assert scales.shape[0] == CONFIG.n_routed_experts + 2 and scales.sharding.spec[0] == "ep"


def test_mesh_arguments_are_validated(model):
    with pytest.raises(ValueError, match="divide over the 8"):
        Engine(model, mesh="dp=8", max_slots=4, max_len=48)
    with pytest.raises(ValueError, match="ep > 1"):
        Engine(model, mesh="dp=2", eplb_every=4, max_slots=4, max_len=48)
    with pytest.raises(ValueError, match="needs a mesh"):
        Engine(model, redundant_experts=2, max_slots=4, max_len=48)


def test_ranks_take_requests_by_load_and_preempt_only_their_own():
    """Host-side: 2 ranks of 2 slots and 2 pages. A new request goes to the rank with the least pending prefill
    plus uncached tokens (16 + 8 against 8, then 24 against 16, then a tie broken by the fewer running requests);
    when the first request needs a second page, its rank preempts its own latest arrival, not the later ones of
    the other rank (whose pages it could not use)."""
    layout = CacheLayout(max_slots=4, max_len=32, num_pages=4, page_tokens=16, ring=8, vocab_size=256)
    scheduler = DataParallelScheduler(layout, 16, 64, 4, False, ranks=2)
    requests = [Request(f"r{i}", [1] * n, SamplingParams(max_tokens=8, ignore_eos=True), arrival=float(i))
                for i, n in enumerate((16, 8, 8, 8))]
    for request in requests:
        scheduler.add(request)
    _, prefill = scheduler.schedule(in_flight=False)
    assert [r.slot for r in requests] == [0, 2, 3, 1]
    assert [scheduler.pages.owned[r.slot] for r in requests] == [[0], [2], [3], [1]]
    for row in prefill:  # the prompts are in the cache and each sampled a token
        row.request.computed += len(row.tokens)
        row.request.output.append(5)
    decode, _ = scheduler.schedule(in_flight=False)  # r0 reaches position 16: a second page
    assert [row.request.request_id for row in decode] == ["r0", "r1", "r2"]
    assert [r.preemptions for r in requests] == [0, 0, 0, 1] and scheduler.pages.owned[0] == [0, 1]
