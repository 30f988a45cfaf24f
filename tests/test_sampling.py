"""Sampling: parameter validation, processed logits vs numpy re-derivations, distributions, batch invariance."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.sampling_keys import PURPOSE_SAMPLE, first_argmax, request_key
from serving.base.sampling import SamplingBatch, SamplingParams, processed_logits, sample, sampling_fields

run = jax.jit(sample, static_argnums=5)
process = jax.jit(processed_logits)


def _sample(logits, params, positions=None, prompt_mask=None, counts=None, n=0):
    logits = np.asarray(logits, np.float32)
    r, v = logits.shape
    positions = np.zeros(r, np.int32) if positions is None else np.asarray(positions, np.int32)
    prompt_mask = np.zeros((r, v), bool) if prompt_mask is None else prompt_mask
    counts = np.zeros((r, v), np.int32) if counts is None else counts
    out = run(logits, SamplingBatch.from_params(params, r), positions, prompt_mask, counts, n)
    return jax.tree.map(np.asarray, out)


def _process(logits, params, prompt_mask=None, counts=None):
    logits = np.asarray(logits, np.float32)
    r, v = logits.shape
    prompt_mask = np.zeros((r, v), bool) if prompt_mask is None else prompt_mask
    counts = np.zeros((r, v), np.int32) if counts is None else counts
    return np.asarray(process(logits, SamplingBatch.from_params(params, r), prompt_mask, counts))


def _ref_process(logits, p: SamplingParams, prompt_mask, counts):
    """Numpy re-derivation (float64) of the documented pipeline for one row."""
    x = logits.astype(np.float64)
    seen = prompt_mask | (counts > 0)
    x = np.where(seen & (x > 0), x / p.repetition_penalty, np.where(seen, x * p.repetition_penalty, x))
    x = x - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
    if p.temperature == 0:
        return x
    x = x / p.temperature
    keep = np.ones(x.shape, bool)
    if p.top_k:
        keep &= x >= np.sort(x)[::-1][min(p.top_k, len(x)) - 1]
    if p.top_p < 1:
        probs = np.where(keep, np.exp(x - x.max()), 0)
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        cum = 0.0
        allowed = np.zeros(x.shape, bool)
        for i in order:  # add tokens until the kept mass reaches p
            allowed[i] = True
            cum += probs[i]
            if cum >= p.top_p:
                break
        keep &= x >= x[allowed].min()
    keep &= np.exp(x - x.max()) >= p.min_p
    return np.where(keep, x, -np.inf)


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# --- SamplingParams -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", 1_000_001), ("max_tokens", True), ("max_tokens", 3.0),
    ("temperature", -0.1), ("temperature", 101), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", True), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -1), ("top_k", 2.5), ("top_k", False),
    ("min_p", -0.1), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", 100.5), ("repetition_penalty", float("nan")),
    ("presence_penalty", 2.1), ("presence_penalty", -2.1), ("frequency_penalty", 2.5), ("frequency_penalty", -3),
    ("seed", -1), ("seed", 2**63), ("seed", True), ("seed", 1.0),
    ("stop", "x"), ("stop", [""]), ("stop", ["a"] * 17), ("stop", [1]),
    ("stop_token_ids", [1, -2]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("ignore_eos", 1), ("logprobs", -1), ("logprobs", 21), ("logprobs", True),
])
def test_bad_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_valid_params_are_normalised():
    p = SamplingParams(max_tokens=1_000_000, temperature=0, top_p=1, top_k=5, min_p=1, repetition_penalty=100,
                       presence_penalty=-2, frequency_penalty=2, seed=2**63 - 1, stop=["a", "b"],
                       stop_token_ids=[0, 7], ignore_eos=True, logprobs=20)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.stop == ("a", "b") and p.stop_token_ids == (0, 7)
    assert SamplingParams().max_tokens == 16 and SamplingParams().seed is None


def test_from_dict_aliases_and_logprob_styles():
    assert SamplingParams.from_dict({"max_completion_tokens": 7}).max_tokens == 7
    assert SamplingParams.from_dict({"max_tokens": 7, "max_completion_tokens": 7}).max_tokens == 7
    with pytest.raises(ValueError, match="max_completion_tokens"):
        SamplingParams.from_dict({"max_tokens": 7, "max_completion_tokens": 8})
    assert SamplingParams.from_dict({"logprobs": True, "top_logprobs": 3}).logprobs == 3
    assert SamplingParams.from_dict({"logprobs": True}).logprobs == 0
    assert SamplingParams.from_dict({"logprobs": False}).logprobs is None
    assert SamplingParams.from_dict({"logprobs": 2}).logprobs == 2
    for bad in ({"top_logprobs": 2}, {"logprobs": False, "top_logprobs": 2}, {"logprobs": 2, "top_logprobs": 2}):
        with pytest.raises(ValueError, match="top_logprobs"):
            SamplingParams.from_dict(bad)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams.from_dict({"logprobs": True, "top_logprobs": 21})
    p = SamplingParams.from_dict({"stop": "###", "seed": None, "temperature": None, "n": 1, "top_k": 4})
    assert p.stop == ("###",) and p.seed is None and p.temperature == 1.0 and p.top_k == 4


def test_from_dict_rejects_unknown_fields_and_n():
    with pytest.raises(ValueError, match="best_of.*messages|messages.*best_of"):
        SamplingParams.from_dict({"temperature": 0.5, "messages": [], "best_of": 2})
    with pytest.raises(ValueError, match="JSON object"):
        SamplingParams.from_dict([("temperature", 1.0)])
    with pytest.raises(ValueError, match="n=2"):
        SamplingParams.from_dict({"n": 2})
    assert {"max_completion_tokens", "top_logprobs", "n", "stop", "seed"} <= sampling_fields()


def test_batch_from_params_pads_and_splits_seed():
    b = SamplingBatch.from_params([None, SamplingParams(seed=(5 << 32) | 9, temperature=0.5, top_k=3)], 4)
    assert b.seed.dtype == np.uint32 and b.seed.tolist() == [[0, 0], [5, 9], [0, 0], [0, 0]]
    assert b.temperature.tolist() == [0, 0.5, 0, 0] and b.top_k.tolist() == [0, 3, 0, 0]
    assert b.repetition_penalty.tolist() == [1] * 4 and b.top_p.tolist() == [1] * 4
    assert b.logprobs.tolist() == [-1] * 4
    assert SamplingBatch.from_params([SamplingParams(seed=0, logprobs=3)], 1).logprobs.tolist() == [3]
    with pytest.raises(ValueError, match="seed"):
        SamplingBatch.from_params([SamplingParams()], 2)
    with pytest.raises(ValueError, match="rows"):
        SamplingBatch.from_params([None] * 3, 2)


def test_request_key_is_the_seed_key():
    """A seed below 2**32 gives jax.random.key(seed) folded with position then purpose."""
    key = request_key(jnp.array([0, 1234], jnp.uint32), jnp.int32(7), PURPOSE_SAMPLE)
    want = jax.random.fold_in(jax.random.fold_in(jax.random.key(1234), 7), PURPOSE_SAMPLE)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(want))


# --- processed logits -------------------------------------------------------------------------------------------

HAND = np.array([[3.0, 1.0, 2.0, 0.0, -1.0]], np.float32)  # probs ~ .636 .086 .234 .032 .012


@pytest.mark.parametrize("kwargs, allowed", [
    ({}, {0, 1, 2, 3, 4}),
    ({"top_k": 2}, {0, 2}), ({"top_k": 1}, {0}), ({"top_k": 99}, {0, 1, 2, 3, 4}),
    ({"top_p": 0.6}, {0}), ({"top_p": 0.7}, {0, 2}), ({"top_p": 0.9}, {0, 1, 2}),
    ({"min_p": 0.1}, {0, 1, 2}), ({"min_p": 0.3}, {0, 2}), ({"min_p": 1.0}, {0}),
    # top-p on the renormalised top 3 (~ .665 .245 .090): 0.9 is reached by two tokens here, three without top-k
    ({"top_k": 3, "top_p": 0.9}, {0, 2}), ({"top_k": 3, "top_p": 0.92}, {0, 1, 2}),
])
def test_truncation_keeps_exactly_the_allowed_set(kwargs, allowed):
    params = SamplingParams(seed=0, **kwargs)
    processed = _process(HAND, [params])[0]
    assert set(np.flatnonzero(np.isfinite(processed))) == allowed
    np.testing.assert_allclose(processed[list(allowed)], HAND[0, list(allowed)], rtol=1e-6)
    rows = 400  # every allowed token is reached over many seeds, and nothing else
    tokens = _sample(np.repeat(HAND, rows, 0), [SamplingParams(seed=s, **kwargs) for s in range(rows)]).tokens
    assert set(tokens.tolist()) == allowed


@pytest.mark.parametrize("top_p, allowed", [(0.5, {0}), (0.75, {0, 1}), (0.8, {0, 1, 2, 3}), (0.875, {0, 1, 2, 3})])
def test_top_p_boundary_is_inclusive_and_keeps_ties(top_p, allowed):
    """Probabilities exactly .5 .25 .125 .125: reaching p exactly stops; a tie with the last kept token stays."""
    logits = np.array([[0, -np.log(2), -2 * np.log(2), -2 * np.log(2)]], np.float32)
    processed = _process(logits, [SamplingParams(seed=0, top_p=top_p)])[0]
    assert set(np.flatnonzero(np.isfinite(processed))) == allowed


def test_processed_logits_match_numpy_reference():
    rng = np.random.default_rng(0)
    r, v = 24, 64
    logits = (rng.standard_normal((r, v)) * 3).astype(np.float32)
    prompt_mask = rng.random((r, v)) < 0.2
    counts = (rng.integers(0, 4, (r, v)) * (rng.random((r, v)) < 0.2)).astype(np.int32)
    params = [SamplingParams(
        seed=i, temperature=[0.0, 0.5, 1.0, 1.7][i % 4], top_k=[0, 1, 5, 40][i // 4 % 4],
        top_p=[1.0, 0.9, 0.5][i % 3], min_p=[0.0, 0.05, 0.3][i // 3 % 3],
        repetition_penalty=[1.0, 1.3, 0.8][i % 3], presence_penalty=[0.0, 0.5, -1.0][i // 2 % 3],
        frequency_penalty=[0.0, 0.25, -0.5][i // 5 % 3]) for i in range(r)]
    got = _process(logits, params, prompt_mask, counts)
    for i, p in enumerate(params):
        want = _ref_process(logits[i], p, prompt_mask[i], counts[i])
        np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want), err_msg=f"row {i}: {p}")
        np.testing.assert_allclose(got[i][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)


def test_penalties_by_hand_and_greedy_takes_penalised_argmax():
    logits = np.array([[2.0, -1.0, 0.5, -3.0, 1.5]], np.float32)
    prompt_mask = np.array([[True, False, False, False, False]])
    counts = np.array([[0, 2, 1, 0, 0]], np.int32)
    params = SamplingParams(temperature=0, seed=3, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25)
    want = [2 / 2, -1 * 2 - 0.5 - 2 * 0.25, 0.5 / 2 - 0.5 - 0.25, -3.0, 1.5]
    np.testing.assert_allclose(_process(logits, [params], prompt_mask, counts)[0], want, rtol=1e-6)
    assert _sample(logits, [params], prompt_mask=prompt_mask, counts=counts).tokens[0] == 4
    assert _sample(logits, [SamplingParams(temperature=0, seed=3)]).tokens[0] == 0


def test_greedy_is_argmax():
    logits = np.random.default_rng(1).standard_normal((8, 300)).astype(np.float32)
    params = [SamplingParams(temperature=0.0, seed=i, top_k=5) for i in range(5)] + [None]
    np.testing.assert_array_equal(_sample(logits, params).tokens, logits.argmax(-1))


# --- sampling ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 0), (2.0, 0), (1.0, 3)])
def test_sampling_frequencies_match_softmax(temperature, top_k):
    logits = np.array([1.0, 0.2, -0.5, 0.9, -1.5], np.float32)
    rows = 4000
    params = [SamplingParams(seed=s, temperature=temperature, top_k=top_k) for s in range(rows)]
    tokens = _sample(np.tile(logits, (rows, 1)), params, positions=np.arange(rows) % 7).tokens
    x = logits.astype(np.float64) / temperature
    if top_k:
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    want = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    freq = np.bincount(tokens, minlength=5) / rows
    assert np.abs(freq - want).max() < 0.03, (freq, want)


def test_row_result_is_independent_of_batch():
    """Same (seed, position) gives bit-identical outputs in batches of 1, 3 and 8, at any row index."""
    rng = np.random.default_rng(2)
    v, n = 500, 4

    def random_params(seed):
        return SamplingParams(
            seed=seed, temperature=float(rng.choice([0.0, 0.6, 1.0, 1.5])), top_k=int(rng.choice([0, 10, 100])),
            top_p=float(rng.choice([1.0, 0.9, 0.6])), min_p=float(rng.choice([0.0, 0.02])),
            repetition_penalty=float(rng.choice([1.0, 1.2])), presence_penalty=float(rng.choice([0.0, 0.4])),
            frequency_penalty=float(rng.choice([0.0, 0.3])))

    def random_row(seed):
        return (random_params(seed), (rng.standard_normal(v) * 2).astype(np.float32), int(rng.integers(0, 9000)),
                rng.random(v) < 0.05, (rng.integers(0, 3, v) * (rng.random(v) < 0.05)).astype(np.int32))

    targets = [random_row(seed) for seed in rng.integers(0, 2**63, 12)]
    targets = [(SamplingParams(seed=2**40 + i, temperature=1.0),) + t[1:] for i, t in enumerate(targets[:4])] + targets

    def run_batch(rows):
        params, logits, pos, mask, counts = zip(*rows)
        return _sample(np.stack(logits), list(params), np.array(pos), np.stack(mask), np.stack(counts), n)

    for target in targets:
        results = []
        for size in (1, 3, 8):
            for index in {0, size // 2, size - 1}:
                others = [random_row(int(rng.integers(0, 2**62))) for _ in range(size - 1)]
                out = run_batch(others[:index] + [target] + others[index:])
                results.append(jax.tree.map(lambda x: x[index], out))
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    single = [run_batch([t]) for t in targets]
    assert len({int(s.tokens[0]) for s in single}) > 4  # the targets really sample (not all the same token)


def test_seed_and_position_matter():
    rows, v = 64, 1000
    logits = np.zeros((rows, v), np.float32)
    by_seed = _sample(logits, [SamplingParams(seed=s) for s in range(rows)]).tokens
    high_bits = _sample(logits, [SamplingParams(seed=s + 2**32) for s in range(rows)]).tokens
    by_position = _sample(logits, [SamplingParams(seed=7)] * rows, positions=np.arange(rows)).tokens
    repeat = _sample(logits, [SamplingParams(seed=s) for s in range(rows)]).tokens
    assert len(set(by_seed.tolist())) > 40 and len(set(by_position.tolist())) > 40
    assert (by_seed != high_bits).sum() > 40  # the seed's high 32 bits are used
    np.testing.assert_array_equal(by_seed, repeat)


def test_first_argmax_is_numpys_argmax():
    """Ties go to the first index; -inf entries, a row of only -inf and leading batch axes as np.argmax."""
    rng = np.random.default_rng(5)
    x = rng.integers(-3, 3, (4, 7, 50)).astype(np.float32)  # many ties
    x[0, 0] = -np.inf
    x[1, 2, 10:] = -np.inf
    x[2, 3, :] = np.float32(7.0)
    np.testing.assert_array_equal(jax.jit(first_argmax)(x), np.argmax(x, axis=-1))


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(3)
    r, v, n = 6, 200, 5
    logits = (rng.standard_normal((r, v)) * 4).astype(np.float32)
    params = [SamplingParams(seed=i, temperature=[0.0, 0.3, 1.0][i % 3], top_k=3, repetition_penalty=1.5,
                             frequency_penalty=1.0, logprobs=None if i == 1 else n) for i in range(r)]
    counts = (rng.random((r, v)) < 0.3).astype(np.int32)
    out = _sample(logits, params, counts=counts, prompt_mask=rng.random((r, v)) < 0.3, n=n)
    want = _log_softmax(logits)
    np.testing.assert_allclose(out.logprob, want[np.arange(r), out.tokens], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-want, axis=-1, kind="stable")[:, :n])
    np.testing.assert_allclose(out.top_logprobs, np.sort(want, -1)[:, ::-1][:, :n], atol=1e-5)
    none = _sample(logits, params, n=0)
    assert none.top_ids.shape == (r, 0) and none.top_logprobs.shape == (r, 0)
    # a batch in which no row asks for logprobs skips them: the same tokens, zero logprobs
    unasked = _sample(logits, [dataclasses.replace(p, logprobs=None) for p in params], counts=counts, n=n)
    np.testing.assert_array_equal(unasked.tokens, _sample(logits, params, counts=counts, n=n).tokens)
    assert not unasked.logprob.any() and not unasked.top_logprobs.any()

