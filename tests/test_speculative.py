"""Speculative verification is lossless: greedy rows keep the target's argmax path, and with sampling the
emitted tokens follow the target's distribution whatever the drafter's (chi-square on a small vocabulary)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.speculation.speculative import verify

VOCAB, ROWS = 5, 20000
TARGET = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.6, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]]))
DRAFT = np.array([[0.1, 0.6, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])  # the drafter's q_0, q_1
CHI2_CRIT_4DOF = 18.47  # p = 0.001


def _batch(rows: int, draft_seed: int):
    keys = jax.random.split(jax.random.key(draft_seed), (rows, 2))
    drafts = jax.vmap(jax.vmap(lambda k, q: jax.random.categorical(k, jnp.log(q))), in_axes=(0, None))(
        keys, jnp.asarray(DRAFT))
    seeds = jnp.stack([jnp.zeros(rows, jnp.uint32), jnp.arange(rows, dtype=jnp.uint32)], axis=1)
    return (jnp.broadcast_to(jnp.asarray(TARGET, jnp.float32), (rows, 3, VOCAB)), drafts.astype(jnp.int32),
            jnp.broadcast_to(jnp.asarray(DRAFT, jnp.float32), (rows, 2, VOCAB)), seeds)


def _chi2(tokens, probs) -> float:
    counts = np.bincount(tokens, minlength=VOCAB)
    expected = probs * len(tokens)
    return float(np.sum((counts - expected) ** 2 / expected))


def test_rejection_sampling_emits_the_target_distribution():
    logits, drafts, q, seeds = _batch(ROWS, 0)
    v = verify(logits, drafts, q, jnp.full(ROWS, 2), jnp.zeros(ROWS, bool), seeds,
               jnp.broadcast_to(jnp.arange(10, 13), (ROWS, 3)))
    tokens, accepted = np.asarray(v.tokens), np.asarray(v.accepted)
    p = np.exp(TARGET)
    assert _chi2(tokens[:, 0], p[0]) < CHI2_CRIT_4DOF  # first emitted token ~ p_0
    second = accepted >= 1  # rows that emitted a second token: it follows p_1
    assert _chi2(tokens[second, 1], p[1]) < CHI2_CRIT_4DOF
    # the acceptance rate of draft 1 is sum_v min(p_0, q_0)
    assert abs(second.mean() - np.minimum(p[0], DRAFT[0]).sum()) < 0.01
    np.testing.assert_allclose(np.asarray(v.accept_prob[0]), np.minimum(p[:2], DRAFT).sum(axis=1), rtol=1e-5)
    bonus = accepted == 2  # every draft survived: a bonus token from p_2
    assert _chi2(tokens[bonus, 2], p[2]) < CHI2_CRIT_4DOF
    assert (tokens[np.arange(ROWS), accepted] >= 0).all() and (tokens[accepted < 2, 2] == -1).all()


def test_a_wrong_verifier_would_fail_the_check():
    """The statistic is sensitive: emitting the drafts unverified gives the drafter's distribution."""
    _, drafts, _, _ = _batch(ROWS, 0)
    assert _chi2(np.asarray(drafts[:, 0]), np.exp(TARGET[0])) > 100 * CHI2_CRIT_4DOF


@pytest.mark.parametrize("num_drafts", [0, 1, 2])
def test_greedy_rows_follow_the_argmax(num_drafts):
    logits = jnp.asarray(TARGET[None], jnp.float32)  # argmax path: 0, 2, 0
    seeds = jnp.zeros((1, 2), jnp.uint32)
    for drafts, expected_accepted in (([0, 2], 2), ([0, 1], 1), ([3, 2], 0)):
        v = verify(logits, jnp.asarray([drafts], jnp.int32), jnp.full((1, 2, VOCAB), 0.2), jnp.asarray([num_drafts]),
                   jnp.ones(1, bool), seeds, jnp.arange(3)[None])
        accepted = min(expected_accepted, num_drafts)
        assert int(v.accepted[0]) == accepted
        assert np.asarray(v.accept_prob[0]).tolist() == [float(d == a) for d, a in zip(drafts, [0, 2])]
        expected = ([0, 2, 0][:accepted] + [[0, 2, 0][accepted]] + [-1] * 3)[:3]
        assert np.asarray(v.tokens[0]).tolist() == expected


def test_verification_is_a_function_of_seed_and_position():
    logits, drafts, q, seeds = _batch(64, 1)
    args = (logits, drafts, q, jnp.full(64, 2), jnp.zeros(64, bool))
    a = verify(*args, seeds, jnp.broadcast_to(jnp.arange(3), (64, 3)))
    b = verify(*args, seeds, jnp.broadcast_to(jnp.arange(3), (64, 3)))
    c = verify(*args, seeds, jnp.broadcast_to(jnp.arange(100, 103), (64, 3)))
    assert (np.asarray(a.tokens) == np.asarray(b.tokens)).all()
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()
