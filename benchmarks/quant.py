"""Weights as stored against fp32 and bf16: decode speed and resident memory of the `small` preset, one run.

    .venv/bin/python scripts/bench_quant.py            # 5 repeats of 32 decode steps per batch size
    .venv/bin/python scripts/bench_quant.py --quick    # 3 repeats of 8 steps

Prints ONE JSON line on stdout (progress on stderr). Never run by the test suite.

Weights: `init_model(preset("small"), seed=0)` saved in fp32, converted with `jaxseek convert --weights fp8`
(FP8 linears, packed FP4 experts, the rest fp32), and that one checkpoint loaded three ways: `float32` (the
baseline: its exact decoding), `bfloat16` (exact decoding too: the default on CPU) and `checkpoint` (FP8 / FP4
resident, decoded inside the matmuls). Memory: the bytes of each model's parameter arrays after load
(`model.stats.resident_bytes`); `*_memory_ratio` = that / the fp32 model's.

Decode: `Model.step` (the jitted cached forward the engine also runs) on a batch of B rows: a 32-token prompt
prefilled, two untimed decode steps, then `--repeats` rounds of `--steps` greedy decode steps each (the next
tokens read back to the host every step, as a serving loop does). tokens/s = B * steps / seconds of a round;
each figure is the median over rounds, and `*_speedup_b{1,16}` = that format's tokens/s / fp32's. The formats
alternate within each round (fp32, bf16, checkpoint), so load from other jobs on the machine hits them alike;
`*_speedup_paired_b{1,16}` (the median over rounds of the ratio within a round) is the figure least moved by
a load that changes between rounds.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.bench_json import json_line
from model.checkpoint import load_model, save_checkpoint
from model.config import preset
from model.convert import convert
from model.initialize import init_model
from model.stats import resident_bytes

FORMATS = ("float32", "bfloat16", "checkpoint")
BATCHES = (1, 16)
PROMPT = 32


def log(message: str) -> None:
    print(f"[bench_quant] {message}", file=sys.stderr, flush=True)


class Decoder:
    """One model decoding a batch of B rows with `Model.step`, the cache carried between rounds."""

    def __init__(self, model, batch: int, max_len: int):
        self.model = model
        prompts = np.random.default_rng(batch).integers(0, model.config.vocab_size, (batch, PROMPT))
        self.cache = model.init_cache(batch, max_len)
        logits, self.cache = model.step(prompts, self.cache)
        self.tokens = np.asarray(logits[:, -1:].argmax(-1))
        self.steps(2)  # compiles the decode step

    def steps(self, n: int) -> float:
        """Seconds for n greedy decode steps."""
        start = time.perf_counter()
        for _ in range(n):
            logits, self.cache = self.model.step(self.tokens, self.cache)
            self.tokens = np.asarray(logits.argmax(-1))
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats of 8 decode steps")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed round")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 3, 8
    result = {"preset": "small", "repeats": args.repeats, "steps": args.steps, "jax": jax.__version__,
              "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, cwd=Path(__file__).parent).stdout.strip()}
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        save_checkpoint(init_model(preset("small"), seed=0), Path(tmp) / "fp32")
        convert(Path(tmp) / "fp32", Path(tmp) / "fp8", progress=False)
        result["convert_s"] = time.perf_counter() - t
        models = {w: load_model(Path(tmp) / "fp8", weights=w) for w in FORMATS}
    result["resident_bytes"] = {w: resident_bytes(m) for w, m in models.items()}
    max_len = 256 if PROMPT + 2 + args.repeats * args.steps <= 256 else 1024
    runs = {w: {b: [] for b in BATCHES} for w in FORMATS}
    for batch in BATCHES:
        t = time.perf_counter()
        decoders = {w: Decoder(m, batch, max_len) for w, m in models.items()}
        log(f"batch {batch}: compiled and prefilled in {time.perf_counter() - t:.1f} s")
        for round_ in range(args.repeats):
            for w, decoder in decoders.items():
                runs[w][batch].append(batch * args.steps / decoder.steps(args.steps))
            log(f"batch {batch} round {round_}: " + ", ".join(f"{w} {runs[w][batch][-1]:.1f} tok/s" for w in FORMATS))
    tps = {w: {f"b{b}": statistics.median(runs[w][b]) for b in BATCHES} for w in FORMATS}
    base_bytes = result["resident_bytes"]["float32"]
    for name, w in (("bf16", "bfloat16"), ("quant", "checkpoint")):
        for b in BATCHES:
            result[f"{name}_speedup_b{b}"] = tps[w][f"b{b}"] / tps["float32"][f"b{b}"]
            result[f"{name}_speedup_paired_b{b}"] = statistics.median(
                ours / base for ours, base in zip(runs[w][b], runs["float32"][b]))
        result[f"{name}_memory_ratio"] = result["resident_bytes"][w] / base_bytes
    result.update(decode_tps=tps, decode_runs_tps={w: {f"b{b}": r for b, r in v.items()} for w, v in runs.items()})
    print(json_line(result))


if __name__ == "__main__":
    main()
