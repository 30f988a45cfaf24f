"""Context benchmark: does a decode step cost what its live context needs, whatever the engine's `max_len`?

    jaxseek bench context            # 96 new tokens, 3 repeats
    jaxseek bench context --quick    # 32 new tokens, 2 repeats

Prints ONE JSON line on stdout (progress on stderr). `small` preset, random weights (`init_model(seed=0)`), fp32,
greedy with `ignore_eos`, prefix cache off. Decode tokens/s of a run = rows * (N - 1) / (the first row's
finish - the last row's first token), from each `RequestOutput`'s `time_to_first_token` and `latency`; each
figure is the median of `--repeats` timed runs, the runs of the two sides of a ratio alternating, after one
untimed run each that compiles the buckets they use. `--part` runs only the flatness or the context figures.

- `maxlen_flatness_b1` / `_b8`: decode tok/s of 1 / 8 rows with 16-token prompts in an engine of
  `max_len` 65,536 over the same in one of `max_len` 1,024 (target >= 0.9).
- `context_ratio_16k_b1`: in one engine of `max_len` 32,768, decode tok/s of one row after a 16,000-token prompt
  over that after a 900-token prompt; `ideal_context_ratio_16k`: the same ratio predicted by the roofline
  (`model.step_cost`: the FLOPs and bytes each step needs, counted from shapes, against this machine's GEMM
  peak at the step's shapes and streaming read bandwidth, `benchmarks/roofline.py`); target measured >= 0.8 x ideal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from benchmarks import roofline
from benchmarks.bench_json import json_line
from model.initialize import init_model
from model.config import preset
from model.step_cost import decode_step_cost, roofline_seconds
from serving.core.engine import Engine
from serving.base.sampling import SamplingParams

SHORT, LONG = 900, 16000  # prompt tokens of the context-ratio runs: with up to 96 new tokens each stays in one
# context bucket (1,024 and 16,384 tokens)


def log(message: str) -> None:
    print(f"bench_context: {message}", file=sys.stderr, flush=True)


def decode_tps(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of one run of `prompts` (see the module docstring)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    first = max(o.time_to_first_token for o in outputs)
    done = min(o.latency for o in outputs)
    return len(prompts) * (new_tokens - 1) / (done - first)


def interleaved(runs: dict, engines: dict, prompts: dict, new_tokens: int, repeats: int) -> None:
    """Timed runs of each named (engine, prompts) pair, alternating between them (so a machine whose load drifts
    slows each alike), after one untimed run each of 2 new tokens, which compiles the buckets the timed ones use
    (the prompts' prefill and the decode bucket of their context)."""
    for name, engine in engines.items():
        decode_tps(engine, prompts[name], 2)
    for _ in range(repeats):
        for name, engine in engines.items():
            runs.setdefault(name, []).append(decode_tps(engine, prompts[name], new_tokens))
            log(f"{name}: {runs[name][-1]:.1f} tok/s")


def summary(runs: dict[str, list[float]], measured: dict[str, float | np.floating], ideal_ratio: float, settings: dict) -> dict:
    """The JSON line's figures from the timed runs (tok/s lists keyed like `tps_b1_1024`)."""
    tps = {key: statistics.median(values) for key, values in runs.items()}
    ratio = lambda a, b: tps[a] / tps[b] if a in tps and b in tps else None  # noqa: E731
    out = {"benchmark": "jaxseek decode tok/s against max_len and live context, small preset, fp32, CPU",
           "maxlen_flatness_b1": ratio("tps_b1_65536", "tps_b1_1024"),
           "maxlen_flatness_b8": ratio("tps_b8_65536", "tps_b8_1024"),
           "context_ratio_16k_b1": ratio("tps_ctx16k_b1", "tps_ctx1k_b1"), "ideal_context_ratio_16k": ideal_ratio}
    measured_ratio = out["context_ratio_16k_b1"]
    out["context_ratio_over_ideal"] = None if measured_ratio is None else measured_ratio / ideal_ratio
    return out | {f"{key}_median": value for key, value in tps.items()} | {"runs_tps": runs} | measured | {
        "settings": settings}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 new tokens, 2 repeats")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--part", choices=["all", "flatness", "context"], default="all",
                        help="the max_len flatness runs, the context-ratio runs, or both")
    args = parser.parse_args(argv)
    repeats, new_tokens = args.repeats or (2 if args.quick else 3), args.new_tokens or (32 if args.quick else 96)
    t_start = time.perf_counter()
    config = preset("small")
    model = init_model(config, seed=0)
    rng = np.random.default_rng(0)
    runs: dict[str, list[float]] = {}
    for rows in (1, 8) if args.part != "context" else ():
        prompts = rng.integers(2, config.vocab_size, (rows, 16)).tolist()
        engines = {f"tps_b{rows}_{max_len}": Engine(model, max_slots=rows, max_len=max_len, prefill_chunk=16,
                                                    max_prefill_rows=rows, prefix_cache=False)
                   for max_len in (1024, 65536)}
        interleaved(runs, engines, dict.fromkeys(engines, prompts), new_tokens, repeats)
        del engines
    if args.part != "flatness":
        engine = Engine(model, max_slots=1, max_len=32768, prefill_chunk=2048, max_prefill_rows=1,
                        prefix_cache=False)
        prompts = {f"tps_{name}_b1": [rng.integers(2, config.vocab_size, length).tolist()]
                   for name, length in (("ctx1k", SHORT), ("ctx16k", LONG))}
        interleaved(runs, dict.fromkeys(prompts, engine), prompts, new_tokens, repeats)
    measured = roofline.measure(config, (1,))
    seconds = {length: roofline_seconds(decode_step_cost(config, 1, length + new_tokens // 2),
                                        measured["gemm_flops_per_s_b1"], measured["read_bytes_per_s"])
               for length in (SHORT, LONG)}
    settings = {"mode": "quick" if args.quick else "full", "part": args.part, "repeats": repeats,
                "new_tokens": new_tokens,
                "prompt_tokens_flatness": 16, "context_prompts": [SHORT, LONG], "context_max_len": 32768,
                "total_s": time.perf_counter() - t_start}
    print(json_line(summary(runs, measured, seconds[SHORT] / seconds[LONG], settings)))


if __name__ == "__main__":
    main()
