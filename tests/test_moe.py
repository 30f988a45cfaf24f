"""MoE: the per-pair expert slices (few tokens), every token through every expert (batched decode of few
experts) and the expert-sorted tiles agree with a per-token numpy loop, and an expert no token chose is never
read."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import preset
from model.moe import Experts


@pytest.mark.parametrize("tokens, experts, busy", [(1, 4, False), (9, 4, False), (16, 8, False), (16, 8, True),
                                                   (40, 4, False), (20, 32, False)])
def test_experts_match_a_per_token_loop(tokens, experts, busy):
    # 2 pairs < 4 experts: per pair; 18 pairs: every token through every expert; 32 pairs of 8 experts: passes
    # of 8 pairs per expert (busy: every token on experts 0 and 1, two passes); 80 pairs, or 40 pairs of 32
    # experts (16 experts per chosen pair's 2): sorted tiles
    cfg = dataclasses.replace(preset("tiny"), n_routed_experts=experts)
    experts = Experts(cfg, jnp.float32, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(tokens, cfg.hidden_size)).astype(np.float32)
    chosen = cfg.n_routed_experts - 1  # the last expert gets no token: NaN weights that must never be read
    ids = np.stack([rng.choice(2 if busy else chosen, 2, replace=False) for _ in range(tokens)])
    weights = rng.random((tokens, 2)).astype(np.float32)
    w1, w2, w3 = (np.asarray(w[...], np.float64) for w in (experts.w1, experts.w2, experts.w3))
    for w in (experts.w1, experts.w2, experts.w3):
        w[...] = w[...].at[chosen].set(jnp.nan)
    out = np.asarray(experts(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights)))
    for t in range(tokens):
        expected = np.zeros(cfg.hidden_size)
        for e, w in zip(ids[t], weights[t]):
            gate, up = w1[e] @ x[t], w3[e] @ x[t]
            act = np.minimum(gate, 10) / (1 + np.exp(-np.minimum(gate, 10))) * np.clip(up, -10, 10)
            expected += w * (w2[e] @ act)
        np.testing.assert_allclose(out[t], expected, rtol=1e-4, atol=1e-5)


def test_many_experts_never_run_every_token_through_every_expert():
    """40 pairs over 32 experts (top-2): the compiled experts do not cost 16x the pairs' matmuls."""
    cfg = dataclasses.replace(preset("tiny"), n_routed_experts=32)
    experts = Experts(cfg, jnp.float32, nnx.Rngs(0))
    x = jnp.ones((20, cfg.hidden_size))
    ids = jnp.asarray(np.arange(40).reshape(20, 2) % 32, jnp.int32)
    flops = jax.jit(lambda x, ids: experts(x, ids, jnp.ones(ids.shape))).lower(x, ids).compile().cost_analysis()
    pairs = 40 * 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert flops["flops"] < 4 * pairs
