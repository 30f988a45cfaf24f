"""Prefill benchmark: bounded decoder replay (`model.replay`) off vs on, 2k- and 8k-token prompts, CPU.

    jaxseek bench prefill             # 5 timed runs per figure (~20 min on 2 busy cores)
    jaxseek bench prefill --runs 1 --ttft-len 4096
    jaxseek bench prefill --quick     # a check that it runs: 2k / 512-token sizes, 1 run

Prints ONE JSON line on stdout (progress on stderr). Never run by the test suite.

Model: `bench_config()`, V4.1-Flash's layer schedule unchanged (40 layers: 2 sliding, 18 ratio-2 encoder layers
with KV sources 2, 8, 14, 20 and index sources 2, 8, 14, 20; the ratio-1 decoder from layer 20, its KV source
20 and re-index layers 24, 28, 32, 36; candidate source 20; window 128; so 21 layers run on every prompt token
and 19 are replay layers, as in the real model) with every width shrunk until an 8k prefill takes seconds on two
cores: hidden 128, 2 heads of 64, index 2 heads of 32 picking 64 entries inside 32 candidate blocks of 8, 4
routed experts (top 2) of 128 plus the shared one. The fraction of prefill work replay removes depends on that
19 / 40 split and on each layer's cost per token, which these widths keep alike across encoder and decoder
layers (every layer has attention + MoE; the encoder adds compression, the decoder re-indexing).
Dropped: Engram (an encoder-only per-token lookup, the same cost with replay on and off; here it would only
add a host-side hash), the FP8/FP4 QAT fake quantisation (elementwise, all layers alike) and the DSpark layers
(not part of prefill). Random weights (`init_model`, seed 0), random token ids: replay's cost does not depend
on values.

Measured: the wall time of one request's prefill (batch 1) through `Model.step` in chunks of `--chunk` tokens
(2k: one chunk, 8k: four; each chunk passes the prompt's end, so with replay the first chunks skip the replay
layers and the last runs them on `keep` = 140 tokens), from a fresh cache to the last chunk's logits on the
host. `compact` mode (the serving one). Each figure is the median of `--runs` runs after one untimed
compile-and-warm-up run per mode, the two modes' runs alternating (off, on, then on, off, ...); `runs_*` lists
them. `load_avg_1m_before` / `_after` come from `os.getloadavg()`:
a shared machine's other work slows both modes alike only if it is steady, so compare runs with low load.

Time to first token with the engine's prefix cache (`serving.prefix.prefix_admission`), same model, one slot, chunks of
`--ttft-chunk` tokens, bounded replay as above (compact, `--keep`; the engine's default): `ttft_cold_s` for a
`--ttft-len`-token prompt A with nothing cached (this run then caches A's pages and snapshots its window state
at every chunk end), `ttft_hit_s` for a prompt B sharing its first 90 % with A in the engine's default mode
(exact: B starts from A's deepest usable window-state snapshot, `serving.prefix.window_snapshots`, a chunk end at most
P - keep, and prefills only the rest), `ttft_hit_replay_s` with snapshots off (the exact replay instead:
ring + 39 x 127 = 5081 tokens on this 40-layer model, so most of B is recomputed), each with a fresh B suffix,
the median of `--runs` rounds (the cache cleared before each); `ttft_*_over_cold` are their ratios to cold.
`--quick` checks that the script runs (2k figures only, a 2048-token TTFT prompt).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

from model.api import Model
from model.initialize import init_model
from model.config_v41 import V41Config, v41_flash
from model.replay import Replay
from benchmarks.bench_json import json_line


def bench_config() -> V41Config:
    """V4.1-Flash's 40-layer CED schedule at CPU widths (see the module docstring)."""
    return dataclasses.replace(
        v41_flash(), vocab_size=1024, hidden_size=128, num_attention_heads=2, head_dim=64, qk_rope_head_dim=16,
        q_lora_rank=64, o_groups=2, o_lora_rank=32, compress_ratios=v41_flash().compress_ratios[:40],
        index_n_heads=2, index_head_dim=32, index_topk=64, candidate_topk_blocks=32, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=128, engram_layer_ids=(), engram_num_embeddings=(),
        num_nextn_predict_layers=0, dspark_target_layer_ids=(), qat_fake_quant=False)


def prefill_seconds(model: Model, tokens: np.ndarray, chunk: int, replay: Replay | None) -> float:
    """Wall time of one prefill of `tokens` [1, n] in chunks of `chunk`, from an empty cache."""
    n = tokens.shape[1]
    cache = model.init_cache(1, n)
    end = np.full(1, n, np.int32)
    t0 = time.perf_counter()
    for at in range(0, n, chunk):
        logits, cache = model.step(tokens[:, at:at + chunk], cache, replay=replay,
                                   prompt_end=None if replay is None else end)
    np.asarray(logits[:, -1])
    return time.perf_counter() - t0


def ttft_seconds(model: Model, prompt_len: int, chunk: int, runs: int, rng, keep: int) -> dict:
    """TTFT figures of the engine's prefix cache (see the module docstring)."""
    from serving.core.engine import Engine
    from serving.base.engine_config import EngineConfig
    from serving.base.sampling import SamplingParams

    # one prefill bucket, compiled in round 0 (a request of one token never decodes)
    engine = Engine(model, EngineConfig(max_slots=1, max_len=prompt_len + 8, prefill_chunk=chunk, max_prefill_rows=1,
                                        batch_invariant=True, prefix_cache=True, replay=Replay("compact", keep)))
    prefix, shared = engine.scheduler.prefix, prompt_len * 9 // 10
    store = prefix.snapshots
    snapshots = {"hit": store.capacity, "hit_replay": 0}  # the default (snapshots), then the exact replay
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times: dict[str, list[float]] = {"cold": [], **{name: [] for name in snapshots}}
    for r in range(runs + 1):  # round 0 warms up the host paths
        prefix.clear()
        a = rng.integers(0, model.config.vocab_size, prompt_len).tolist()
        ttft = {"cold": engine.generate([a], one)[0].time_to_first_token}
        for name, capacity in snapshots.items():
            store.capacity = capacity
            if not capacity:
                store.entries.clear()
            b = a[:shared] + rng.integers(0, model.config.vocab_size, prompt_len - shared).tolist()
            ttft[name] = engine.generate([b], one)[0].time_to_first_token
        store.capacity = snapshots["hit"]
        print(f"ttft round {r}: " + ", ".join(f"{k} {v:.2f} s" for k, v in ttft.items()), file=sys.stderr)
        for name, seconds in ttft.items():
            if r:
                times[name].append(round(seconds, 4))
    out = {f"ttft_{name}_s": round(statistics.median(v), 4) for name, v in times.items()}
    out |= {f"ttft_{name}_over_cold": round(out[f"ttft_{name}_s"] / out["ttft_cold_s"], 3) for name in snapshots}
    metrics = engine.prefix_cache_metrics()
    return out | {f"runs_ttft_{name}": v for name, v in times.items()} | {
        "ttft_len": prompt_len, "ttft_shared": shared, "ttft_chunk": chunk, "ttft_replay_tokens": prefix.replay,
        "ttft_engine_replay": f"{engine.replay.mode} keep {engine.replay.keep}" if engine.replay else "off",
        "prefix_hit_rate": round(metrics["hit_rate"], 3), "snapshot_hits": metrics["snapshot_hits"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per figure (median reported)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    parser.add_argument("--keep", type=int, default=140, help="replay keep (tokens)")
    parser.add_argument("--ttft-len", type=int, default=8192, help="prompt tokens of the TTFT figures")
    parser.add_argument("--ttft-chunk", type=int, default=512, help="engine prefill chunk of the TTFT figures")
    parser.add_argument("--quick", action="store_true", help="a check that the script runs: the 2k figures only, "
                        "TTFT of 2048-token prompts in 256-token chunks, one run")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.ttft_len, args.ttft_chunk = 1, 2048, 256
    if args.runs < 1 or args.chunk < 1 or 2048 % args.chunk:
        parser.error("--runs must be >= 1 and --chunk a divisor of 2048")
    if args.ttft_len < 640 or args.ttft_chunk < 1:
        parser.error("--ttft-len must be >= 640 (a 90 % prefix of whole pages) and --ttft-chunk >= 1")
    model = init_model(bench_config(), seed=0)
    rng = np.random.default_rng(0)
    result: dict = {"load_avg_1m_before": round(os.getloadavg()[0], 2)}
    modes = {"off": None, "on": Replay("compact", args.keep)}
    for n, label in ((2048, "2k"),) + ((8192, "8k"),) * (not args.quick):
        tokens = rng.integers(0, model.config.vocab_size, (1, n)).astype(np.int32)
        runs: dict[str, list[float]] = {name: [] for name in modes}
        for name, replay in modes.items():
            t0 = time.perf_counter()
            prefill_seconds(model, tokens, args.chunk, replay)
            print(f"{label} {name}: compile + warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for r in range(args.runs):  # alternate the order, so a load that drifts slows both modes alike
            for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                runs[name].append(round(prefill_seconds(model, tokens, args.chunk, modes[name]), 4))
            print(f"{label} round {r}: off {runs['off'][-1]} s, on {runs['on'][-1]} s", file=sys.stderr)
        for name in modes:
            result[f"prefill_s_{label}_{name}"] = round(statistics.median(runs[name]), 4)
            result[f"runs_{label}_{name}"] = runs[name]
        on, off = result[f"prefill_s_{label}_on"], result[f"prefill_s_{label}_off"]
        result[f"ratio_{label}_on_over_off"] = round(on / off, 3)
    result.update(ttft_seconds(model, args.ttft_len, args.ttft_chunk, args.runs, rng, args.keep))
    result.update(load_avg_1m_after=round(os.getloadavg()[0], 2), keep=args.keep, chunk=args.chunk,
                  config="bench_config(): v41-flash schedule, 40 layers (21 prefill + 19 replay), hidden 128")
    print(json_line(result))
    return result


if __name__ == "__main__":
    main()
