"""`jaxseek info` reads figures off real shapes; they reproduce the published model sizes."""

import json

import pytest

from jaxseek.cli import main


def _info(capsys, *args):
    assert main(["info", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_info_v4_flash_matches_published_sizes(capsys):
    info = _info(capsys, "--config", "v4-flash")
    assert {"params_total", "params_active_per_token", "kv_bytes_per_token"} <= set(info)
    assert abs(info["params_total"] / 284e9 - 1) < 0.01            # 284B total (model card)
    assert 12.5e9 < info["params_active_per_token"] < 14e9          # 13B active (+ embedding and head)
    assert info["kv_bytes_per_token_bf16"] * 2**20 / 2**30 == pytest.approx(6.72, abs=0.01)  # vLLM: 6.72 GiB @1M


def test_info_v4_pro_kv_bytes_equal_vllm_figure(capsys):
    info = _info(capsys, "--config", "v4-pro")
    assert info["kv_bytes_per_token_bf16"] == 9848                   # 30 CSA x 1280/4 + 31 HCA x 1024/128
    assert abs(info["params_total"] / 1.6e12 - 1) < 0.02


def test_info_small_is_tens_of_millions(capsys):
    info = _info(capsys, "--config", "small")
    assert 10e6 < info["params_total"] < 100e6


def test_info_reads_a_checkpoint_config(capsys, tmp_path):
    from model.config import preset
    preset("tiny").save_json(tmp_path)
    assert _info(capsys, "--model", str(tmp_path))["params_total"] == _info(capsys, "--config", "tiny")["params_total"]


def test_bad_preset_is_a_clear_error(capsys):
    assert main(["info", "--config", "v5-ultra"]) == 2
    assert "unknown preset 'v5-ultra'" in capsys.readouterr().err


def test_forward_runs_on_a_preset(capsys):
    assert main(["forward", "--config", "tiny", "--tokens", "1,2,3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["logits_shape"] == [1, 3, 256] and len(out["argmax"]) == 3
