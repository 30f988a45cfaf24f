"""Meshes and expert parallelism on 8 emulated CPU devices (tests/conftest.py) against one device.

The model-level check runs tiny-v41 on a dp x ep mesh with device-sharded Engram tables; the others cover
EP meshes, EPLB replica choice and its load window, the Engram owner gather, placement by the rules and
checkpoints restored onto another mesh."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from flax import nnx
from jax.sharding import PartitionSpec as P

from model.api import Model, abstract_model
from model.initialize import init_model
from model.axes import logical_axes
from model.config import preset
from model.dspark import DSparkConfig, DSparkDrafter
from model.engram import HostEngramTable
from pallas_kernels.moe import routed_experts_reference as routed_experts
from model.paged import is_paged
from serving.base.kv_cache import CacheLayout, init_engine_cache
from sharding.context_parallel import BATCH
from sharding.engram_shards import ShardedEngramTable, shard_engram
from sharding.eplb import ExpertLoadWindow, rebalance_experts
from sharding.expert_parallel import TOKEN_AXES, ExpertParallel, ExpertPlacement
from sharding.mesh import (MeshSpec, MeshSpecError, batch_sharded, logical_spec, logits_on_mesh, make_mesh,
                           param_shardings, shard_model)
from sharding.reshard import restore_params, save_params
from tests.helpers import random_model

E, D, I, T, K = 8, 16, 12, 10, 3


@pytest.fixture(scope="module")
def pairs():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    w1, w3 = (jnp.asarray(rng.normal(size=(E, I, D)) * 0.3, jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.normal(size=(E, D, I)) * 0.3, jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    weights = jnp.asarray(rng.random((T, K)), jnp.float32)
    return x, ids, weights, w1, w2, w3


def test_v41_logits_cp_dp_ep_with_sharded_engram_equal_single_device():
    """tiny-v41 with host Engram tables on one device == the sequence over 2 context ranks, requests over 4
    attention ranks, experts over 2 shards (all-to-all) and Engram rows over all 8 devices (owner gather)."""
    config = preset("tiny-v41")
    model = random_model(config, engram_placement="host")
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (8, 12))
    single = np.asarray(model.logits(tokens))
    mesh = make_mesh(MeshSpec.parse("cp=2,dp=4,ep=2"))
    sharded_engram = Model(model.module(), engram=shard_engram(model.engram, config, mesh))
    assert sharded_engram.engram.tables[0].weight.addressable_shards[0].data.shape[0] == -(-4062 // 8)
    logits = logits_on_mesh(sharded_engram, tokens, mesh)
    assert logits.sharding.spec[:2] == (("dp", "ep"), "cp")  # requests and sequence stayed split
    np.testing.assert_allclose(np.asarray(logits), single, atol=1e-5, rtol=0)


def test_sharded_engram_fp8_rows_equal_host_rows():
    rng = np.random.default_rng(2)
    weight = rng.normal(size=(1001, 64)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.integers(120, 130, (1001, 2)).astype(np.uint8)
    indices = rng.integers(0, 1001, (3, 5, 4))
    sharded = ShardedEngramTable(weight, scale, make_mesh(MeshSpec.parse("dp=8")))
    np.testing.assert_array_equal(sharded.gather(indices), HostEngramTable(weight, scale).gather(indices))


@pytest.mark.parametrize("spec", ["ep=8", "dp=4,ep=2"])
def test_ep_dispatch_equals_single_device(pairs, spec):
    mesh = make_mesh(MeshSpec.parse(spec))
    routed = jax.jit(ExpertParallel(mesh), static_argnums=6).lower(*pairs, 10.0).compile()
    expected = routed_experts(*pairs, 10.0)
    np.testing.assert_allclose(routed(*pairs), expected, atol=1e-5, rtol=0)
    assert "all-to-all" in routed.as_text()


def test_eplb_replicas_and_rebalancing_change_no_output(pairs):
    """Two placements from different loads (16 slots: 8 redundant) serve every token with its experts."""
    x, ids, weights, w1, w2, w3 = pairs
    mesh = make_mesh(MeshSpec.parse("ep=8"))
    routed = jax.jit(ExpertParallel(mesh), static_argnums=6)  # one compile serves both placements
    expected = routed_experts(x, ids, weights, w1, w2, w3, 10.0)
    outputs = []
    for load in ([[90, 1, 1, 1, 1, 1, 1, 1]], [[1, 2, 3, 4, 40, 30, 20, 10]]):
        placement = ExpertPlacement.from_eplb(*rebalance_experts(np.asarray(load, float), 16, 1, 1, 8))
        assert placement.logcnt.max() > 1  # the busy experts got replicas
        slots = placement.slots_of(ids)
        assert (placement.phy2log[np.asarray(slots)] == np.asarray(ids)).all()
        physical = [placement.physical(w) for w in (w1, w2, w3)]
        outputs.append(routed(x, slots, weights, *physical, 10.0))
        np.testing.assert_allclose(outputs[-1], expected, atol=1e-5, rtol=0)
    # the busiest expert's pairs are spread over its replicas' shards
    busy = ExpertPlacement.from_eplb(*rebalance_experts(np.asarray([[90, 1, 1, 1, 1, 1, 1, 1]], float), 16, 1, 1, 8))
    chosen = busy.slots_of(jnp.zeros((T, 1), jnp.int32))
    assert len(set(np.asarray(chosen).ravel().tolist())) == busy.logcnt[0]


def test_shard_model_places_experts_over_ep():
    mesh = make_mesh(MeshSpec.parse("dp=8,ep=4"))
    model = shard_model(init_model(preset("tiny")), mesh)
    w1 = model.params["layers"][0]["ffn"]["experts"]["w1"][...]
    assert w1.sharding.spec[0] == "ep" and w1.addressable_shards[0].data.shape[0] == 1
    assert model.params["embed"]["weight"][...].sharding.is_fully_replicated
    with pytest.raises(MeshSpecError, match="do not divide"):
        shard_model(init_model(preset("tiny")), make_mesh(MeshSpec.parse("ep=8")))


@pytest.mark.parametrize("name", ["tiny", "tiny-v41", "dspark-drafter"])
def test_every_parameter_carries_logical_axes_that_place_it_as_before(name):
    """Every parameter leaf (V4, V4.1, the DSpark drafter) names one logical axis per dimension where it is
    created, and the rules place it on the dp=8,ep=4 mesh (mesh axes dp=2, ep=4) as the path table did: routed
    experts' w1 / w2 / w3 over `ep` on their expert axis, everything else replicated."""
    if name == "dspark-drafter":
        target = preset("tiny-v41")
        config = DSparkConfig(target_layer_ids=(0, 1), num_layers=2, block_size=4, noise_token_id=0, markov_rank=8,
                              n_routed_experts=4, num_experts_per_tok=2, window=target.sliding_window)
        params = nnx.state(nnx.eval_shape(lambda: DSparkDrafter(target, config, nnx.Rngs(0))))
    else:
        params = abstract_model(preset(name)).params
    mesh = make_mesh(MeshSpec.parse("dp=8,ep=4"))
    assert dict(mesh.shape) == {"cp": 1, "dp": 2, "ep": 4}
    specs = dict(nnx.to_flat_state(param_shardings(params, mesh)))
    for path, variable in nnx.to_flat_state(params):
        assert len(logical_axes(variable)) == len(variable.shape), path
        routed = path[-3:-1] == ("ffn", "experts") and path[-1] in ("w1", "w2", "w3")
        before = P("ep", None, None) if routed else P(*[None] * len(variable.shape))
        assert specs[path].get_value().spec == before, path
    named = {("embed", "weight"): P(None, None), ("head", "weight"): P(None, None), ("norm", "weight"): P(None),
             ("layers", 0, "ffn", "gate", "weight"): P(None, None),
             ("layers", 0, "ffn", "experts", "w1"): P("ep", None, None),
             ("layers", 0, "ffn", "experts", "w2"): P("ep", None, None),
             ("layers", 1, "attn", "attn_sink"): P(None)}
    present = [path for path in named if path in specs]  # the drafter has no embedding or head of its own
    assert len(present) == len(named) or name == "dspark-drafter" and ("layers", 0, "ffn", "experts", "w1") in present
    for path in present:
        assert specs[path].get_value().spec == named[path], path


def test_cache_leaves_place_rows_and_pages_over_the_attention_ranks():
    """Reference cache leaves lead with `batch`, an engine cache's page pools with `pages`; both split over the
    attention ranks (`dp` and `ep` together), as the engine's cache always was; the token-axis constants of the
    expert- and context-parallel paths are the `batch` rule."""
    model = abstract_model(preset("tiny"))
    cache = jax.eval_shape(lambda: model.module().init_cache(2, 64))
    mesh = make_mesh(MeshSpec.parse("dp=8,ep=4"))
    for leaf, sharding in zip(jax.tree.leaves(cache), jax.tree.leaves(batch_sharded(mesh, cache)), strict=True):
        assert sharding.spec == (P(("dp", "ep"), *[None] * (leaf.ndim - 1)) if leaf.ndim else P())
    layout = CacheLayout.for_model(model.config, max_slots=2, max_len=64)
    engine = jax.eval_shape(lambda: init_engine_cache(model.module(), layout))
    axes = engine.axes()
    assert axes.layers[0]["ring_kv"][0] == "batch" and axes.last_token == ("batch",)  # tables come with each batch
    pools = [a for a in jax.tree.leaves(axes.layers, is_leaf=is_paged) if is_paged(a)]
    assert pools and all(a.pages[0] == "pages" and a.table is None for a in pools)
    assert logical_spec("batch") == logical_spec("pages") == P(("dp", "ep")) == P(TOKEN_AXES) == P(BATCH)


def test_checkpoint_saved_on_one_mesh_restores_onto_another(tmp_path):
    config = preset("tiny")
    saved = shard_model(init_model(config, seed=3), make_mesh(MeshSpec.parse("dp=8,ep=4")))
    save_params(saved, tmp_path / "params")
    restored = restore_params(tmp_path / "params", config, make_mesh(MeshSpec.parse("ep=2")))
    w1 = restored.params["layers"][0]["ffn"]["experts"]["w1"][...]
    assert w1.sharding.spec[0] == "ep" and w1.addressable_shards[0].data.shape[0] == 2
    for a, b in zip(jax.tree.leaves(saved.params), jax.tree.leaves(restored.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_window_drives_rebalancing():
    window = ExpertLoadWindow(num_layers=1, num_experts=E, window=2)
    for hot in (5, 2, 2):  # expert 5's step leaves the window
        window.record(np.full((1, T, K), hot))
    assert window.load()[0, 2] == 2 * T * K and window.load()[0, 5] == 0
    phy2log, _, logcnt = window.rebalance(16, 1, 1, 8)
    assert logcnt[0, 2] == 9 and (phy2log[0] == 2).sum() == 9  # the hot expert takes every redundant slot
    with pytest.raises(ValueError, match="expert ids"):
        window.record(np.full((1, T, K), E))
