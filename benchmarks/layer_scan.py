"""Layer-loop benchmark: what running repeated layers as a `lax.scan` would buy (compile time) and cost (decode
time) on this machine, against the unrolled layers the model runs.

    jaxseek bench layer-scan                # 4, 8 and 16 layers at `small` widths (~3 min on 2 idle cores)
    jaxseek bench layer-scan --layers 4 8   # fewer

Prints ONE JSON line on stdout (progress on stderr). Never run by the test suite.

Compile time per step bucket grows with the layer count because the step unrolls its layers (XLA:CPU spends it
in LLVM code generation of each layer's fusions). The usual cure is to store repeated layers stacked and run
them as a `lax.scan` (one compiled body, any depth). This measures both forms on the part of a model that would
be scanned: the repeated (CSA, HCA) pairs of a `small`-width model with V4-Flash's layer pattern,
(0, 0) + (4, 32) * k + (0,), k = (layers - 2) // 2, random weights, fp32. One call = one decode token of one row
(at position 16 of an empty reference cache) through every pair, as the jitted step runs it:

- `unrolled`: the pairs in a Python loop, as `DeepseekV4.streams` runs layers;
- `scan`: `lax.scan` over the pairs' parameters and cache states stacked on a leading axis (built once, outside
  the timed calls).

Figures per layer count: compile seconds (`jax.jit(...).lower(...).compile()`, persistent cache off) and decode
milliseconds per call (median of `--repeats` calls after a warm-up), and `scan_decode_slowdown`, the scan's decode
time over the unrolled one's. `scan_outputs_match` checks that both forms give the same streams (max abs
difference).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.bench_json import json_line
from benchmarks.startup import flash_pattern
from model.config import ModelConfig, preset
from model.initialize import init_model
from model.paged import as_paged, pools


def log(message: str) -> None:
    print(f"bench layer-scan: {message}", file=sys.stderr, flush=True)


def pair_section(config: ModelConfig, max_len: int = 64):
    """The model's repeated (CSA, HCA) pairs: ((graphdef_a, graphdef_b), [(params_a, params_b)] per pair,
    [(state_a, state_b)] per pair: each layer's empty reference cache state)."""
    module = init_model(config, seed=0).module()
    states = module.init_cache(1, max_len)["layers"]
    firsts = range(2, config.num_hidden_layers - 1, 2)
    graphdefs = (nnx.graphdef(module.layers[2]), nnx.graphdef(module.layers[3]))
    params = [(nnx.state(module.layers[i]), nnx.state(module.layers[i + 1])) for i in firsts]
    return graphdefs, params, [(states[i], states[i + 1]) for i in firsts]


def run_pair(graphdefs, pair_params, pair_states, streams, tokens, start):
    """One (CSA, HCA) pair on `streams`: (streams, new states)."""
    new_states = []
    for graphdef, params, state in zip(graphdefs, pair_params, pair_states):
        streams, state = nnx.merge(graphdef, params)(streams, tokens, start, as_paged(state))
        new_states.append(pools(state))
    return streams, tuple(new_states)


def unrolled(graphdefs):
    """The pairs one after the other (the model's layer loop)."""

    def forward(params, states, streams, tokens, start):
        out = []
        for pair_params, pair_states in zip(params, states):
            streams, new = run_pair(graphdefs, pair_params, pair_states, streams, tokens, start)
            out.append(new)
        return streams, out

    return forward


def scanned(graphdefs):
    """The pairs as a `lax.scan` over their stacked parameters and states."""

    def forward(params, states, streams, tokens, start):
        def body(streams, xs):
            return run_pair(graphdefs, *xs, streams, tokens, start)

        return jax.lax.scan(body, streams, (params, states))

    return forward


def stacked(per_pair: list):
    """Per-pair pytrees stacked leaf by leaf on a new leading axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_pair)


def measure(forward, args: tuple, repeats: int) -> tuple[float, float, jax.Array]:
    """(compile seconds, median decode ms per call, the streams it gives)."""
    start = time.perf_counter()
    compiled = jax.jit(forward).lower(*args).compile()
    compile_s = time.perf_counter() - start
    streams = jax.block_until_ready(compiled(*args))[0]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return compile_s, statistics.median(times) * 1e3, streams


def compare(layers: int, repeats: int) -> dict:
    """Both forms at `layers` main layers: compile seconds, decode ms, and how far their outputs differ."""
    config = flash_pattern(preset("small"), layers)
    graphdefs, params, states = pair_section(config)
    streams = jax.random.normal(jax.random.key(1), (1, 1, config.hc_mult, config.hidden_size), jnp.float32)
    tokens, start = jnp.array([[7]], jnp.int32), jnp.array(16, jnp.int32)
    loop = measure(unrolled(graphdefs), (params, states, streams, tokens, start), repeats)
    scan = measure(scanned(graphdefs), (stacked(params), stacked(states), streams, tokens, start), repeats)
    return {"pairs": len(params), "unrolled_compile_s": loop[0], "scan_compile_s": scan[0],
            "unrolled_decode_ms": loop[1], "scan_decode_ms": scan[1],
            "max_abs_difference": float(jnp.max(jnp.abs(loop[2] - scan[2])))}


def summary(runs: dict[int, dict]) -> dict:
    """The JSON line's figures from `compare` at each layer count (keys: layer counts)."""
    first, last = min(runs), max(runs)
    by = {key: {str(n): round(run[key], 3) for n, run in runs.items()}
          for key in ("unrolled_compile_s", "scan_compile_s", "unrolled_decode_ms", "scan_decode_ms")}
    ratios = {f"{form}_compile_ratio_{last}_over_{first}":
              runs[last][f"{form}_compile_s"] / runs[first][f"{form}_compile_s"] for form in ("unrolled", "scan")}
    return {"benchmark": "layer_scan", **{f"{key}_by_layers": value for key, value in by.items()}, **ratios,
            "scan_decode_slowdown_by_layers": {str(n): run["scan_decode_ms"] / run["unrolled_decode_ms"]
                                               for n, run in runs.items()},
            "scan_outputs_match": all(run["max_abs_difference"] <= 1e-4 for run in runs.values()),
            "pairs_by_layers": {str(n): run["pairs"] for n, run in runs.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16], help="main layer counts (>= 4)")
    parser.add_argument("--repeats", type=int, default=20, help="timed decode calls per form (default 20)")
    args = parser.parse_args(argv)
    if min(args.layers) < 4:
        parser.error("--layers: each count must be at least 4 (one CSA/HCA pair)")
    jax.config.update("jax_compilation_cache_dir", None)  # compile for real
    result = {"load_avg_1m_start": round(os.getloadavg()[0], 2)}
    runs = {}
    for layers in sorted(set(args.layers)):
        log(f"{layers} layers")
        runs[layers] = compare(layers, args.repeats)
    result |= summary(runs) | {"load_avg_1m_end": round(os.getloadavg()[0], 2), "device": str(jax.devices()[0])}
    print(json_line(result))
    return result


if __name__ == "__main__":
    main()
