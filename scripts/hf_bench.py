"""The `transformers` side of `scripts/bench_engine.py`: HF `DeepseekV4ForCausalLM.generate()` timings.

Runs in the oracle interpreter (Python 3.11, torch + transformers, see `scripts/setup_oracle.sh`) and imports
nothing from the project. Standalone, it runs every figure and prints ONE JSON object on stdout (everything
else goes to stderr). `bench_engine.py` starts it with `--serve` instead: after loading, it answers one JSON
command per stdin line (one timed run each) with one JSON line on stdout, so the caller can interleave HF runs
with its own runs and both sides see the same background load.

Inputs: `--model` a checkpoint directory written by jaxseek's `save_checkpoint` (HF loads it with
`from_pretrained`, fp32, failing on any missing / unexpected / mismatched tensor except `mtp.*`, which HF does
not implement); `--prompts` a JSON file {"prefill": [ids], "decode": [[ids], ...]} (the same prompts the jaxseek
side runs).

What is timed (CPU, fp32, `torch.inference_mode`, `torch.set_num_threads(--threads)`: all cores, as JAX uses):
- prefill: wall time of `generate(prompt, max_new_tokens=1)` on the batch-1 prefill prompt (prompt forward
  with `use_cache=True`, the argmax, generate's setup), i.e. time to first token; tokens/s = prompt length / it.
- decode at batch 1 and 16: greedy `generate(max_new_tokens=N)` with `eos_token_id=None` (EOS neither stops
  nor is suppressed, like the engine's `ignore_eos`), all rows the same length (no padding). A streamer
  timestamps every step inside the one call: `generate` hands it the prompt, then each step's new tokens.
  decode tokens/s = B * (N - 1) / (time of the last token - time of the first token), i.e. generated tokens
  after the first one over the time after the first token.
Standalone, each figure is the median of `--repeats` timed runs after one untimed warm-up run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DeepseekV4ForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging


class StepTimer(BaseStreamer):
    """Records `time.perf_counter()` at every `put` (the prompt first, then each step's tokens)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def log(message: str) -> None:
    print(f"hf_bench: {message}", file=sys.stderr, flush=True)


def load(model_dir: Path) -> DeepseekV4ForCausalLM:
    model, info = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    problems = {
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(k for k in info["unexpected_keys"] if not re.search(r"(^|\.)mtp\.", k)),
        "mismatched": sorted(str(k) for k in info["mismatched_keys"]),
        "errors": list(info["error_msgs"]),
    }
    problems = {kind: keys for kind, keys in problems.items() if keys}
    if problems:
        raise SystemExit(f"hf_bench: {model_dir} did not load exactly: {json.dumps(problems)}")
    model.generation_config.eos_token_id = None  # never stop early, never suppress EOS (engine: ignore_eos)
    model.generation_config.pad_token_id = 0
    return model.eval()


def generate(model, prompts: list[list[int]], new_tokens: int):
    """One greedy generate call; returns (wall seconds, step timestamps, call start, generated ids)."""
    ids = torch.tensor(prompts, dtype=torch.long)
    timer = StepTimer()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, streamer=timer)
    wall = time.perf_counter() - start
    generated = out[:, ids.shape[1]:].tolist()
    if any(len(g) != new_tokens for g in generated):
        raise SystemExit(f"hf_bench: generate returned {[len(g) for g in generated]} tokens, expected {new_tokens}")
    if len(timer.times) != new_tokens + 1:
        raise SystemExit(f"hf_bench: streamer saw {len(timer.times)} puts, expected {new_tokens + 1}")
    return wall, timer.times, start, generated


def prefill_run(model, prompt: list[int]) -> dict:
    """One timed prefill: wall time of generate(max_new_tokens=1) on the batch-1 prompt."""
    wall, _, _, _ = generate(model, [prompt], 1)
    return {"ttft_s": wall, "tps": len(prompt) / wall}


def decode_run(model, rows: list[list[int]], new_tokens: int) -> dict:
    """One timed decode: B * (N - 1) tokens over the time after the first token (streamer timestamps)."""
    _, times, start, generated = generate(model, rows, new_tokens)
    return {"tps": len(rows) * (new_tokens - 1) / (times[-1] - times[1]), "ttft_s": times[1] - start,
            "tokens": generated}


def versions() -> dict:
    return {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "hf_python": platform.python_version(),
            "hf_decode_timing": "streamer timestamps inside one generate(max_new_tokens=N): B*(N-1) / (t_last - "
                                "t_first)",
            "hf_prefill_timing": "wall time of generate(max_new_tokens=1) over the prompt"}


def serve(model, prompts: dict) -> None:
    """Answer one JSON command per stdin line with one JSON line on stdout, so the caller can interleave runs
    with its own: {"op": "prefill"}, {"op": "decode", "batch": B, "new_tokens": N}, {"op": "quit"}."""
    print(json.dumps({"ready": True, **versions()}), flush=True)
    with torch.inference_mode():
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "quit":
                break
            if command["op"] == "prefill":
                reply = prefill_run(model, prompts["prefill"])
            elif command["op"] == "decode":
                reply = decode_run(model, prompts["decode"][: command["batch"]], command["new_tokens"])
            else:
                raise SystemExit(f"hf_bench: unknown command {command!r}")
            print(json.dumps(reply), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decode run (N)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    parser.add_argument("--serve", action="store_true", help="answer commands on stdin (see `serve`)")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    prompts = json.loads(args.prompts.read_text())
    if len(prompts["decode"]) < 16:
        raise SystemExit(f"hf_bench: need 16 decode prompts, got {len(prompts['decode'])}")

    t = time.perf_counter()
    model = load(args.model)
    load_s = time.perf_counter() - t
    log(f"loaded in {load_s:.1f} s, {torch.get_num_threads()} threads")
    if args.serve:
        serve(model, prompts)
        return

    result: dict = {"hf_load_s": load_s}
    with torch.inference_mode():
        prefill_run(model, prompts["prefill"])  # warm-up
        runs = [prefill_run(model, prompts["prefill"]) for _ in range(args.repeats)]
        result["hf_prefill_ttft_s"] = statistics.median(r["ttft_s"] for r in runs)
        result["hf_prefill_tps"] = statistics.median(r["tps"] for r in runs)
        log(f"prefill {len(prompts['prefill'])} tokens: {result['hf_prefill_tps']:.1f} tok/s")
        for batch in (1, 16):
            rows = prompts["decode"][:batch]
            decode_run(model, rows, args.decode_tokens)  # warm-up
            runs = [decode_run(model, rows, args.decode_tokens) for _ in range(args.repeats)]
            result[f"hf_decode_tps_b{batch}"] = statistics.median(r["tps"] for r in runs)
            result[f"hf_decode_runs_tps_b{batch}"] = [r["tps"] for r in runs]
            result[f"hf_decode_ttft_s_b{batch}"] = statistics.median(r["ttft_s"] for r in runs)
            result[f"hf_tokens_b{batch}"] = runs[-1]["tokens"]
            log(f"decode b{batch}: {result[f'hf_decode_tps_b{batch}']:.2f} tok/s")
    result.update(versions())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
