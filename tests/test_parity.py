"""fp32 logits equal transformers' DeepseekV4ForCausalLM (the oracle, run in its own Python 3.11 venv).

Weights travel both ways through safetensors: the oracle's `save_pretrained` files (HF `model.` names),
the oracle's native-name rewrite, and our own `save_checkpoint` output read back by the oracle.
"""

import dataclasses

import numpy as np
import pytest

from model.checkpoint import load_model, save_checkpoint
from model.config import ModelConfig, YarnScaling, preset
from pallas_kernels import registry
from tests.oracle_client import hf_dump_native, hf_init, hf_logits

TOL = 1e-4
TINY = preset("tiny")
CONFIGS = {
    # SWA + CSA + HCA(16) + CSA, one hash layer; 70 tokens -> 17 CSA entries (top-4 picks), 4 HCA entries
    "mixed": (dataclasses.replace(TINY, num_nextn_predict_layers=0, compress_ratios=(0, 4, 16, 4)), (2, 70)),
    # HCA-first like V4-Pro, hash routing in a CSA layer, wider window and top-k, sigmoid-free sqrt-softplus
    "pro_like": (dataclasses.replace(
        TINY, num_hidden_layers=5, num_nextn_predict_layers=0, compress_ratios=(16, 16, 4, 16, 4),
        num_hash_layers=3, sliding_window=16, index_topk=8, n_routed_experts=6, num_experts_per_tok=3,
        routed_scaling_factor=2.5, o_groups=4), (3, 100)),
    # sliding-only layers and a CSA layer without YaRN, grouped output with 4 groups, no hash layer
    "swa_plain_rope": (dataclasses.replace(
        TINY, num_hidden_layers=3, num_nextn_predict_layers=0, compress_ratios=(0, 0, 4), num_hash_layers=0,
        rope_scaling=None, num_attention_heads=8, o_groups=4, hc_sinkhorn_iters=7), (1, 45)),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def oracle_case(request, tmp_path_factory):
    """(config, tokens, HF-saved dir, HF logits) for one config, created once per module."""
    config, shape = CONFIGS[request.param]
    hf_dir = tmp_path_factory.mktemp(f"hf-{request.param}")
    hf_init(config.to_hf_dict(), hf_dir, seed=7)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, shape)
    return config, tokens, hf_dir, hf_logits(hf_dir, tokens)


def _max_diff(a, b) -> float:
    assert a.shape == b.shape
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def test_hf_saved_checkpoint_matches_oracle(oracle_case):
    config, tokens, hf_dir, expected = oracle_case
    model = load_model(hf_dir)
    assert model.config == config
    assert _max_diff(model.logits(tokens), expected) <= TOL


def test_native_names_match_oracle(oracle_case, tmp_path):
    _, tokens, hf_dir, expected = oracle_case
    native = hf_dump_native(hf_dir, tmp_path / "native")
    assert _max_diff(load_model(native).logits(tokens), expected) <= TOL


def test_oracle_reads_our_checkpoint(oracle_case, tmp_path):
    _, tokens, hf_dir, expected = oracle_case
    save_checkpoint(load_model(hf_dir), tmp_path / "ours")
    assert _max_diff(hf_logits(tmp_path / "ours", tokens), expected) == 0.0


@pytest.mark.kernels
@pytest.mark.parametrize("oracle_case", ["mixed"], indirect=True)  # interpret mode is slow: one config
def test_pallas_kernels_match_oracle(oracle_case):
    """`--kernels pallas`: every registry op on its Pallas kernel (interpret mode on CPU) still equals the oracle."""
    _, tokens, hf_dir, expected = oracle_case
    with registry.use("pallas"):
        assert _max_diff(load_model(hf_dir).logits(tokens), expected) <= TOL


def test_oracle_disagrees_with_a_perturbed_model(oracle_case, tmp_path):
    """The comparison can fail: one changed attention sink moves the logits far beyond the tolerance."""
    _, tokens, hf_dir, expected = oracle_case
    model = load_model(hf_dir)
    module = model.module()
    module.layers[0].attn.attn_sink[...] = module.layers[0].attn.attn_sink[...] + 1.0
    from model.api import Model
    assert _max_diff(Model(module).logits(tokens), expected) > 100 * TOL


def test_yarn_config_is_what_the_oracle_saved(oracle_case):
    config, _, hf_dir, _ = oracle_case
    assert ModelConfig.from_json(hf_dir).rope_scaling == config.rope_scaling
    assert config.rope_scaling in (None, YarnScaling(factor=16.0, original_max_position_embeddings=256))
