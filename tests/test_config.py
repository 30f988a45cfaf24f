"""ModelConfig: presets, the released config.json, the transformers spelling, and clear errors."""

import dataclasses
import json

import pytest

from model.config import CSA, HCA, SLIDING, ConfigError, ModelConfig, YarnScaling, preset

# deepseek-ai/DeepSeek-V4-Flash config.json (published values; see shared/reference/v4-architecture.md §8)
FLASH_JSON = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "first_k_dense_replace": 0, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64, "head_dim": 512,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "sliding_window": 128, "compress_rope_theta": 160000,
    "o_lora_rank": 1024, "o_groups": 8, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "num_hash_layers": 3, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "swiglu_limit": 10.0,
    "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def test_released_flash_config_is_the_preset():
    assert ModelConfig.from_hf_dict(FLASH_JSON) == preset("v4-flash")


def test_flash_and_pro_layer_schedules():
    flash, pro = preset("v4-flash"), preset("v4-pro")
    kinds = [flash.layer_kind(i) for i in range(flash.num_hidden_layers)]
    assert kinds.count(SLIDING) == 2 and kinds.count(CSA) == 21 and kinds.count(HCA) == 20
    kinds = [pro.layer_kind(i) for i in range(pro.num_hidden_layers)]
    assert kinds[:2] == [HCA, HCA] and kinds.count(CSA) == 30 and kinds.count(HCA) == 31
    assert flash.layer_kind(43) == SLIDING  # the MTP layer


@pytest.mark.parametrize("name", ["tiny", "small", "v4-flash", "v4-pro"])
def test_round_trip_through_json(name, tmp_path):
    cfg = preset(name)
    cfg.save_json(tmp_path)
    assert ModelConfig.from_json(tmp_path) == cfg


def test_transformers_spelling_is_read():
    hf = preset("tiny").to_hf_dict()
    del hf["compress_ratios"], hf["num_hash_layers"], hf["qk_rope_head_dim"], hf["rope_scaling"]
    hf["partial_rotary_factor"] = 0.25
    hf["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": 10000.0},
                             "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                                          "original_max_position_embeddings": 256, "beta_fast": 32,
                                          "beta_slow": 1, "attention_factor": 1.0}}
    assert ModelConfig.from_hf_dict(hf) == preset("tiny")


def test_short_compress_ratios_get_sliding_mtp_layers():
    d = dict(FLASH_JSON, compress_ratios=FLASH_JSON["compress_ratios"][:43])
    assert ModelConfig.from_hf_dict(d).compress_ratios[43] == 0


@pytest.mark.parametrize("change, message", [
    ({"bogus_field": 1}, "unknown config fields"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"compress_ratios": None}, "neither compress_ratios nor layer_types"),
    ({"layer_types": ["sliding_attention"] * 43}, "disagree with compress_ratios"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 16, "attention_factor": 1.3}}, "mscale"),
    ({"o_groups": 7}, "not divisible by o_groups"),
    ({"num_experts_per_tok": 300}, "exceeds n_routed_experts"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"mlp_layer_types": ["moe", "hash_moe"] + ["moe"] * 41}, "hash_moe layers must come first"),
])
def test_bad_configs_name_the_problem(change, message):
    d = {k: v for k, v in {**FLASH_JSON, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)


def test_hf_export_refuses_two_hca_ratios():
    cfg = dataclasses.replace(preset("tiny"), compress_ratios=(0, 4, 16, 32, 0))
    with pytest.raises(ConfigError, match="one HCA ratio"):
        cfg.to_hf_dict()


def test_hf_export_describes_the_schedule():
    hf = preset("tiny").to_hf_dict()
    assert hf["layer_types"] == ["sliding_attention", "compressed_sparse_attention",
                                 "heavily_compressed_attention", "compressed_sparse_attention"]
    assert hf["compress_rates"] == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    assert hf["mlp_layer_types"] == ["hash_moe", "moe", "moe", "moe"]
    assert json.loads(json.dumps(hf))["rope_scaling"]["type"] == "yarn"
    assert preset("tiny").rope_scaling == YarnScaling(factor=16.0, original_max_position_embeddings=256)
