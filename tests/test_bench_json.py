"""Every benchmark (`benchmarks/`, `jaxseek bench NAME`) prints its summary as one strict JSON line (`benchmarks.bench_json.json_line`)."""

import ast
import json
import pathlib

import numpy as np
import pytest

from model.initialize import init_model
from model.config import preset
from serving.core.engine import Engine

from benchmarks.bench_json import json_line

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_numpy_values_become_plain_json():
    result = {"a": np.arange(3), "b": np.float32(0.5), "c": (np.int64(2), 3), "d": float("nan"),
              "e": {np.str_("k"): [np.bool_(True)]}, "f": BENCHMARKS / "x"}
    assert json.loads(json_line(result)) == {"a": [0, 1, 2], "b": 0.5, "c": [2, 3], "d": None,
                                             "e": {"k": [True]}, "f": str(BENCHMARKS / "x")}


def test_engine_stats_are_json_safe():
    """bench_engine puts the engine's stats (numpy counters among them) into its line."""
    engine = Engine(init_model(preset("tiny"), seed=0), max_slots=2, max_len=64)
    stats = json.loads(json_line({"jaxseek_engine_stats": dict(engine.stats)}))["jaxseek_engine_stats"]
    assert stats["verified_at"] == [] and stats["steps"] == 0


def test_json_line_refuses_what_it_cannot_convert():
    with pytest.raises(TypeError):
        json_line({"x": object()})


@pytest.mark.parametrize("script", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_bench_scripts_print_through_json_line(script):
    """No benchmark prints `json.dumps(...)` (which fails on numpy values and writes NaN)."""
    calls = [node for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Call)]
    dumps_printed = [node.lineno for node in calls if getattr(node.func, "id", None) == "print"
                     for arg in ast.walk(node) if isinstance(arg, ast.Attribute) and arg.attr == "dumps"]
    assert not dumps_printed, f"{script.name} prints json.dumps at lines {dumps_printed}"


def test_bench_context_summary_is_json_safe():
    from benchmarks import context as bench_context

    runs = {key: [np.float64(v), v] for key, v in (("tps_b1_1024", 50.0), ("tps_b1_65536", 45.0),
                                                   ("tps_b8_1024", 200.0), ("tps_b8_65536", 190.0),
                                                   ("tps_ctx1k_b1", 50.0), ("tps_ctx16k_b1", 40.0))}
    line = json.loads(json_line(bench_context.summary(runs, {"read_bytes_per_s": np.float32(1e10)}, 0.95, {})))
    assert line["maxlen_flatness_b1"] == pytest.approx(0.9) and line["context_ratio_over_ideal"] == pytest.approx(0.8 / 0.95)


def test_bench_engine_roofline_figures_are_json_safe(monkeypatch):
    from benchmarks import engine as bench_engine

    measured = {"gemm_flops_per_s_b1": np.float64(1e10), "gemm_flops_per_s_b16": np.float64(1e11),
                "read_bytes_per_s": np.float64(1e10)}
    monkeypatch.setattr(bench_engine.roofline, "measure", lambda config, rows: measured)
    config = preset("tiny")
    figures = json.loads(json_line(bench_engine.roofline_figures(config, {"jaxseek_decode_tps_b1": 100.0}, 40)))
    cost = bench_engine.decode_step_cost(config, 1, 40)
    ideal = max(cost["flops"] / 1e10, cost["bytes"] / 1e10)
    assert figures["roofline_fraction_b1"] == pytest.approx(ideal * 100.0)
    assert figures["roofline_fraction_b16"] is None  # no batch-16 figure measured
    # rounds each paired with the roofline measured right after them: the median of the rounds' fractions
    assert figures["products_ceiling_fraction_b1"] is None  # no round timed the products alone
    rounds = [{"tps": np.float64(tps), "gemm_flops_per_s_b1": 1e10, "read_bytes_per_s": bw, "products_s": p}
              for tps, bw, p in ((100.0, 1e10, 0.004), (50.0, 2e10, np.float64(0.002)), (90.0, 1e10, 0.005))]
    figures = json.loads(json_line(bench_engine.roofline_figures(
        config, {"jaxseek_decode_tps_b1": 90.0, "roofline_rounds_b1": rounds}, 40)))
    at = [max(cost["flops"] / 1e10, cost["bytes"] / bw) for bw in (1e10, 2e10, 1e10)]
    assert figures["roofline_fraction_b1"] == pytest.approx(sorted([at[0] * 100, at[1] * 50, at[2] * 90])[1])
    assert figures["roofline_fraction_end_b1"] == pytest.approx(ideal * 90.0)
    # the products' time, the roofline over it and it over the step's time: medians over the rounds
    assert figures["products_ms_per_step_b1"] == pytest.approx(4.0)
    assert figures["products_ceiling_fraction_b1"] == pytest.approx(sorted([at[0] / 0.004, at[1] / 0.002,
                                                                            at[2] / 0.005])[1])
    assert figures["products_share_b1"] == pytest.approx(sorted([0.004 * 100, 0.002 * 50, 0.005 * 90])[1])


def test_bench_layer_programs_summary_is_json_safe():
    """The layer-programs benchmark's figures from numpy-typed measurements: one strict JSON line, ratios by
    hand."""
    from benchmarks import layer_forms

    compile_s = {"one_program": {4: np.float64(2.0), 16: 8.0}, "layer_programs": {4: 2.0, 16: np.float32(2.5)}}
    rates = {"one_program": {1: np.float64(50.0), 16: 200.0}, "layer_programs": {1: 40.0, 16: np.float32(100.0)}}
    line = json.loads(json_line(layer_forms.summary(compile_s, rates, True)))
    assert line["compile_ratio_16_over_4_one_program"] == 4.0 and line["compile_ratio_16_over_4_layer_programs"] == 1.25
    assert line["compile_s_by_layers_layer_programs"] == {"4": 2.0, "16": 2.5}
    assert line["layer_programs_over_one_program_decode_b1"] == 0.8
    assert line["layer_programs_over_one_program_decode_b16"] == 0.5
    assert line["decode_tok_s_b16_layer_programs"] == 100.0 and line["outputs_match"] is True
