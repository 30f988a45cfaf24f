"""MoE: the per-pair switch (few tokens) and the expert-sorted tiles agree with a per-token numpy loop, and an
expert no token chose is never read."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import preset
from model.moe import Experts


@pytest.mark.parametrize("tokens", [1, 9, 40])  # 1 x 2 pairs < 4 experts: per pair; 18, 80 pairs: sorted tiles
def test_experts_match_a_per_token_loop(tokens):
    cfg = preset("tiny")
    experts = Experts(cfg, jnp.float32, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(tokens, cfg.hidden_size)).astype(np.float32)
    chosen = cfg.n_routed_experts - 1  # the last expert gets no token: NaN weights that must never be read
    ids = np.stack([rng.choice(chosen, 2, replace=False) for _ in range(tokens)])
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
