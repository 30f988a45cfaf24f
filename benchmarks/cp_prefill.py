"""Context-parallel prefill benchmark: what each device computes of a prefill chunk with the chunk split over `cp`
context ranks, against the same mesh without them.

    jaxseek bench cp-prefill                                  # chunks of 64 and 256 tokens, contexts of 512 and 2048
    jaxseek bench cp-prefill --chunks 256 --contexts 2048 --cp 2 4

Prints ONE JSON line on stdout (progress on stderr). Never run by the test suite.

The bundled model (V4.1) on `dp=2` (cp 1) and on `cp=C,dp=2` for each C of `--cp`, one engine per (chunk, context)
with two request slots. For each, the prefill step bucket of the chunk's width at the longest context is compiled
and XLA's count of its FLOPs read per device (`cost_analysis`, summed over its programs):
- `flops_per_device_<chunk>_<context>_cp<C>`, and `..._over_cp1`: the share of the cp=1 FLOPs a device computes.
  The engine splits the attention cores, the indexer's scores and the routed experts over `cp` and keeps the
  projections, compressors and the shared expert replicated, so the share lies between 1/C and 1;
- XLA also counts the branch that only a step with a prompt-logprobs request takes: the head over every token of
  the chunk, `scored_head_flops_<chunk>` (2 x hidden x vocab per token, replicated); `..._over_cp1_unscored` is
  the share without it, what an ordinary prefill step costs a device;
- `tokens_equal_cp<C>`: whether a prompt of the longest context (several chunks) decodes the cp=1 tokens;
- `prefill_seconds_<chunk>_cp<C>`: the median of `--repeats` prefills of that prompt (after one that compiles). On a
  CPU the emulated devices share its cores, so this time is no speed-up figure: it is for a GPU host.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

from benchmarks.bench_json import json_line

SLOTS = 2


def log(message: str) -> None:
    print(f"bench cp-prefill: {message}", file=sys.stderr, flush=True)


def step_flops(engine, width: int) -> float:
    """FLOPs per device of `engine`'s prefill bucket of `width` tokens at its largest context bucket."""
    bucket = max(b for b in engine.buckets() if b[2] == 1 and b[1] == width)
    executables = engine.placement.compile(engine._halves, engine.layer_plan, engine.weights, engine.cache, bucket,
                                           engine._engram_shapes())
    return float(sum((e.cost_analysis() or {}).get("flops", 0.0) for e in executables))


def prefill_seconds(engine, prompt: list[int], params, repeats: int) -> tuple[float, list[int]]:
    """(median seconds of `repeats` runs of `prompt` to its first tokens after one that compiles, their tokens)."""
    engine.generate([prompt], params)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        [out] = engine.generate([prompt], params)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out.token_ids


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 256], help="prefill chunk widths (tokens)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048], help="engine max_len (tokens)")
    parser.add_argument("--cp", type=int, nargs="+", default=[2], help="context ranks to compare with cp=1")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills per engine (default 3)")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 2 * max(args.cp))
    from model import load_model
    from serving.base.sampling import SamplingParams
    from serving.core.engine import Engine

    model = load_model()
    text = ("KING HENRY:\nOnce more unto the breach, dear friends, once more; Or close the wall up with our English "
            "dead. In peace there's nothing so becomes a man As modest stillness and humility. ")
    ids = model.tokenizer.encode(text * 200)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    result: dict = {"load_avg_1m_start": round(os.getloadavg()[0], 2), "model": "bundled", "base_mesh": "dp=2",
                    "chunks": args.chunks, "contexts": args.contexts, "cp": args.cp}
    tokens: dict[int, list] = {}
    rows = SLOTS // 2  # request rows per device of dp=2
    for chunk in args.chunks:
        result[f"scored_head_flops_{chunk}"] = 2.0 * model.config.hidden_size * model.config.vocab_size * chunk * rows
        for context in args.contexts:
            prompt = ids[:context - 8]
            for cp in [1, *args.cp]:
                mesh = "dp=2" if cp == 1 else f"cp={cp},dp=2"
                log(f"{mesh}, chunk {chunk}, context {context}")
                engine = Engine(model, mesh=mesh, max_slots=SLOTS, max_len=context, prefill_chunk=chunk,
                                prefix_cache=False)
                flops = step_flops(engine, chunk)
                key = f"flops_per_device_{chunk}_{context}"
                result[f"{key}_cp{cp}"] = flops
                if cp > 1:
                    base, head = result[f"{key}_cp1"], result[f"scored_head_flops_{chunk}"]
                    result[f"{key}_cp{cp}_over_cp1"] = round(flops / base, 3)
                    result[f"{key}_cp{cp}_over_cp1_unscored"] = round((flops - head) / (base - head), 3)
                if context == max(args.contexts):
                    seconds, out = prefill_seconds(engine, prompt, params, args.repeats)
                    result[f"prefill_seconds_{chunk}_cp{cp}"] = round(seconds, 3)
                    tokens.setdefault(cp, []).append(out)
                engine.close()
    for cp in args.cp:
        result[f"tokens_equal_cp{cp}"] = tokens[cp] == tokens[1]
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json_line(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
