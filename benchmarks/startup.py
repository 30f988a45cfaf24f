"""Start-up benchmark: how long the first command takes to its first token, and what compiling costs.

    jaxseek bench startup                 # every figure (~10 min on 2 busy cores)
    jaxseek bench startup --skip-dspark   # without the DSpark engine's start-up

Prints ONE JSON line on stdout (progress on stderr). Never run by the test suite.

- `startup_cold_s` / `startup_warm_s`: the README's first command, `jaxseek generate --prompt "Hello" --prompt
  "The sea" --max-tokens 16` (the bundled model), run as a fresh process with an empty and then with the warm
  persistent compile cache: seconds from starting the process to the first generated token (the process's wall
  time less what the command itself reports it spent after its first token).
- `compile_s_by_layers`: seconds to compile one step bucket of a `small`-width model (V4-Flash's layer pattern,
  random weights) with 4, 8 and 16 layers: a one-slot batch-invariant engine's two buckets (decode and a
  16-token prefill), no persistent cache, halved.
  The engine runs its layers as one program per kind of layer (`serving.core.layer_programs`).
- `compile_s_by_layers_one_program`: the same with the whole step as one program (`--no-layer-programs`).
- `serve_health_cold_s` / `serve_first_completion_s`: `jaxseek serve` (the bundled model) started with an empty
  compile cache: seconds from starting the process to `/health` answering 200, then the seconds of a first
  16-token `/v1/completions` request (while the server compiles its other buckets in the background);
  `serve_4096_*` the same with `--max-model-len 4096` (more context buckets).
- `dspark_warmup_s`: the bundled model's DSpark engine with 16 slots, from construction to the end of
  `Engine.warmup()` (every bucket compiled, the verify buckets profiled), no persistent cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.bench_json import json_line

FIRST_COMMAND = ["generate", "--prompt", "Hello", "--prompt", "The sea", "--max-tokens", "16"]
LAYERS = (4, 8, 16)


def log(message: str) -> None:
    print(f"bench startup: {message}", file=sys.stderr, flush=True)


def first_token_s(cache_dir: str) -> float:
    """Seconds from starting `jaxseek generate` (the README's first command) to its first token."""
    command = [sys.executable, "-m", "jaxseek.cli", *FIRST_COMMAND, "--compile-cache", cache_dir]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    total = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    match = re.search(r"wall: ([\d.]+) s .*first token after ([\d.]+) s", done.stderr)
    if match is None:
        raise RuntimeError(f"no wall / first-token figures in the command's summary:\n{done.stderr[-2000:]}")
    wall, first = float(match[1]), float(match[2])
    return total - (wall - first)


def serve_startup(cache_dir: str, *flags: str) -> tuple[float, float]:
    """(seconds from starting `jaxseek serve` to /health answering 200, seconds of a first 16-token completion)."""
    import httpx

    from benchmarks.serving import free_port, wait_healthy

    port = free_port()
    command = [sys.executable, "-m", "jaxseek.cli", "serve", "--port", str(port), "--compile-cache", cache_dir, *flags]
    start = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [server], None, lambda: server.stderr.read()[-2000:], poll=0.05)
        health = time.perf_counter() - start
        model = httpx.get(url + "/v1/models", timeout=10.0).json()["data"][0]["id"]
        begin = time.perf_counter()
        reply = httpx.post(url + "/v1/completions", timeout=600.0,
                           json={"model": model, "prompt": "The sea", "max_tokens": 16, "ignore_eos": True})
        reply.raise_for_status()
        assert reply.json()["usage"]["completion_tokens"] == 16
        return health, time.perf_counter() - begin
    finally:
        server.terminate()
        server.wait(timeout=60)


def flash_pattern(config, layers: int):
    """`config` with `layers` main layers (even) in V4-Flash's pattern: two sliding, (CSA, HCA) pairs, one
    sliding; the MTP layer sliding."""
    ratios = (0, 0) + (4, 32) * ((layers - 2) // 2) + (0,)
    return dataclasses.replace(config, num_hidden_layers=len(ratios) - 1, compress_ratios=ratios)


def compile_seconds(layers: int, slots: int = 1, **settings) -> float:
    """Seconds per bucket to compile an engine's decode and prefill buckets, `small` widths, one slot (a mesh
    engine: one per rank, `slots`); `settings` go to the engine."""
    from model.config import preset
    from model.initialize import init_model
    from serving.core.engine import Engine

    model = init_model(flash_pattern(preset("small"), layers), seed=0)
    engine = Engine(model, max_slots=slots, max_len=256, prefill_chunk=16, batch_invariant=True, **settings)
    start = time.perf_counter()
    engine.warmup()
    return (time.perf_counter() - start) / len(engine.buckets())


def dspark_warmup_seconds(slots: int) -> tuple[float, int]:
    """(seconds, buckets): the bundled model's DSpark engine from construction through `warmup()`."""
    from model.checkpoint import load_model
    from serving.core.engine import Engine

    model = load_model()
    start = time.perf_counter()
    engine = Engine(model, max_slots=slots, max_len=512, speculation="dspark")
    engine.warmup()
    return time.perf_counter() - start, len(engine.buckets())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-dspark", action="store_true", help="leave out dspark_warmup_s")
    parser.add_argument("--slots", type=int, default=16, help="the DSpark engine's slots (default 16)")
    parser.add_argument("--serve-only", action="store_true", help="only the serve_* figures")
    args = parser.parse_args(argv)
    result = {"load_avg_1m_start": round(os.getloadavg()[0], 2)}
    for prefix, flags in (("serve", ()), ("serve_4096", ("--max-model-len", "4096"))):
        with tempfile.TemporaryDirectory() as cache:
            log(f"jaxseek serve {' '.join(flags)} with an empty compile cache")
            health, completion = serve_startup(cache, *flags)
            result[f"{prefix}_health_cold_s"], result[f"{prefix}_first_completion_s"] = round(health, 2), round(
                completion, 2)
    if args.serve_only:
        result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
        print(json_line(result))
        return result
    with tempfile.TemporaryDirectory() as cache:
        log("the first command with an empty compile cache")
        result["startup_cold_s"] = round(first_token_s(cache), 2)
        log("... and with the warm cache")
        result["startup_warm_s"] = round(first_token_s(cache), 2)
    import jax

    jax.config.update("jax_compilation_cache_dir", None)  # compile for real below
    for suffix, settings in (("", {}), ("_one_program", {"layer_programs": False})):
        key = f"compile_s_by_layers{suffix}"
        result[key] = {}
        for layers in LAYERS:
            log(f"compiling a {layers}-layer small-width engine {suffix[1:]}")
            result[key][str(layers)] = round(compile_seconds(layers, **settings), 2)
    for suffix in ("", "_one_program"):
        by = result[f"compile_s_by_layers{suffix}"]
        result[f"compile_ratio_16_over_4{suffix}"] = round(by["16"] / by["4"], 2)
    if not args.skip_dspark:
        log(f"the DSpark engine's start-up, {args.slots} slots")
        seconds, buckets = dspark_warmup_seconds(args.slots)
        result.update(dspark_warmup_s=round(seconds, 2), dspark_buckets=buckets)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json_line(result))
    return result
