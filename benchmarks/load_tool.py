"""inference-perf (kubernetes-sigs/inference-perf), the third-party load tool `jaxseek bench serving` drives: where
its executable is, its config for concurrency stages against a server on this machine, and its per-stage result
files read back as TTFT / ITL / TPOT percentiles, output tokens/s and request counts.

It lives in a venv of its own (it pins transformers==5.13 and pulls boto3 and google-cloud-storage), which the
benchmark finds by `--tool-bin`, `$JAXSEEK_LOADTOOL`, `.venv-bench/bin/inference-perf` or the PATH:

    python3.12 -m venv .venv-bench && .venv-bench/bin/pip install inference-perf==0.7.0   # or '.[bench]'

It needs no download: it tokenizes with the bundled model's tokenizer.json (`tokenizer_dir`) and makes its
prompts from random token ids (`data.type: random`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

NAME = "inference-perf"
ENV = "JAXSEEK_LOADTOOL"
REPO = Path(__file__).resolve().parent.parent
PERCENTILES = (50, 90, 99)
METRICS = {"ttft": "time_to_first_token", "itl": "inter_token_latency", "tpot": "time_per_output_token"}


def find_executable(explicit: str | None = None) -> Path | None:
    """The tool's executable: `explicit`, else $JAXSEEK_LOADTOOL, else this checkout's .venv-bench, else the PATH;
    None when there is none. Raises FileNotFoundError for a named one that does not exist."""
    named = explicit or os.environ.get(ENV)
    if named:
        if not Path(named).is_file():
            raise FileNotFoundError(f"no {NAME} executable at {named}")
        return Path(named)
    local = REPO / ".venv-bench" / "bin" / NAME
    if local.is_file():
        return local
    found = shutil.which(NAME)
    return Path(found) if found else None


def version(executable: Path) -> str | None:
    """The installed tool's version, asked of the Python beside its executable (None if that fails)."""
    python = executable.parent / "python"
    try:
        done = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({NAME!r}))"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def tokenizer_dir(tokenizer_json: Path, dst: Path) -> Path:
    """A directory transformers' AutoTokenizer loads offline: the bundled tokenizer.json and a tokenizer_config.json
    naming its bos / eos tokens (the checkpoint directory itself holds a config.json transformers cannot read)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_json, dst / "tokenizer.json")
    added = sorted(t["content"] for t in json.loads(tokenizer_json.read_text())["added_tokens"])
    special = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for role, word in (("bos_token", "begin▁of▁sentence"), ("eos_token", "end▁of▁sentence"), ("pad_token", "pad")):
        special.update({role: t for t in added[::-1] if word in t})
    (dst / "tokenizer_config.json").write_text(json.dumps(special))
    return dst


def _fixed(tokens: int) -> dict:
    return {"type": "fixed", "min": tokens, "max": tokens, "mean": tokens, "std_dev": 0}


def config(base_url: str, model: str, tokenizer: Path, report_dir: Path, stages: list[tuple[int, int]], *,
           prompt_tokens: int, output_tokens: int, api_key: str | None = None) -> dict:
    """The tool's config (written as YAML or JSON): one stage per (concurrency, requests), streaming
    /v1/completions with `ignore_eos`, fixed prompt and output lengths, output tokens counted from the server's
    usage, per-stage reports under `report_dir`."""
    server = {"type": "vllm", "model_name": model, "base_url": base_url, "ignore_eos": True}
    if api_key:
        server["api_key"] = api_key
    return {
        "api": {"type": "completion", "streaming": True},
        "server": server,
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "data": {"type": "random", "input_distribution": _fixed(prompt_tokens),
                 "output_distribution": _fixed(output_tokens)},
        "load": {"type": "concurrent", "num_workers": 1, "interval": 1,
                 "stages": [{"concurrency_level": c, "num_requests": n} for c, n in stages]},
        "report": {"request_lifecycle": {"summary": False, "per_stage": True, "per_request": False,
                                         "percentiles": list(PERCENTILES), "use_server_output_tokens": True},
                   "prometheus": {"summary": False, "per_stage": False}},
        "storage": {"local_storage": {"path": str(report_dir)}},
    }


def stage_figures(report: dict) -> dict:
    """One stage's figures from the tool's `stage_N_lifecycle_metrics.json` (its seconds as milliseconds)."""
    ok, latency = report["successes"], report["successes"].get("latency", {})
    figures = {"concurrency": report["load_summary"].get("concurrency"), "completed": ok["count"],
               "failed": report["failures"]["count"], "duration_s": report["benchmark_time_seconds"],
               "output_tokens_per_s": ok.get("throughput", {}).get("output_tokens_per_sec")}
    for short, name in METRICS.items():
        summary = latency.get(name) or {}
        for p in PERCENTILES:
            value = summary.get("median" if p == 50 else f"p{p}")
            figures[f"{short}_p{p}_ms"] = None if value is None else value * 1000.0
    if report["failures"]["count"]:
        figures["failures_by_label"] = report["failures"].get("by_label")
    return figures


def read_stages(report_dir: Path) -> dict[int, dict]:
    """Every stage report the tool wrote under `report_dir`, by stage index."""
    stages = {}
    for path in report_dir.glob("stage_*_lifecycle_metrics.json"):
        index = re.fullmatch(r"stage_(\d+)_lifecycle_metrics\.json", path.name)
        if index:
            stages[int(index.group(1))] = stage_figures(json.loads(path.read_text()))
    return dict(sorted(stages.items()))


def run(executable: Path, cfg: dict, work_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run the tool on `cfg` (written to work_dir/inference-perf.json, its log to work_dir/inference-perf.log),
    offline: the Hugging Face libraries it loads never reach for the hub."""
    work_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = work_dir / f"{NAME}.json"  # YAML reads JSON
    cfg_path.write_text(json.dumps(cfg, indent=1))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(work_dir / f"{NAME}.log", "w") as log:
        return subprocess.run([str(executable), "-c", str(cfg_path)], stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=work_dir, timeout=timeout)
