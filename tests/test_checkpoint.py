"""Checkpoint loading: FP8 / FP4 dequantisation end to end, shards, bf16, and errors that name the tensor."""

import json
import re

import numpy as np
import pytest

from model.checkpoint import CheckpointError, load_model, save_checkpoint, to_native
from model.config import preset
from model.quant import dequant_fp4_packed, dequant_fp8_blocks, quantize_fp4_packed, quantize_fp8_blocks
from model.safetensors_io import read_tensors, write_tensors
from tests.helpers import random_model

CONFIG = preset("tiny")
TOKENS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 37))
FP8_LINEAR = re.compile(r"\.(wq_a|wq_b|wkv|wo_b|e_proj|h_proj)\.weight$|shared_experts\.w[123]\.weight$")
FP4_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=2)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32")
    save_checkpoint(model, path)
    return path


def _write(path, tensors, quant_block=None, **config_fields):
    path.mkdir(parents=True, exist_ok=True)
    config = CONFIG.to_hf_dict() | config_fields
    if quant_block:
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(quant_block),
                                         "scale_fmt": "ue8m0"}
    (path / "config.json").write_text(json.dumps(config))
    write_tensors(path / "model.safetensors", tensors)
    return path


def test_fp8_and_fp4_checkpoint_loads_to_its_dequantised_values(model, tmp_path):
    """Attention / shared-expert weights in FP8 (16x16 blocks), routed experts in packed FP4."""
    block = (16, 16)
    quantized, dequantized = {}, {}
    for name, value in to_native(model).items():
        stem = name.removesuffix(".weight")
        if FP8_LINEAR.search(name):
            w, scale = quantize_fp8_blocks(value, block)
            quantized[name], quantized[stem + ".scale"] = w, scale
            dequantized[name] = dequant_fp8_blocks(w, scale, block)
        elif FP4_EXPERT.search(name):
            packed, scale = quantize_fp4_packed(value)
            quantized[name], quantized[stem + ".scale"] = packed, scale
            dequantized[name] = dequant_fp4_packed(packed, scale)
        else:
            quantized[name] = dequantized[name] = value
    assert sum(n.endswith(".scale") for n in quantized) > 40
    fp_model = load_model(_write(tmp_path / "dequantized", dequantized))
    q_model = load_model(_write(tmp_path / "quantized", quantized, block), weights="float32")
    ours, reference = np.asarray(q_model.logits(TOKENS)), np.asarray(fp_model.logits(TOKENS))
    np.testing.assert_array_equal(ours, reference)
    # and the quantisation really changed the model (the comparison above is not vacuous)
    assert np.abs(reference - np.asarray(model.logits(TOKENS))).max() > 1e-4


def test_sharded_checkpoint_round_trip(model, tmp_path):
    save_checkpoint(model, tmp_path, max_shard_bytes=100_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 3
    np.testing.assert_array_equal(np.asarray(load_model(tmp_path).logits(TOKENS)),
                                  np.asarray(model.logits(TOKENS)))


def test_bfloat16_load_keeps_fp32_sites(saved, model):
    bf16 = load_model(saved, weights="bfloat16")
    module = bf16.module()
    assert str(module.layers[1].attn.wq_a.weight.dtype) == "bfloat16"
    assert str(module.layers[1].hc_attn.fn.dtype) == "float32"
    assert str(module.layers[1].attn.attn_sink.dtype) == "float32"
    ours, ref = np.asarray(bf16.logits(TOKENS)), np.asarray(model.logits(TOKENS))
    assert np.abs(ours - ref).mean() < 0.05 * ref.std()  # bf16 rounding (and rare indexer flips), not a bug
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.85  # this random model's logits have near-ties


def test_dtype_is_an_alias_of_weights(saved, model):
    """`dtype` (the keyword before stored weights, the CLI's --dtype) loads what `weights` loads; `auto` is the
    default (float32 for this float checkpoint); the two disagreeing, or an unknown dtype, is refused."""
    bf16 = load_model(saved, dtype="bfloat16")
    assert str(bf16.module().layers[1].attn.wq_a.weight.dtype) == "bfloat16"
    np.testing.assert_array_equal(np.asarray(bf16.logits(TOKENS)),
                                  np.asarray(load_model(saved, weights="bfloat16").logits(TOKENS)))
    auto = load_model(saved, dtype="auto", weights=None)
    assert str(auto.module().layers[1].attn.wq_a.weight.dtype) == "float32"
    np.testing.assert_array_equal(np.asarray(auto.logits(TOKENS)), np.asarray(model.logits(TOKENS)))
    assert str(load_model(saved, weights="float32", dtype="float32").module().layers[1].attn.wq_a.weight.dtype) \
        == "float32"
    with pytest.raises(ValueError, match="weights='float32' and dtype='bfloat16' disagree"):
        load_model(saved, weights="float32", dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        load_model(saved, dtype="float16")


def _tensors(saved):
    return {k: np.array(v) for k, v in read_tensors(saved).items()}


def test_missing_tensor_is_named_with_its_shape(saved, tmp_path):
    tensors = _tensors(saved)
    del tensors["layers.1.attn.indexer.wq_b.weight"]
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.indexer\.wq_b\.weight with shape \[256, 32\]"):
        load_model(_write(tmp_path, tensors))


def test_missing_expert_is_named(saved, tmp_path):
    tensors = _tensors(saved)
    del tensors["layers.2.ffn.experts.1.w3.weight"]
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.w3: expert tensors \[1\] are missing"):
        load_model(_write(tmp_path, tensors))


def test_wrong_shape_is_named(saved, tmp_path):
    tensors = _tensors(saved)
    tensors["layers.0.attn.wkv.weight"] = np.zeros((31, 64), np.float32)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wkv\.weight has shape \[31, 64\]; expected \[32, 64\]"):
        load_model(_write(tmp_path, tensors))


def test_unexpected_tensor_is_named(saved, tmp_path):
    tensors = _tensors(saved)
    tensors["layers.0.attn.surprise"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*layers\.0\.attn\.surprise"):
        load_model(_write(tmp_path, tensors))


def test_scale_without_weight_and_bad_scale_shape(saved, tmp_path):
    tensors = _tensors(saved)
    tensors["layers.0.attn.nothing.scale"] = np.ones((1, 1), np.float32)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.nothing\.scale has no matching"):
        load_model(_write(tmp_path / "a", tensors))
    tensors = _tensors(saved)
    w, _ = quantize_fp8_blocks(tensors["layers.0.attn.wq_a.weight"], (128, 128))
    tensors["layers.0.attn.wq_a.weight"], tensors["layers.0.attn.wq_a.scale"] = w, np.ones((2, 2), np.uint8)
    with pytest.raises(CheckpointError, match=r"cannot dequantize layers\.0\.attn\.wq_a\.weight"):
        load_model(_write(tmp_path / "b", tensors))


def test_truncated_file_is_reported(saved, tmp_path):
    data = (saved / "model.safetensors").read_bytes()
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path)


def test_checkpoint_without_mtp_loads_without_mtp_blocks(saved, tmp_path, model):
    tensors = {k: v for k, v in _tensors(saved).items() if not k.startswith("mtp.")}
    with pytest.warns(UserWarning, match="no mtp"):
        loaded = load_model(_write(tmp_path, tensors))
    assert loaded.config.num_nextn_predict_layers == 0
    np.testing.assert_array_equal(np.asarray(loaded.logits(TOKENS)), np.asarray(model.logits(TOKENS)))


def test_an_incomplete_v4_dspark_drafter_is_named(saved, tmp_path):
    """A V4 checkpoint whose mtp.* tensors are a DSpark drafter (V4-Flash-0731's form; loads in
    tests/test_dspark_v4.py) with tensors missing: the error names one of them with its shape."""
    tensors = {k: v for k, v in _tensors(saved).items() if not k.startswith("mtp.")}
    d, rng = CONFIG.hidden_size, np.random.default_rng(0)
    tensors |= {"mtp.0.main_proj.weight": rng.normal(size=(d, 3 * d)).astype(np.float32),
                "mtp.2.markov_head.markov_w1.weight": rng.normal(size=(CONFIG.vocab_size, 16)).astype(np.float32)}
    n = CONFIG.num_hidden_layers
    path = _write(tmp_path, tensors, compress_ratios=list(CONFIG.compress_ratios[:n]) + [0, 0, 0],
                  dspark_block_size=5, dspark_markov_rank=16, dspark_noise_token_id=CONFIG.vocab_size - 1,
                  dspark_target_layer_ids=[n - 3, n - 2, n - 1])
    with pytest.raises(CheckpointError, match=r"lacks \d+ tensor\(s\), e\.g\. mtp\.0\.attn\.attn_sink with shape"):
        load_model(path)
