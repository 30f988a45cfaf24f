"""Speculative decoding in the engine: lossless against the plain model in every mode (greedy token for token;
sampled tokens distributed as the target's, by a chi-square test against the exact distribution), the budget
admission and the DSpark planner, metrics."""

import numpy as np
import pytest
from scipy import stats

from model.initialize import init_model
from model.dspark import init_drafter
from serving.core.engine import Engine
from serving.base.sampling import SamplingParams
from serving.speculation.speculative import admit
from serving.speculation.verify_plan import CostTable, interpolated, monotone_in_width, plan_verify, prefix_survival
from tests.helpers import greedy_full_forward
from tests.test_dspark import CONFIG, TARGET

V = TARGET.vocab_size
RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(0, V, n).tolist() for n in (5, 19, 11)]


@pytest.fixture(scope="module")
def model():
    m = init_model(TARGET, seed=0)
    m.drafter = init_drafter(TARGET, CONFIG, seed=1)
    return m


def run(model, mode, prompts, params, **kw):
    """Generate with a small engine. DSpark plans with fixed bucket costs under which verifying pays (a
    profiled table would make whether it speculates at all depend on the machine's timing) only with enough
    drafts: the narrowest verify bucket is a cliff, where the paper's stop at the first rate drop would never
    verify (1 draft per row: (rows + 1) / 1.6 < rows / 1). Buckets compile when first used (no `warmup`)."""
    engine = Engine(model, max_slots=2, max_len=64, page_tokens=16, prefill_chunk=16, max_prefill_rows=1,
                    speculation=mode, **kw)
    if mode == "dspark":
        engine.speculation.costs = CostTable({(r, w): 1.0 if w < 2 else 1.6 for r in engine.decode_rows
                                              for w in (0, 1) + engine.speculation.verify_widths}, window=0)
    return engine, engine.generate(prompts, params)


def plain_greedy(model, prompt, steps):
    """Greedy decoding by whole-sequence forwards of the plain model (one padded shape: compiled once)."""
    return greedy_full_forward(model, [prompt], steps)[0][0]


@pytest.mark.parametrize("mode,zero_overhead", [("fixed", True), ("dspark", False), ("dspark", True)])
def test_greedy_speculation_equals_plain_decoding(model, mode, zero_overhead):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    engine, outputs = run(model, mode, PROMPTS, params, zero_overhead=zero_overhead, verify_widths=(2, 4),
                          num_drafts=3)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == plain_greedy(model, prompt, 12)
        assert len(out.logprobs) == 12 and out.finish_reason == "length"
    metrics = engine.speculation_metrics()
    assert metrics["verified_per_step"] > 0 and metrics["tokens_per_step"] >= 1
    assert engine.scheduler.pages.idle() == engine.layout.num_pages  # every page came back


def exact_marginals(model, prompt, temperature):
    """P(first, second, third generated token) of the target at `temperature`: [V], [V], [V]."""
    soft = lambda x: np.exp(x / temperature - np.max(x / temperature, -1, keepdims=True))  # noqa: E731
    norm = lambda p: p / p.sum(-1, keepdims=True)  # noqa: E731
    p1 = norm(soft(np.asarray(model.logits(np.array([prompt])))[0, -1]))
    seqs = np.array([prompt + [a] for a in range(V)])
    p2_given = norm(soft(np.asarray(model.logits(seqs))[:, -1]))  # [V(first), V]
    seqs3 = np.array([prompt + [a, b] for a in range(V) for b in range(V)])
    p3_given = norm(soft(np.asarray(model.logits(seqs3))[:, -1])).reshape(V, V, V)
    joint12 = p1[:, None] * p2_given
    return p1, joint12.sum(0), np.einsum("ab,abc->c", joint12, p3_given)


def chi_square_p(counts, probs):
    """p-value of observed counts against probabilities, bins with expected < 5 merged into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


@pytest.mark.parametrize("mode", ["fixed", "dspark"])
def test_sampled_speculation_has_the_target_distribution(model, mode):
    """1,500 requests (seeds 0..1499) of three tokens with drafts verified by rejection sampling: the second and
    third tokens (emitted by verification) follow the target's exact marginals; the same test tells apart the
    target at twice the temperature. (The random model's logits are small: temperature 0.1 makes them peaked.)
    DSpark runs without zero-overhead scheduling: it plans the budget on the confidences of the block before
    the verified one, and the device splits it by the verified block's own. The engine is batch-invariant: one
    bucket per step kind to compile (the other tests here cover the bucket choice)."""
    prompt, temperature, n = PROMPTS[0], 0.1, 1500
    engine = Engine(model, max_slots=8, max_len=32, page_tokens=16, prefill_chunk=8, max_prefill_rows=4,
                    speculation=mode, num_drafts=2, zero_overhead=mode == "fixed", batch_invariant=True)
    if mode == "dspark":
        engine.speculation.costs = CostTable({(r, w): 1.0 + 0.02 * max(w - 1, 0) for r in engine.decode_rows
                                  for w in (0, 1, 2, 3)}, window=0)
    outputs = engine.generate([prompt] * n, [SamplingParams(temperature=temperature, max_tokens=3, seed=s,
                                                            ignore_eos=True) for s in range(n)])
    tokens = np.array([o.token_ids for o in outputs])
    assert 0.1 * n < engine.stats["accepted"] < 0.9 * engine.stats["verified"]  # drafts accepted and rejected
    p1, p2, p3 = exact_marginals(model, prompt, temperature)
    for j, p in enumerate((p1, p2, p3)):
        counts = np.bincount(tokens[:, j], minlength=V)
        assert chi_square_p(counts, p) > 1e-3, f"token {j + 1}"
    _, wrong2, _ = exact_marginals(model, prompt, temperature * 2)
    assert chi_square_p(np.bincount(tokens[:, 1], minlength=V), wrong2) < 1e-6


def test_admit_splits_the_budget_by_prefix_survival():
    survival = prefix_survival(np.array([[0.9, 0.9, 0.9], [0.5, 0.9, 0.9], [0.95, 0.2, 0.9]]))
    k = np.asarray(admit(survival, np.array([3, 3, 1]), np.int32(4)))
    # pairs by survival: (0,0) .9, (2,0) .95 ... (0,1) .81, (0,2) .729, (1,0) .5: the top 4 within caps
    np.testing.assert_array_equal(k, [3, 0, 1])
    np.testing.assert_array_equal(np.asarray(admit(survival, np.array([3, 3, 3]), np.int32(9))), [3, 3, 3])


def test_planner_trades_expected_tokens_against_bucket_cost():
    survival = prefix_survival(np.array([[0.9, 0.8, 0.5, 0.2, 0.1]]))
    flat = CostTable({(1, w): 1.0 for w in range(1, 7)})
    plan = plan_verify(survival, np.array([5]), 1, (1, 2, 3, 4, 5, 6), flat)
    assert plan.width == 6 and plan.budget == 5  # free verification: verify everything
    steep = CostTable({(1, w): 1.0 + 0.2 * (w - 1) for w in range(1, 7)})
    plan = plan_verify(survival, np.array([5]), 1, (1, 2, 3, 4, 5, 6), steep)
    # expected tokens 1 + cumulative survival = 1.9, 2.62, 2.98, 3.05, 3.06 over costs 1.2 .. 2.0
    rates = [(1 + np.cumsum(survival[0])[b - 1]) / (1 + 0.2 * b) for b in range(1, 6)]
    assert plan.budget == int(np.argmax(rates)) + 1 and plan.width == plan.budget + 1
    capped = plan_verify(survival, np.array([2]), 1, (1, 2, 4, 6), flat)
    assert (capped.budget, capped.width) == (2, 4)  # the row's cap; the narrowest bucket that fits it
    costly = CostTable({(1, 1): 1.0, **{(1, w): 10.0 for w in range(2, 7)}})
    assert plan_verify(survival, np.array([5]), 1, (1, 2, 3, 4, 5, 6), costly).width == 1
    for _ in range(50):  # plain decoding really takes 21 (host work): unobserved buckets shift by the same gap
        costly.observe(1, 1, 21.0)
    assert abs(costly(1, 1) - 21) < 0.01 and abs(costly(1, 6) - 30) < 0.01
    costly.observe(1, 1, 500.0)  # one slow iteration (a pause of the host) does not move the estimate
    assert abs(costly(1, 1) - 21) < 0.01
    costly.observe(1, 2, 500.0)  # nor a bucket's first observations
    assert abs(costly(1, 2) - 30) < 0.01
    assert plan_verify(survival, np.array([5]), 1, (1, 2, 3, 4, 5, 6), costly).width > 1


def test_unobserved_buckets_shift_by_the_gap_of_their_rows():
    """Host work grows with the rows: a b1 bucket takes the b1 gap, a b16 one the b16 gap, and rows never
    observed the median gap over all."""
    table = CostTable({(r, w): float(r + w) for r in (1, 4, 16) for w in (1, 6)})
    for _ in range(3):
        table.observe(1, 1, 2.0 + 1.0)
        table.observe(16, 1, 17.0 + 10.0)
    assert table(1, 6) == 7.0 + 1.0 and table(16, 6) == 22.0 + 10.0 and table(4, 6) == 10.0 + 5.5


def test_a_narrower_bucket_is_never_costlier_than_a_wider_one():
    timed = {(1, 0): 1.0, (1, 1): 3.0, (1, 2): 2.0, (1, 3): 2.5, (4, 1): 5.0, (4, 2): 4.0}
    assert monotone_in_width(timed) == {(1, 0): 1.0, (1, 1): 2.0, (1, 2): 2.0, (1, 3): 2.5, (4, 1): 4.0,
                                        (4, 2): 4.0}


def test_a_table_profiled_at_the_extremes_is_interpolated_in_width_then_rows():
    """Profiled at 1 and 16 rows, widths 0 (no drafting), 1 and 6: linear in the width at each profiled rows,
    then linear in the rows; still non-decreasing in the width."""
    profiled = {(1, 0): 1.0, (1, 1): 2.0, (1, 6): 4.0, (16, 0): 3.0, (16, 1): 4.0, (16, 6): 14.0}
    table = interpolated(profiled, (1, 2, 4, 8, 16), (1, 2, 4, 6))
    assert set(table) == {(r, w) for r in (1, 2, 4, 8, 16) for w in (0, 1, 2, 4, 6)}
    assert {k: table[k] for k in profiled} == profiled
    assert table[1, 2] == pytest.approx(2.4) and table[1, 4] == pytest.approx(3.2)  # 2 + 2 x 1/5, 2 + 2 x 3/5
    assert table[16, 2] == pytest.approx(6.0) and table[16, 4] == pytest.approx(10.0)  # 4 + 10 x 1/5, x 3/5
    # 4 rows lie 3/15 of the way from 1 to 16 rows
    assert [table[4, w] for w in (0, 1, 2, 4, 6)] == pytest.approx([1.4, 2.4, 3.12, 4.56, 6.0])
    assert monotone_in_width(table) == table


def test_planner_falls_back_to_decoding_without_drafts():
    survival = prefix_survival(np.array([[0.9, 0.8, 0.5, 0.2, 0.1]]))
    costs = {(1, 0): 1.0, (1, 1): 1.5, **{(1, w): 1.6 for w in range(2, 7)}}
    plan = plan_verify(survival, np.array([5]), 1, (1, 2, 3, 4, 5, 6), CostTable(costs))
    assert plan.width > 1 and plan.draft  # (1 + 2.62) / 1.6 > 1 / 1.0
    plan = plan_verify(survival, np.array([5]), 1, (1, 2, 3, 4, 5, 6), CostTable({**costs, (1, 0): 0.4}))
    assert (plan.width, plan.budget, plan.draft) == (1, 0, False)  # 1 / 0.4 beats every verify budget


def test_no_draft_fallback_pauses_and_resumes_drafting_losslessly(model):
    """Costs that make verification a loss: decode steps stop drafting (but probe now and then); costs that
    make it pay: the rows' drafts are stale until a step drafts again, then verification resumes. Greedy
    tokens equal plain decoding throughout."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = Engine(model, max_slots=2, max_len=64, page_tokens=16, prefill_chunk=16, max_prefill_rows=1,
                    speculation="dspark", verify_widths=(2, 4), num_drafts=3, probe_every=2)
    engine.warmup()
    costs = engine.speculation.costs
    # the no-draft bucket is profiled; which one measured cheaper depends on the machine's load (a narrower
    # bucket is never costlier: equal when noise inverted them)
    assert (2, 0) in costs and costs(2, 0) <= costs(2, 1)
    losing = {(2, 0): 1.0, (2, 1): 2.0, (2, 2): 50.0, (2, 4): 50.0}
    engine.speculation.costs = CostTable({**losing, **{(1, w): c for (_, w), c in losing.items()}}, window=0)
    ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
    results = {}
    for _ in range(9):
        results.update({o.request_id: o for o in engine.step()})
    paused, probed = engine.stats["nodraft_steps"], engine.stats["decode_rows"]
    assert engine.stats["verified"] == 0 and 0 < paused < probed / 2  # probes after 2, then 4 paused steps
    paying = {(r, w): 1.0 for r in (1, 2) for w in (0, 1, 2, 4)}
    engine.speculation.costs = CostTable(paying, window=0)
    results.update(engine.run())
    assert engine.stats["verified"] > 0 and engine.stats["nodraft_steps"] == paused
    for prompt, rid in zip(PROMPTS, ids):
        assert results[rid].token_ids == plain_greedy(model, prompt, 16)


def test_a_v4_mtp_block_drafts_in_the_engine_what_it_predicts_on_the_whole_sequence():
    """A V4 checkpoint's MTP block as the engine's one-token drafter: greedy output equals plain decoding, and
    every draft is the block's argmax at its position in a whole-sequence pass (`mtp_logits`), across prompt
    chunks (streams carried between steps), verify steps and zero-overhead reads."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from model.config import preset
    from tests.helpers import random_model

    v4 = random_model(preset("tiny"), seed=5)
    prompts = [RNG.integers(0, 256, n).tolist() for n in (21, 6)]
    engine = Engine(v4, max_slots=2, max_len=64, page_tokens=16, prefill_chunk=16, max_prefill_rows=1,
                    speculation="fixed", batch_invariant=True)  # one bucket per step kind: fewer compiles
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    seen, results = {rid: set() for rid in ids}, {}  # (outputs so far, the draft after them)
    while engine.has_work:
        results.update((out.request_id, out) for out in engine.step())
        for rid in ids:
            request = engine.requests.get(rid)
            if request is not None and request.output and request.drafts:
                seen[rid].add((len(request.output), request.drafts[0]))

    @jax.jit
    def mtp_argmax(params, tokens):  # [b, s]: the block's token at p + 2 from the whole sequences
        module = nnx.merge(v4.graphdef, params)
        streams, cache = module.streams(tokens[:, :-1], module.init_cache(len(prompts), 64))
        return jnp.argmax(module.mtp_logits(streams, tokens[:, 1:], cache)[0], -1)

    references = greedy_full_forward(v4, prompts, 14)
    sequences = np.zeros((len(prompts), 40), np.int32)  # zero padding after a sequence: the passes are causal
    for i, (prompt, (tokens, _)) in enumerate(zip(prompts, references)):
        sequences[i, :len(prompt) + 14] = prompt + tokens
    predicted = np.asarray(mtp_argmax(v4.params, jnp.asarray(sequences)))
    for i, (prompt, rid) in enumerate(zip(prompts, ids)):
        assert results[rid].token_ids == references[i][0]
        assert len(seen[rid]) >= 5
        for n, draft in seen[rid]:  # after n outputs the anchor sits at len(prompt) + n - 1
            assert draft == predicted[i, len(prompt) + n - 2]


def test_speculation_needs_a_drafter_and_valid_sizes(model):
    import dataclasses

    from tests.helpers import random_model
    from model.config import preset
    with pytest.raises(ValueError, match="DSpark drafter or an MTP block"):
        tiny = preset("tiny")
        no_mtp = dataclasses.replace(tiny, num_nextn_predict_layers=0,
                                     compress_ratios=tiny.compress_ratios[:tiny.num_hidden_layers])
        Engine(random_model(no_mtp), speculation="fixed")
    with pytest.raises(ValueError, match="num_drafts"):
        Engine(model, speculation="fixed", num_drafts=CONFIG.block_size + 1)
    with pytest.raises(ValueError, match="probe_every"):
        Engine(model, speculation="dspark", probe_every=0)
    with pytest.raises(ValueError, match="speculation must be"):
        Engine(model, speculation="sometimes")
