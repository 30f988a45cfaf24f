"""`jaxseek bench serving`'s side of inference-perf (`benchmarks/load_tool.py`): its per-stage result files read
back from hand-written ones (tests/data/inference_perf), the config it is given, where its executable is found and
the tokenizer directory it loads. None of these needs the tool installed."""

import json
import pathlib
import stat
import sys

import pytest

from benchmarks import load_tool

DATA = pathlib.Path(__file__).resolve().parent / "data" / "inference_perf"
REPO = pathlib.Path(__file__).resolve().parents[1]


def test_stage_reports_become_milliseconds_per_percentile():
    stages = load_tool.read_stages(DATA)
    assert list(stages) == [0, 1]  # stage_x_... is not a stage report
    first = stages[0]
    assert (first["concurrency"], first["completed"], first["failed"]) == (1, 4, 0)
    assert first["output_tokens_per_s"] == 64.0 and first["duration_s"] == 2.0
    assert first["ttft_p50_ms"] == pytest.approx(80.0)  # the tool's "median"
    assert first["ttft_p90_ms"] == pytest.approx(170.0) and first["ttft_p99_ms"] == pytest.approx(197.0)
    assert [first[f"itl_p{p}_ms"] for p in (50, 90, 99)] == pytest.approx([10.0, 20.0, 45.0])
    assert [first[f"tpot_p{p}_ms"] for p in (50, 90, 99)] == pytest.approx([12.0, 13.5, 13.9])
    assert "failures_by_label" not in first


def test_stage_with_failures_and_a_missing_metric():
    second = load_tool.read_stages(DATA)[1]
    assert (second["concurrency"], second["completed"], second["failed"]) == (4, 15, 1)
    assert second["failures_by_label"] == {"http_500": {"count": 1}}
    assert all(second[f"itl_p{p}_ms"] is None for p in (50, 90, 99))  # the tool wrote null
    assert second["tpot_p99_ms"] == pytest.approx(30.0) and second["ttft_p90_ms"] == pytest.approx(500.0)


def test_config_has_a_stage_per_concurrency(tmp_path):
    cfg = load_tool.config("http://127.0.0.1:9", "m", tmp_path / "tok", tmp_path / "r", [(1, 8), (4, 16)],
                           prompt_tokens=64, output_tokens=32, api_key="k")
    assert cfg["load"]["type"] == "concurrent"
    assert cfg["load"]["stages"] == [{"concurrency_level": 1, "num_requests": 8},
                                     {"concurrency_level": 4, "num_requests": 16}]
    assert cfg["api"] == {"type": "completion", "streaming": True}
    assert cfg["server"] == {"type": "vllm", "model_name": "m", "base_url": "http://127.0.0.1:9",
                             "ignore_eos": True, "api_key": "k"}
    assert cfg["data"]["input_distribution"]["min"] == cfg["data"]["input_distribution"]["max"] == 64
    assert cfg["data"]["output_distribution"]["std_dev"] == 0
    assert cfg["report"]["request_lifecycle"]["percentiles"] == [50, 90, 99]
    assert cfg["storage"]["local_storage"]["path"] == str(tmp_path / "r")
    json.dumps(cfg)  # the config file is written as JSON


def test_executable_from_the_option_then_the_environment(tmp_path, monkeypatch):
    tool = tmp_path / "inference-perf"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(load_tool.ENV, str(tool))
    assert load_tool.find_executable() == tool
    with pytest.raises(FileNotFoundError, match="no inference-perf executable"):
        load_tool.find_executable(str(tmp_path / "missing"))
    monkeypatch.setenv(load_tool.ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        load_tool.find_executable()


def test_tokenizer_directory_names_the_bundled_special_tokens(tmp_path):
    out = load_tool.tokenizer_dir(REPO / "model" / "bundled" / "tokenizer.json", tmp_path / "tok")
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<｜end▁of▁sentence｜>" and config["bos_token"] == "<｜begin▁of▁sentence｜>"
    assert config["pad_token"] == "<｜▁pad▁｜>"
    assert (out / "tokenizer.json").read_bytes() == (REPO / "model" / "bundled" / "tokenizer.json").read_bytes()


def test_bench_serving_without_the_tool_says_how_to_install_it(monkeypatch, capsys):
    from benchmarks import serving

    monkeypatch.setenv(load_tool.ENV, "/nonexistent/inference-perf")
    assert serving.main(["--base-url", "http://127.0.0.1:9"]) == 2  # before any server is started or reached
    assert "no inference-perf executable" in capsys.readouterr().err


def test_bench_serving_line_from_the_tools_files(tmp_path, capsys):
    """A stand-in tool that writes the hand-written stage reports where its config says: the JSON line has a
    figure set per concurrency, and the failed request in stage 1 makes the exit status 1."""
    from benchmarks import serving

    tool = tmp_path / "bin" / "inference-perf"
    tool.parent.mkdir()
    tool.write_text(f"""#!{sys.executable}
import json, pathlib, shutil, sys
cfg = json.loads(pathlib.Path(sys.argv[2]).read_text())
out = pathlib.Path(cfg["storage"]["local_storage"]["path"])
out.mkdir(parents=True)
for i, _ in enumerate(cfg["load"]["stages"]):
    shutil.copy({str(DATA)!r} + f"/stage_{{i}}_lifecycle_metrics.json", out)
""")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    status = serving.main(["--base-url", "http://127.0.0.1:9", "--tool-bin", str(tool), "--concurrency", "1", "4",
                           "--requests-per-stream", "4", "--min-requests", "4", "--warmup-requests", "0",
                           "--work-dir", str(tmp_path / "work")])
    line = json.loads(capsys.readouterr().out)
    assert status == 1
    assert line["tool"] == "inference-perf" and line["tool_version"] is None  # no Python beside the stand-in
    assert [(s["concurrency"], s["requests"], s["completed"], s["failed"]) for s in line["by_concurrency"]] == [
        (1, 4, 4, 0), (4, 16, 15, 1)]
    assert line["by_concurrency"][0]["ttft_p99_ms"] == pytest.approx(197.0)
