"""The layout study's step-time model (`sharding.step_time`): figures by hand on tiny, the routing skew, a
calibration file, the TPOT pick and the front, the CLI's flags, and V4.1-Flash against DeepInfer's published
figures (GB200, SM100 in one 72-GPU NVLink domain)."""

import json

import pytest

from jaxseek.cli import main
from model.config import preset
from model.step_cost import weight_cost, weight_table
from sharding.efficiency import EFFICIENCY, LAUNCH_S, CalibrationError, calibrated
from sharding.mesh import MeshSpec
from sharding.platform import PROFILES
from sharding.step_time import (Speculation, StepModel, best_under_tpot, decode, front, prefill,
                                routing_skew)

TINY = preset("tiny")
H200 = PROFILES["H200"]


def test_weight_table_by_hand():
    """tiny in float32: 4 experts of 3 x 64 x 32, top-2; every figure per row sums to `weight_cost`'s."""
    t = weight_table(TINY, "float32")
    assert list(t.expert_flops) == [2 * 2 * 3 * 64 * 32] * 4  # a row's 2 experts, w1 w2 w3
    assert list(t.expert_bytes) == [3 * 64 * 32 * 4] * 4  # one expert's fp32 weights
    assert t.lookup_bytes_per_token == 64 * 4 + 2 * 4  # an embedding row, a hash layer's 2 expert ids
    total = t.dense_flops_fp8.sum() + t.dense_flops_bf16.sum() + t.expert_flops.sum() + t.head_flops_bf16
    assert total == weight_cost(TINY, 1)["flops"]
    assert t.dense_flops_fp8.sum() == 0  # nothing held in FP8


def test_routing_skew_by_hand():
    # 2 experts on 2 shards, popularity 1 : 2^-1.01: the busy shard gets 1 / (1 + 2^-1.01) of the pairs
    share = 1 / (1 + 2 ** -1.01)
    assert routing_skew(2, 2, 1e6, balanced=False) == pytest.approx(2 * share, rel=2e-3)
    assert routing_skew(384, 64, 1e7, balanced=True) == pytest.approx(1, abs=0.01)  # EPLB: noise only
    assert routing_skew(384, 1, 100, balanced=False) == 1.0
    assert routing_skew(384, 64, 64 * 8 * 6, balanced=True) > routing_skew(384, 64, 64 * 256 * 6, balanced=True)


def test_decode_step_by_hand():
    """tiny on dp=2,ep=2 (H200), float32 weights and cache, 4 rows at position 40, EPLB slots (balanced)."""
    model = StepModel(TINY, MeshSpec(dp=2, ep=2), H200, "float32", "reference", redundant_experts=2)
    point = decode(model, 4, 40)
    parts = point["parts_s"]
    t = weight_table(TINY, "float32")
    bw, bf16 = 4.8e12, 989e12
    dense_bytes = t.dense_bytes.sum() + t.head_bytes
    assert parts["dense_gemm"] == pytest.approx(max(4 * (t.dense_flops_bf16.sum() + 34816) / (bf16 * 0.78),
                                                    dense_bytes / (bw * 0.8)) + (11 + 19 + 14 + 19 + 2) * LAUNCH_S)
    # attention at position 40 (tests/test_step_cost.py): window 8; CSA 4 picks of 10; HCA 2 entries; CSA
    attn_flops = 4 * 4 * 32 * 8 + 2 * 4 * 4 * 32 * 12 + 4 * 4 * 32 * 10
    attn_bytes = (8 + 2 * 12 + 10) * 32 * 4
    index_flops, index_bytes = 2 * 2 * 16 * 16 * 10, 2 * 10 * 16 * 4
    assert parts["attention"] == pytest.approx(max(4 * attn_flops / (bf16 * 0.67), 4 * attn_bytes / (bw * 0.9))
                                               + 4 * LAUNCH_S)
    assert parts["indexer"] == pytest.approx(max(4 * index_flops / (bf16 * 0.78), 4 * index_bytes / (bw * 0.8))
                                             + 2 * LAUNCH_S)
    # each device holds 3 slots; 8 rows of its group hit an expert with probability 1 - (1/2)^8
    skew = routing_skew(4, 2, 4 * 2 * 2, balanced=True)
    hit = 1 - 0.5 ** 8
    assert parts["expert_gemm"] == pytest.approx(max(skew * 4 * 4 * 24576 / (1979e12 * 0.78),
                                                     4 * hit * 24576 * 3 / (bw * 0.8)) + 8 * LAUNCH_S)
    near = skew * 4 * 2 / 2  # half the pairs go to the other shard, over NVLink
    assert parts["dispatch"] == pytest.approx(4 * (15.9e-6 + near * (64 + 2 + 16) / (450e9 * 634 / 900)))
    assert parts["combine"] == pytest.approx(4 * (16.9e-6 + near * 128 / (450e9 * 777 / 900)))
    assert point["step_s"] == pytest.approx(sum(parts.values()))
    assert point["tok_s_per_device"] == pytest.approx(4 / point["step_s"])
    assert point["tok_s_per_user"] == pytest.approx(1 / point["step_s"])
    assert point["bound"] in ("compute", "memory", "communication")


def test_speculation_and_overlap():
    model = StepModel(TINY, MeshSpec(dp=2, ep=2), H200, "float32", "reference", redundant_experts=2)
    spec = Speculation(2, (0.5, 0.5))
    assert spec.emitted == 1 + 0.5 + 0.25
    point = decode(model, 4, 40, spec)
    assert point["tpot_s"] == pytest.approx(point["step_s"] / 1.75)
    assert point["parts_s"]["drafter"] > 0
    assert point["step_s"] > decode(model, 4, 40)["step_s"]  # 12 rows verified and 8 drafted
    with pytest.raises(ValueError, match="one rate per draft"):
        Speculation(2, (0.5,))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Speculation(1, (1.5,))
    overlapped = decode(StepModel(TINY, MeshSpec(dp=2, ep=2), H200, "float32", "reference", 2,
                                  two_batch_overlap=True), 4, 40)
    assert overlapped["step_s"] > 0 and set(overlapped["parts_s"]) == set(decode(model, 4, 40)["parts_s"])


def _bench_lines(path, profile="H200", small=False, **cases):
    lines = [json.dumps({"case": name, "bytes_per_s": value, "flops_per_s": value}) for name, value in cases.items()]
    lines.append(json.dumps({"summary": True, "profile": profile, "small": small}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_calibration_changes_exactly_the_ops_it_names(tmp_path):
    file = _bench_lines(tmp_path / "k.jsonl", paged_index_scores_decode=0.4 * 4.8e12)
    table = calibrated(file, H200)
    assert table["indexer"].memory == pytest.approx(0.4)
    assert table["indexer"].compute == EFFICIENCY["indexer"].compute
    assert {k: v for k, v in table.items() if k != "indexer"} == {k: v for k, v in EFFICIENCY.items() if k != "indexer"}
    base = decode(StepModel(TINY, MeshSpec(dp=2, ep=2), H200, "float32", "reference", 2), 4, 40)["parts_s"]
    cal = decode(StepModel(TINY, MeshSpec(dp=2, ep=2), H200, "float32", "reference", 2, table), 4, 40)["parts_s"]
    assert cal["indexer"] > base["indexer"]
    assert {k: v for k, v in cal.items() if k != "indexer"} == {k: v for k, v in base.items() if k != "indexer"}


def test_bad_calibration_files(tmp_path):
    with pytest.raises(CalibrationError, match="no such file"):
        calibrated(str(tmp_path / "missing.jsonl"), H200)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(CalibrationError, match="line 1 is not JSON"):
        calibrated(str(bad), H200)
    with pytest.raises(CalibrationError, match="--small run"):
        calibrated(_bench_lines(tmp_path / "s.jsonl", small=True, paged_index_scores_decode=1e12), H200)
    with pytest.raises(CalibrationError, match="'B200' profile"):
        calibrated(_bench_lines(tmp_path / "p.jsonl", profile="B200", paged_index_scores_decode=1e12), H200)
    with pytest.raises(CalibrationError, match="none of the cases"):
        calibrated(_bench_lines(tmp_path / "n.jsonl", hc_site_prefill=1e12), H200)
    with pytest.raises(CalibrationError, match="above H200's peak"):
        calibrated(_bench_lines(tmp_path / "a.jsonl", paged_index_scores_decode=9e12), H200)


def test_tpot_target_and_front_by_hand():
    points = {"a": {"tpot_s": 0.005, "tok_s_per_device": 1000.0, "tok_s_per_user": 200.0, "batch_per_device": 5},
              "b": {"tpot_s": 0.012, "tok_s_per_device": 3000.0, "tok_s_per_user": 83.3, "batch_per_device": 36},
              "c": {"tpot_s": 0.009, "tok_s_per_device": 2000.0, "tok_s_per_user": 111.1, "batch_per_device": 18}}
    best = best_under_tpot(list(points.items()), 0.010)
    assert best["mesh"] == "c" and best["batch_per_device"] == 18  # b is faster per device but misses 10 ms
    assert best_under_tpot(list(points.items()), 0.004) is None
    slow = {"tpot_s": 0.006, "tok_s_per_device": 900.0, "tok_s_per_user": 166.0, "batch_per_device": 5}
    assert front([*points.values(), slow]) == [points["a"], points["c"], points["b"]]  # slow is beaten by a


def test_cli_times_and_bad_flags(capsys, tmp_path):
    args = ["study", "--config", "tiny", "--mesh", "dp=2,ep=2", "--mesh", "dp=2", "--device", "h200",
            "--compile", "none", "--context", "40", "--batch-per-device", "1,4", "--prefill-tokens-per-device", "32",
            "--tpot-target", "1000", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    first = out["studies"][0]
    assert [p["batch_per_device"] for p in first["decode"]] == [1, 4]
    assert set(first["decode"][0]) >= {"step_s", "tpot_s", "tok_s_per_device", "tok_s_per_user", "bound", "parts_s"}
    assert first["prefill"][0]["tokens_per_device"] == 32 and first["prefill"][0]["step_s"] > 0
    assert out["best_under_tpot"]["tok_s_per_device"] == max(p["tok_s_per_device"] for s in out["studies"]
                                                             for p in s["decode"])
    assert main(args[:-1]) == 0 and "best under TPOT 1000.0 ms" in capsys.readouterr().out
    assert main([*args[:-1], "--num-drafts", "2", "--acceptance", "0.5"]) == 2
    assert "one rate per draft" in capsys.readouterr().err
    assert main([*args[:-1], "--calibration", str(tmp_path / "none.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args[:-1], "--batch-per-device", "8,x"])


@pytest.fixture(scope="module")
def flash():
    return preset("v41-flash")


def test_v41_flash_against_deepinfer(flash):
    """DeepInfer's published V4.1-Flash figures on SM100 (dspark-deepinfer.md section 7), EPLB's redundant
    slots, context 8,192: decode DP64/EP64 at 256 per device >25,000 tok/s at ~100 tok/s per user; >300 tok/s
    per user at 8; prefill on 4 GPUs ~60,000 tok/s at 4,096 tokens a device and ~90,000 at 65,536."""
    gb200 = PROFILES["GB200"]
    wide = StepModel(flash, MeshSpec(dp=64, ep=64), gb200, redundant_experts=64)
    at256, at8 = decode(wide, 256, 8192), decode(wide, 8, 8192)
    assert 25_000 / 2 <= at256["tok_s_per_device"] <= 25_000 * 2
    assert 100 / 2 <= at256["tok_s_per_user"] <= 100 * 2
    assert at8["tok_s_per_user"] >= 300 / 2
    four = StepModel(flash, MeshSpec(dp=4, ep=4), gb200, redundant_experts=4)
    for tokens, published in ((4096, 60_000), (65536, 90_000)):
        assert published / 2 <= prefill(four, tokens)["tok_s_per_device"] <= published * 2
    narrow = StepModel(flash, MeshSpec(dp=8, ep=8), gb200, redundant_experts=64)
    for batch in (8, 32, 64, 128, 256):  # "EP64 leads EP8 at every batch size"
        assert decode(wide, batch, 8192)["tok_s_per_device"] >= decode(narrow, batch, 8192)["tok_s_per_device"]
