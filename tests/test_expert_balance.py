"""EPLB inside the model on 8 emulated CPU devices: a rebalance between decode steps changes no output
(against the single-device run) and balances the shards of a skewed load."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.api import Model
from model.config import preset
from sharding.expert_balance import ExpertBalancer
from sharding.mesh import MeshSpec, make_mesh
from tests.helpers import random_model

BATCH, PROMPT, DECODE = 8, 6, 4


def _skewed_model():
    """tiny with a router bias that sends every token of the top-k-routed layers to expert 0."""
    module = random_model(preset("tiny"), seed=4).module()
    for blk in module.layers:
        if hasattr(blk.ffn.gate, "bias"):
            blk.ffn.gate.bias[...] = blk.ffn.gate.bias[...].at[0].add(10.0)
    return Model(module)


def _greedy(step, cache, prompt, between=lambda i: None):
    """Logits of the prompt and of DECODE greedy tokens; `between(i)` runs before decode step i."""
    logits, cache = step(prompt, cache)
    out = [np.asarray(logits)]
    for i in range(DECODE):
        between(i)
        logits, cache = step(np.asarray(logits[:, -1].argmax(-1))[:, None], cache)
        out.append(np.asarray(logits))
    return out


def test_rebalance_mid_generation_changes_no_output_and_balances_shards():
    model = _skewed_model()
    prompt = np.random.default_rng(5).integers(0, model.config.vocab_size, (BATCH, PROMPT))
    single = _greedy(model.step, model.init_cache(BATCH, PROMPT + DECODE), prompt)

    balancer = ExpertBalancer(model, make_mesh(MeshSpec.parse("dp=8,ep=4")), redundant_slots=4, window=8)
    before = []

    def rebalance(i):
        if i == 2:
            before.append(balancer.balancedness())
            balancer.rebalance()

    served = _greedy(balancer.step, balancer.init_cache(BATCH, PROMPT + DECODE), prompt, rebalance)
    for got, expected in zip(served, single, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    after = balancer.balancedness()
    hot = balancer.logcnt[1:, 0]
    print(f"\nshard balancedness (mean/max pairs per ep shard): {before[0]:.3f} before, {after:.3f} after the "
          f"rebalance; expert 0 replicas {hot.tolist()} of {balancer.slots} slots")
    assert after > before[0] and (hot > 2).all()  # the hot expert took more of the redundant slots
    # the weights moved with the maps: every slot holds its logical expert's weights
    w1 = nnx.split(model.module())[1]["layers"][1]["ffn"]["experts"]["w1"][...]
    moved = balancer.model.params["layers"][1]["ffn"]["experts"]["w1"][...]
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(w1)[balancer.phy2log[1]])
    assert moved.sharding.spec[0] == "ep" and jnp.asarray(balancer.phy2log).shape == (4, 8)
