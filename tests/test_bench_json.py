"""Every benchmark (`benchmarks/`, `jaxseek bench NAME`) prints its summary as one strict JSON line (`benchmarks.bench_json.json_line`)."""

import ast
import json
import pathlib

import numpy as np
import pytest

from model.initialize import init_model
from model.config import preset
from serving.engine import Engine

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


def test_bench_layer_scan_forms_agree_and_summary_is_json_safe():
    """The benchmark's scanned pairs compute what the model's unrolled layer loop computes, so their timings
    compare like with like; its summary is one strict JSON line."""
    import jax
    import jax.numpy as jnp

    from benchmarks import layer_scan

    config = layer_scan.flash_pattern(preset("tiny"), 6)
    graphdefs, params, states = layer_scan.pair_section(config)
    assert len(params) == 2 and config.compress_ratios[2:6] == (4, 32, 4, 32)
    streams = jax.random.normal(jax.random.key(0), (1, 3, config.hc_mult, config.hidden_size))
    tokens, start = jnp.array([[5, 6, 7]], jnp.int32), jnp.array(0, jnp.int32)
    loop_out, loop_states = layer_scan.unrolled(graphdefs)(params, states, streams, tokens, start)
    scan_out, scan_states = layer_scan.scanned(graphdefs)(
        layer_scan.stacked(params), layer_scan.stacked(states), streams, tokens, start)
    np.testing.assert_allclose(np.asarray(scan_out), np.asarray(loop_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.tree.leaves(scan_states)[0][1]),
                               np.asarray(jax.tree.leaves(loop_states[1])[0]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(loop_out), np.asarray(streams))  # the layers did something

    run = {"pairs": 1, "unrolled_compile_s": np.float64(2.0), "scan_compile_s": 3.0, "unrolled_decode_ms": 4.0,
           "scan_decode_ms": np.float32(5.0), "max_abs_difference": 0.0}
    line = json.loads(json_line(layer_scan.summary({4: run, 16: {**run, "pairs": 7, "unrolled_compile_s": 8.0}})))
    assert line["unrolled_compile_ratio_16_over_4"] == 4.0 and line["scan_compile_ratio_16_over_4"] == 1.0
    assert line["scan_decode_slowdown_by_layers"] == {"4": 1.25, "16": 1.25} and line["scan_outputs_match"]
