"""Balanced (zigzag) context parallelism on 8 emulated CPU devices against one device: the attention core
alone, the model's whole-sequence prefill, and the serving engine's chunked prefill split over `cp`."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.attention import window_ids
from pallas_kernels.sparse_attention import sink_attention_reference as sink_attention
from model.config import preset
import serving.core.engine
import sharding.context_parallel
from serving.base.sampling import SamplingParams
from serving.core.engine import Engine
from sharding.context_parallel import causal_work_per_rank, cp_attention, zigzag_order
from sharding.mesh import MeshSpec, logits_on_mesh, make_mesh
from tests.helpers import random_model
from tests.test_engine_mesh import V41, same_outputs

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


# three 16-token prefill chunks for the long prompt; a decode-length one beside it
ENGINE = dict(max_slots=4, max_len=64, page_tokens=16, prefill_chunk=16, max_prefill_rows=2, batch_invariant=True,
              num_top_logprobs=0, return_logits=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture
def split_chunks(monkeypatch):
    """Count the chunk widths each op of `RANK_SPLITS` is traced with under a context-parallel split (the
    engines' executables are not loaded from disk, so every step is traced)."""
    widths: collections.Counter = collections.Counter()
    monkeypatch.setattr(serving.core.engine, "directory", lambda: None)
    split = sharding.context_parallel.split_queries

    def counted(core, axes, cp):
        run = split(core, axes, cp)

        def traced(*args):
            widths[core.__name__.removesuffix("_reference"), args[0].shape[1]] += 1
            return run(*args)

        return traced

    monkeypatch.setattr(sharding.context_parallel, "split_queries", counted)
    return widths


SPLIT = {"sink_attention", "paged_sink_attention", "paged_index_scores"}


@pytest.mark.parametrize("config, mesh, options, split", [
    (preset("tiny"), "cp=2,dp=2,ep=2", dict(prefix_cache=True, speculation="fixed", num_drafts=1),
     SPLIT | {"paged_hca_attention"}),
    (V41, "cp=2,dp=2", dict(layer_programs=True), SPLIT),
], ids=["v4-ep-mtp-prefix", "v41-layer-programs"])
def test_engine_prefill_split_over_cp_equals_one_device(split_chunks, config, mesh, options, split):
    """The engine on cp=2: a 45-token prompt prefills in three chunks, each chunk's attention cores and indexer
    split zigzag over the two context ranks and its routed experts by halves (decode steps unsplit). V4 (window,
    CSA and HCA layers) with experts over `ep`, the prefix cache and MTP speculation; V4.1 (bounded replay) as
    layer programs. Greedy tokens, their logits and the long prompt's logprobs (every position) equal a plain
    single-device engine's within 1e-5."""
    model = random_model(config, seed=5, noise=0.05)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (45, 7)]
    params = [dataclasses.replace(GREEDY, prompt_logprobs=0), GREEDY]
    single = Engine(model, **ENGINE).generate(prompts, params)
    outputs = Engine(model, mesh=mesh, **options, **ENGINE).generate(prompts, params)
    same_outputs(outputs, single)
    got, want = ([e.logprob for e in o.prompt_logprobs[1:]] for o in (outputs[0], single[0]))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert {name for name, width in split_chunks if width == ENGINE["prefill_chunk"]} == split  # chunks split
