"""Weights as stored: a converted checkpoint held as FP8 linears and packed FP4 experts computes what its fp32
decoding computes, holds the bytes its formats say, decodes exactly to bf16, and refuses malformed tensors."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from model.initialize import init_model
from model.linear import Fp8Linear, Linear
from model.moe import Fp4Experts
from model.checkpoint import CheckpointError, checkpoint_model, layout_for, load_model, save_checkpoint
from jaxseek.cli import main
from model.config import preset
from model.convert import convert
from model.quant import dequant_fp4_packed, dequant_fp8_blocks, quantize_fp4_packed, quantize_fp8_blocks
from model.safetensors_io import read_tensors, write_tensors
from model.stats import resident_bytes
from model.stored import FP4_EXPERT, FP8_LINEAR
from tests.helpers import random_model, widened_to_f32

CONFIG = preset("tiny")
TOKENS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 21))


def fp8_matrices(config) -> list[tuple[int, int]]:
    """(out, in) of every FP8 linear of a V4 config, listed from the architecture: per layer (main and MTP)
    wq_a, wq_b, wkv, wo_b, the shared expert's w1, w3, w2, a CSA layer's indexer wq_b; per MTP block e_proj
    and h_proj."""
    d, hd, q, inter = config.hidden_size, config.head_dim, config.q_lora_rank, config.moe_intermediate_size
    out = []
    for ratio in config.compress_ratios[:config.num_hidden_layers + config.num_nextn_predict_layers]:
        out += [(q, d), (config.num_attention_heads * hd, q), (hd, d), (d, config.o_groups * config.o_lora_rank),
                (inter, d), (inter, d), (d, inter)]
        if ratio == 4:
            out.append((config.index_n_heads * config.index_head_dim, q))
    return out + [(d, d), (d, d)] * config.num_nextn_predict_layers


def bf16_matrices(config) -> dict[str, tuple[int, int]]:
    """Name: (out, in) of every matrix DeepSeek's V4 checkpoints hold in BF16 (v4-architecture.md, the Flash
    headers), listed from the architecture: the embedding and head; per layer (main and MTP) wo_a and the
    router's gate; a compressing layer's compressor wkv / wgate (a ratio-4 one overlaps: twice the head), and a
    CSA (ratio 4) layer's indexer compressor wkv / wgate and weights_proj."""
    d, hd = config.hidden_size, config.head_dim
    out = {"embed.weight": (config.vocab_size, d), "head.weight": (config.vocab_size, d)}
    ratios = config.compress_ratios[:config.num_hidden_layers + config.num_nextn_predict_layers]
    for i, ratio in enumerate(ratios):
        stem = f"layers.{i}" if i < config.num_hidden_layers else f"mtp.{i - config.num_hidden_layers}"
        out[f"{stem}.attn.wo_a.weight"] = (config.o_groups * config.o_lora_rank,
                                           config.num_attention_heads * hd // config.o_groups)
        out[f"{stem}.ffn.gate.weight"] = (config.n_routed_experts, d)
        if ratio:
            for w in ("wkv", "wgate"):
                out[f"{stem}.attn.compressor.{w}.weight"] = (hd * (2 if ratio == 4 else 1), d)
        if ratio == 4:
            for w in ("wkv", "wgate"):
                out[f"{stem}.attn.indexer.compressor.{w}.weight"] = (2 * config.index_head_dim, d)
            out[f"{stem}.attn.indexer.weights_proj.weight"] = (config.index_n_heads, d)
    return out


def stored_bytes(config, fp32_bytes: int) -> int:
    """Resident bytes of a converted fp32 model: FP8 linears 1 B a value + one UE8M0 byte per 128x128 block,
    routed experts 0.5 B a value + one byte per 32 inputs of a row, the BF16 matrices 2 B a value, every other
    parameter (norms, mHC, sinks, ape, biases) still 4 B."""
    fp8 = fp8_matrices(config)
    experts = 3 * config.n_routed_experts * config.moe_intermediate_size * config.hidden_size
    n_layers = config.num_hidden_layers + config.num_nextn_predict_layers
    fp8_bytes = sum(o * i + math.ceil(o / 128) * math.ceil(i / 128) for o, i in fp8)
    expert_bytes = n_layers * (experts // 2 + experts // 32)
    bf16 = sum(o * i for o, i in bf16_matrices(config).values())
    return fp32_bytes - 4 * (sum(o * i for o, i in fp8) + n_layers * experts) + fp8_bytes + expert_bytes - 2 * bf16


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(fp32 model, its checkpoint, that checkpoint converted to FP8 / FP4)."""
    model = random_model(CONFIG, seed=4)
    root = tmp_path_factory.mktemp("stored")
    save_checkpoint(model, root / "fp32")
    convert(root / "fp32", root / "fp8", progress=False)
    return model, root / "fp32", root / "fp8"


def test_resident_model_computes_its_fp32_decoding(converted, tmp_path):
    """Held as stored, the FP8 linears and FP4 experts compute what their fp32 decoding computes: compared with
    the BF16 matrices widened to F32 (exactly), so that the decoding inside the matmuls is all that differs."""
    _, _, fp8_dir = converted
    layer = load_model(fp8_dir, weights="checkpoint").module().layers[2]
    assert layer.attn.wq_a.weight.dtype == ml_dtypes.float8_e4m3fn and layer.attn.wq_a.block == (128, 128)
    assert isinstance(layer.attn.wq_a, Fp8Linear) and isinstance(layer.ffn.experts, Fp4Experts)  # formats as types
    assert type(layer.attn.compressor.wkv) is Linear  # kept as the checkpoint has it
    assert layer.ffn.experts.w1.dtype == np.int8 and layer.ffn.experts.w1_scale.shape == (4, 32, 2)
    assert layer.attn.compressor.wkv.weight.dtype == ml_dtypes.bfloat16  # as DeepSeek's checkpoints hold it
    assert layer.attn.compressor.norm.weight.dtype == layer.hc_attn.fn.dtype == np.float32
    resident = load_model(widened_to_f32(fp8_dir, tmp_path / "f32"), weights="checkpoint")
    assert resident.module().layers[2].attn.wq_a.weight.dtype == ml_dtypes.float8_e4m3fn
    decoded = load_model(fp8_dir, weights="float32")
    diff = np.abs(np.asarray(resident.logits(TOKENS)) - np.asarray(decoded.logits(TOKENS))).max()
    assert diff <= 1e-4


def test_resident_bytes_follow_the_formats(converted):
    model, _, fp8_dir = converted
    fp32_bytes = resident_bytes(model)
    assert fp32_bytes == 4 * sum(x.size for x in jax.tree.leaves(model.params) if x.dtype == np.float32) + \
        4 * sum(x.size for x in jax.tree.leaves(model.params) if x.dtype == np.int32)
    resident = load_model(fp8_dir, weights="checkpoint")
    assert resident_bytes(resident) == stored_bytes(CONFIG, fp32_bytes) == resident_bytes(checkpoint_model(fp8_dir,
                                                                                                          "checkpoint"))
    # `small` converted (abstractly: the layout load_model builds, which `jaxseek study` counts): 21.8% of its
    # fp32 bytes
    small = preset("small")
    fp32_small = resident_bytes(layout_for(small, "float32").model(small))
    stored_small = resident_bytes(layout_for(small, "checkpoint").model(small))
    assert stored_small == stored_bytes(small, fp32_small) == 75_950_812
    assert stored_small / fp32_small <= 0.22


def _header(path) -> dict:
    """A safetensors file's header, read by hand: name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return {k: v for k, v in json.loads(f.read(size)).items() if k != "__metadata__"}


def test_convert_fp8_writes_the_rest_in_bf16(converted, tmp_path):
    """`convert --weights fp8` writes FP8 linears, packed FP4 experts, DeepSeek's BF16 matrices in BF16 and the
    rest (norms, mHC, sinks, ape, biases) in F32: the file's bytes are what the `checkpoint` layout holds (what
    `jaxseek study --param-format checkpoint` counts), and the model computes exactly what the source computes
    with its linears quantized and those matrices rounded to bf16 (by jnp, here)."""
    _, fp32_dir, fp8_dir = converted
    header = _header(fp8_dir / "model.safetensors")
    bf16 = bf16_matrices(CONFIG)
    assert {n for n, h in header.items() if h["dtype"] == "BF16"} == set(bf16)
    assert all(header[n]["shape"] == list(shape) for n, shape in bf16.items())
    assert {h["dtype"] for h in header.values()} == {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32", "I32"}
    assert {header[n]["dtype"] for n in ("norm.weight", "layers.1.attn_norm.weight", "layers.1.attn.attn_sink",
                                          "layers.1.attn.compressor.ape", "layers.1.hc_attn_fn", "hc_head_base",
                                          "layers.1.ffn.gate.bias")} == {"F32"}
    data = sum(h["data_offsets"][1] - h["data_offsets"][0] for h in header.values())
    assert data == resident_bytes(layout_for(CONFIG, "checkpoint").model(CONFIG))
    # the reference: the source, quantized and rounded by hand, loaded in fp32
    reference = {}
    for name, value in read_tensors(fp32_dir).items():
        value = np.asarray(value)
        if name in bf16:
            value = np.asarray(jnp.asarray(value).astype(jnp.bfloat16).astype(jnp.float32))
        elif FP8_LINEAR.match(name):
            value = dequant_fp8_blocks(*quantize_fp8_blocks(value, (128, 128)), (128, 128))
        elif FP4_EXPERT.search(name):
            value = dequant_fp4_packed(*quantize_fp4_packed(value))
        reference[name] = value
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "config.json").write_text((fp32_dir / "config.json").read_text())
    write_tensors(tmp_path / "ref" / "model.safetensors", reference)
    ours = np.asarray(load_model(fp8_dir, weights="float32").logits(TOKENS))
    np.testing.assert_array_equal(ours, np.asarray(load_model(tmp_path / "ref").logits(TOKENS)))
    # and the rounding to bf16 changed the model (the comparison above is not vacuous)
    unrounded = {n: v if n in bf16 else reference[n] for n, v in read_tensors(fp32_dir).items()}
    write_tensors(tmp_path / "ref" / "model.safetensors", unrounded)
    assert np.abs(ours - np.asarray(load_model(tmp_path / "ref").logits(TOKENS))).max() > 1e-5


def test_info_reports_the_resident_bytes(converted, capsys):
    _, _, fp8_dir = converted
    assert main(["info", "--model", str(fp8_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for weights in ("checkpoint", "bfloat16", "float32"):
        assert info[f"param_bytes_{weights}"] == resident_bytes(load_model(fp8_dir, weights=weights))


def test_bfloat16_load_is_the_exact_decoding(converted):
    """Each parameter loaded as bf16 equals the checkpoint's numpy decoding (`model.quant`) element for element."""
    _, _, fp8_dir = converted
    stored = read_tensors(fp8_dir)
    bf16 = load_model(fp8_dir, weights="bfloat16").module()
    wq_a = stored["layers.1.attn.wq_a.weight"], stored["layers.1.attn.wq_a.scale"]
    np.testing.assert_array_equal(np.asarray(bf16.layers[1].attn.wq_a.weight, np.float32),
                                  dequant_fp8_blocks(*wq_a))
    w2 = stored["layers.1.ffn.experts.3.w2.weight"], stored["layers.1.ffn.experts.3.w2.scale"]
    np.testing.assert_array_equal(np.asarray(bf16.layers[1].ffn.experts.w2[3], np.float32), dequant_fp4_packed(*w2))
    stored_paths = {path for path, v in nnx.to_flat_state(checkpoint_model(fp8_dir, "checkpoint").params)
                    if v.dtype in (ml_dtypes.float8_e4m3fn, np.int8)}
    assert len(stored_paths) == len(fp8_matrices(CONFIG)) + 3 * (CONFIG.num_hidden_layers + 1)
    fp32 = dict(nnx.to_flat_state(load_model(fp8_dir, weights="float32").params))
    for path, value in nnx.to_flat_state(load_model(fp8_dir, weights="bfloat16").params):
        if path in stored_paths:
            np.testing.assert_array_equal(np.asarray(value.get_value(), np.float32), np.asarray(fp32[path].get_value()))


def test_init_and_save_in_the_stored_form(tmp_path):
    model = init_model(CONFIG, seed=3, weights="checkpoint")
    save_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["expert_dtype"] == "fp4"
    stored = read_tensors(tmp_path)
    assert stored["layers.0.ffn.experts.1.w3.weight"].dtype == np.int8
    assert stored["layers.0.attn.wkv.scale"].dtype == ml_dtypes.float8_e8m0fnu
    reloaded = load_model(tmp_path, weights="checkpoint")
    np.testing.assert_array_equal(np.asarray(reloaded.logits(TOKENS)), np.asarray(model.logits(TOKENS)))


def test_convert_names_shards_and_back_to_bf16(converted, tmp_path):
    _, _, fp8_dir = converted
    convert(fp8_dir, tmp_path / "hf", names="hf", max_shard_bytes=50_000, progress=False)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "model.layers.0.attn.wq_a.scale" in index["weight_map"] and "lm_head.weight" in index["weight_map"]
    assert len(set(index["weight_map"].values())) > 3
    hf = load_model(tmp_path / "hf", weights="checkpoint")
    np.testing.assert_array_equal(np.asarray(hf.logits(TOKENS)),
                                  np.asarray(load_model(fp8_dir, weights="checkpoint").logits(TOKENS)))
    assert main(["convert", str(fp8_dir), str(tmp_path / "bf16"), "--weights", "bf16"]) == 0
    stored = read_tensors(tmp_path / "bf16")
    assert not any(n.endswith(".scale") for n in stored)
    assert stored["layers.0.attn.wq_a.weight"].dtype == ml_dtypes.bfloat16
    assert stored["layers.0.hc_attn_fn"].dtype == np.float32
    for a, b in zip(jax.tree.leaves(load_model(tmp_path / "bf16").params),
                    jax.tree.leaves(load_model(fp8_dir, weights="bfloat16").params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_convert_refuses_to_overwrite(converted, tmp_path, capsys):
    _, fp32_dir, _ = converted
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["convert", str(fp32_dir), str(tmp_path / "out")]) == 2
    assert "pass --force" in capsys.readouterr().err and (tmp_path / "out" / "keep.txt").exists()
    assert main(["convert", str(fp32_dir), str(tmp_path / "out"), "--force"]) == 0
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "model.safetensors").exists()


def _rewrite(src, dst, **changes):
    tensors = {k: np.array(v) for k, v in read_tensors(src).items()} | changes
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    write_tensors(dst / "model.safetensors", tensors)
    return dst


def test_a_scale_that_does_not_fit_its_weight_is_named(converted, tmp_path):
    _, _, fp8_dir = converted
    e8m0 = lambda shape: np.full(shape, 127, np.uint8).view(ml_dtypes.float8_e8m0fnu)  # noqa: E731
    bad = _rewrite(fp8_dir, tmp_path / "fp8", **{"layers.0.attn.wq_a.scale": e8m0((2, 1))})
    with pytest.raises(CheckpointError, match=r"tensor layers\.0\.attn\.wq_a\.scale has shape \[2, 1\]; "
                                              r"expected \[1, 1\]"):
        load_model(bad, weights="checkpoint")
    with pytest.raises(CheckpointError, match=r"cannot dequantize layers\.0\.attn\.wq_a\.weight"):
        load_model(bad, weights="float32")
    bad = _rewrite(fp8_dir, tmp_path / "fp4", **{"layers.2.ffn.experts.1.w2.scale": e8m0((64, 2))})
    with pytest.raises(CheckpointError, match=r"tensor layers\.2\.ffn\.experts\.1\.w2\.scale has shape \[64, 2\]; "
                                              r"expert 0's has \[64, 1\]"):
        load_model(bad, weights="checkpoint")
    two = e8m0((64, 2))
    bad = _rewrite(fp8_dir, tmp_path / "fp4_all", **{f"layers.2.ffn.experts.{e}.w2.scale": two for e in range(4)})
    with pytest.raises(CheckpointError, match=r"tensor layers\.2\.ffn\.experts\.0\.w2\.scale has shape \[64, 2\]; "
                                              r"expected \[64, 1\]"):
        load_model(bad, weights="checkpoint")


def test_fp4_needs_an_even_column_count(tmp_path):
    odd = dataclasses.replace(CONFIG, moe_intermediate_size=33)
    save_checkpoint(init_model(odd), tmp_path / "odd")
    with pytest.raises(ValueError, match=r"cannot quantize layers\.0\.ffn\.experts\.0\.w2\.weight \[64, 33\]: "
                                         r"packed FP4 needs an even number of columns"):
        convert(tmp_path / "odd", tmp_path / "out", progress=False)
    # a checkpoint whose packed experts cannot hold the model's 33 inputs of w2
    e8m0 = lambda shape: np.full(shape, 127, np.uint8).view(ml_dtypes.float8_e8m0fnu)  # noqa: E731
    packed = {}
    for layer, e in np.ndindex(odd.num_hidden_layers + odd.num_nextn_predict_layers, odd.n_routed_experts):
        stem = f"{'layers' if layer < odd.num_hidden_layers else 'mtp'}.{layer % odd.num_hidden_layers}.ffn.experts.{e}"
        for w, (rows, cols) in (("w1", (33, 64)), ("w3", (33, 64)), ("w2", (64, 34))):
            packed[f"{stem}.{w}.weight"] = np.zeros((rows, cols // 2), np.int8)
            packed[f"{stem}.{w}.scale"] = e8m0((rows, 2))
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.w2: packed FP4 needs an even number of inputs, "
                                         r"got 33"):
        load_model(_rewrite(tmp_path / "odd", tmp_path / "packed", **packed), weights="checkpoint")


def test_transient_memory_does_not_grow_with_depth():
    """Compiled memory analysis of a 16-row decode step: the temp bytes the stored form needs beyond the fp32
    model's stay under one layer's decoded experts, for 1 layer as for 3 (XLA would otherwise decode every
    layer's weights at the step's start and hold them all)."""
    extra = {}
    for layers in (1, 3):
        config = dataclasses.replace(CONFIG, hidden_size=64, moe_intermediate_size=256, n_routed_experts=8,
                                     num_hidden_layers=layers, num_nextn_predict_layers=0,
                                     compress_ratios=(0, 4, 16)[:layers])
        temp = {}
        for weights in ("checkpoint", "float32"):
            model = dataclasses.replace(layout_for(config, weights), dtype="float32").model(config)
            cache = jax.eval_shape(lambda m=model: m.init_cache(16, 32))
            compiled = model._forward.lower(model.params, jax.ShapeDtypeStruct((16, 1), np.int32), cache).compile()
            temp[weights] = compiled.memory_analysis().temp_size_in_bytes
        extra[layers] = temp["checkpoint"] - temp["float32"]
    layer_experts_fp32 = 3 * 8 * 256 * 64 * 4
    assert extra[1] <= layer_experts_fp32 and extra[3] <= layer_experts_fp32
    assert extra[3] - extra[1] <= layer_experts_fp32 / 4
