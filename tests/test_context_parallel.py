"""Balanced (zigzag) context parallelism on 8 emulated CPU devices against one device: the attention core
alone, and the model's whole-sequence prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.attention import window_ids
from pallas_kernels.sparse_attention import sink_attention_reference as sink_attention
from model.config import preset
from sharding.context_parallel import causal_work_per_rank, cp_attention, zigzag_order
from sharding.mesh import MeshSpec, logits_on_mesh, make_mesh
from tests.helpers import random_model

B, S, H, D, W = 4, 32, 4, 16, 5


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    sink = jnp.asarray(rng.normal(size=(H,)), jnp.float32)
    return q, kv, sink


def test_zigzag_split_balances_causal_work():
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]  # rank r: chunks r and 2cp-1-r
    balanced, contiguous = causal_work_per_rank(4096, 8), causal_work_per_rank(4096, 8, zigzag=False)
    print(f"\ncausal pairs per rank, cp=8: zigzag {balanced.min()}..{balanced.max()}, "
          f"contiguous {contiguous.min()}..{contiguous.max()}")
    assert balanced.min() == balanced.max() and contiguous.max() > 10 * contiguous.min()
    with pytest.raises(ValueError, match="divisible"):
        zigzag_order(30, 8)


@pytest.mark.parametrize("spec", ["cp=8", "cp=2,dp=4"])
def test_cp_window_attention_equals_single_device(inputs, spec):
    """The sliding-window core as the model computes a whole-sequence prefill (empty ring + the chunk)."""
    q, kv, sink = inputs
    ids, valid = window_ids(jnp.full((B, W), -1, jnp.int32), jnp.arange(S), W)
    pool = jnp.concatenate([jnp.zeros((B, W, D)), kv], axis=1)
    expected = sink_attention(q, pool, ids, valid, sink)
    out = jax.jit(lambda q, kv, sink: cp_attention(make_mesh(MeshSpec.parse(spec)), q, kv, sink, W))(q, kv, sink)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)


def test_cp_causal_attention_equals_dense_reference(inputs):
    q, kv, sink = (np.asarray(a, np.float64) for a in inputs)
    scores = np.einsum("bshd,btd->bsht", q, kv) / np.sqrt(D)
    scores = np.where((np.arange(S)[None, :] <= np.arange(S)[:, None])[None, :, None, :], scores, -np.inf)
    peak = np.maximum(scores.max(-1, keepdims=True), sink[None, None, :, None])
    weights = np.exp(scores - peak)
    weights /= weights.sum(-1, keepdims=True) + np.exp(sink[None, None, :, None] - peak)
    expected = np.einsum("bsht,btd->bshd", weights, kv)
    mesh = make_mesh(MeshSpec.parse("cp=8"))
    out = jax.jit(lambda q, kv, sink: cp_attention(mesh, q, kv, sink, None))(*inputs)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)


def test_model_prefill_with_zigzag_cp_equals_single_device():
    """tiny (sliding window, CSA and HCA layers) with its attention split zigzag over cp=4 ranks (requests
    over 2 attention ranks): the same fp32 logits as one device."""
    model = random_model(preset("tiny"), seed=6)
    tokens = np.random.default_rng(7).integers(0, model.config.vocab_size, (2, 24))
    mesh = make_mesh(MeshSpec.parse("cp=4,dp=2"))
    np.testing.assert_allclose(np.asarray(logits_on_mesh(model, tokens, mesh)), np.asarray(model.logits(tokens)),
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="2·cp=8"):
        logits_on_mesh(model, tokens[:, :20], mesh)
