"""DSpark benchmark on the bundled model: no speculation vs fixed-length vs confidence-scheduled verification.

    .venv/bin/python scripts/bench_dspark.py             # full run
    .venv/bin/python scripts/bench_dspark.py --quick     # 1 repeat, fewer requests

Prints a table on stderr and ONE JSON line on stdout: an object per mode (`none`, `fixed`, `dspark`, and
`dspark-planner`: DSpark with its no-draft fallback off, so the scheduler's choice of drafts shows on its own
even where falling back to plain decoding is faster) with `accepted_per_step` (drafts accepted per decode /
verify row-step), `verified_per_step` (drafts verified per row-step), `tokens_per_step` (tokens emitted per
row-step), `acceptance_by_position`, `calibration_error` (mean |acceptance probability - confidence| over
verified drafts whose prefix survived), `tok_s_b1` and `tok_s_b16` (generated tokens / generation wall time,
median of `--repeats` runs, after `warmup()` compiled every bucket and DSpark profiled its cost table); then the
comparisons the issue asks for (`verified_reduction` of DSpark against fixed, `accepted_ratio`, the same for
`planner_...`, `speedup_b1` of DSpark over none) and the calibration error of the shipped drafter before STS
(every temperature 1) and after.

Requests: the fixed prompts below, sampled at `--temperature` (default 1.0, what the drafter was trained and
calibrated for) with per-request seeds, `ignore_eos`, `--max-tokens` new tokens. Batch 1 runs the requests one
at a time (`max_slots=1`), batch 16 all at once. The bundled model has Engram layers, so the engine reads every
step before dispatching the next (zero-overhead scheduling off) and DSpark plans with fresh confidences.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from model.checkpoint import load_model  # noqa: E402
from model.dspark import Drafter  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402

PROMPTS = ["ROMEO:\n", "First Citizen:\n", "KING HENRY:\nNow", "The sea is calm", "What say you, my lord?",
           "JULIET:\nO", "Enter a Messenger.\n", "My gracious sovereign,", "HAMLET:\nTo", "Good morrow, sir.",
           "LADY MACBETH:\n", "Come, let us go", "I pray thee, tell me", "DUKE:\nSo", "The king is dead,",
           "Why, how now,"]


def run(model, mode: str, batch: int, prompts: list[list[int]], args) -> tuple[float, dict]:
    """(tokens/s of a generation run, the engine's speculation metrics) after compiling and one warm-up run.
    `dspark-planner` is DSpark without its no-draft fallback: the scheduler's choice of drafts on its own."""
    speculation, fallback = ("dspark", False) if mode == "dspark-planner" else (mode, True)
    engine = Engine(model, max_slots=batch, max_len=256, prefill_chunk=32, max_prefill_rows=2,
                    speculation=speculation, draft_fallback=fallback)
    engine.warmup()
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    engine.generate(prompts, params)  # warm-up (and the cost table's first online corrections)
    rates, stats = [], None
    for _ in range(args.repeats):
        engine.stats = {k: v * 0 for k, v in engine.stats.items()}
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        rates.append(sum(len(o.token_ids) for o in outputs) / seconds)
        stats = engine.speculation_metrics()
    return statistics.median(rates), stats


def without_sts(drafter: Drafter) -> Drafter:
    """The same drafter with its STS temperatures removed (all 1)."""
    module = drafter.module()
    module.config = dataclasses.replace(module.config, confidence_temperatures=())
    return Drafter(module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--modes", default="none,fixed,dspark,dspark-planner",
                        help="comma-separated subset of none,fixed,dspark,dspark-planner")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    model = load_model()
    prompts16 = [model.tokenizer.encode(p) for p in PROMPTS]
    prompts1 = prompts16[:2 if args.quick else 4]
    result = {"load_avg_start": os.getloadavg()[0], "temperature": args.temperature, "max_tokens": args.max_tokens}
    modes = args.modes.split(",")
    for mode in modes:
        tok_s_b1, metrics_b1 = run(model, mode, 1, prompts1, args)
        tok_s_b16, metrics = run(model, mode, 16, prompts16, args)
        result[mode] = {**{k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()},
                        "accepted_per_step_b1": round(metrics_b1["accepted_per_step"], 4),
                        "verified_per_step_b1": round(metrics_b1["verified_per_step"], 4),
                        "tok_s_b1": round(tok_s_b1, 1), "tok_s_b16": round(tok_s_b16, 1)}
        print(f"{mode:7s} b1 {tok_s_b1:7.1f} tok/s  b16 {tok_s_b16:7.1f} tok/s  accepted/step "
              f"{metrics['accepted_per_step']:.3f}  verified/step {metrics['verified_per_step']:.3f}", file=sys.stderr)
    if modes != ["none", "fixed", "dspark", "dspark-planner"]:
        print(json.dumps(result))
        return
    shipped = model.drafter
    model.drafter = without_sts(shipped)
    _, before = run(model, "fixed", 16, prompts16, args)
    model.drafter = shipped
    fixed, dspark, planner = result["fixed"], result["dspark"], result["dspark-planner"]
    ratio = lambda a, b: round(a / b, 4) if b else None  # noqa: E731
    result |= {
        "verified_reduction": round(1 - dspark["verified_per_step"] / fixed["verified_per_step"], 4),
        "accepted_ratio": ratio(dspark["accepted_per_step"], fixed["accepted_per_step"]),
        "verified_reduction_b1": round(1 - dspark["verified_per_step_b1"] / fixed["verified_per_step_b1"], 4),
        "accepted_ratio_b1": ratio(dspark["accepted_per_step_b1"], fixed["accepted_per_step_b1"]),
        "planner_verified_reduction": round(1 - planner["verified_per_step"] / fixed["verified_per_step"], 4),
        "planner_accepted_ratio": ratio(planner["accepted_per_step"], fixed["accepted_per_step"]),
        "planner_verified_reduction_b1": round(1 - planner["verified_per_step_b1"] / fixed["verified_per_step_b1"],
                                               4),
        "planner_accepted_ratio_b1": ratio(planner["accepted_per_step_b1"], fixed["accepted_per_step_b1"]),
        "speedup_b1": round(dspark["tok_s_b1"] / result["none"]["tok_s_b1"], 3),
        "speedup_b1_fixed": round(fixed["tok_s_b1"] / result["none"]["tok_s_b1"], 3),
        "calibration_error_before_sts": round(before["calibration_error"], 4),
        "calibration_error_after_sts": fixed["calibration_error"],
        "load_avg_end": os.getloadavg()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
