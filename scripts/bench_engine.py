"""Engine benchmark: jaxseek's serving `Engine` against `transformers`' `generate()`, same weights, fp32, CPU.

    .venv/bin/python scripts/bench_engine.py            # full run (a few minutes on 2 cores)
    .venv/bin/python scripts/bench_engine.py --quick    # fewer repeats and tokens

Prints ONE JSON line on stdout (progress goes to stderr). Never run by the test suite (`testpaths = tests`).

Weights: `init_model(preset("small"), seed=0)` written with `save_checkpoint` to a temporary directory; jaxseek
reloads it with `load_model`, `transformers` with `DeepseekV4ForCausalLM.from_pretrained` (which must load every
tensor exactly; only the `mtp.*` tensors go unused, HF has no MTP). Nothing else is randomised: prompts are
fixed token ids (numpy seed `--prompt-seed`) given to both sides. The HF side runs in the oracle interpreter
(`$JAXSEEK_ORACLE_PYTHON` or `.venv-oracle/bin/python`, Python 3.11) as `scripts/hf_bench.py`, after the jaxseek
side, never at the same time; torch gets as many intra-op threads as the cores this process may use (all of
them), which is what XLA's CPU backend uses.

Engine: `Engine(model, max_slots=16, prefill_chunk=256, max_prefill_rows=2)` (zero-overhead scheduling on,
the defaults otherwise), `warmup()` first: the compile time of every bucket is `jaxseek_compile_s`, outside
every other figure. Each figure is the median of `--repeats` timed runs after one untimed warm-up run, and
requests are greedy (temperature 0) with `ignore_eos` (HF: `eos_token_id=None`, so EOS neither stops nor is
suppressed on either side).

- prefill (batch 1): a 512-token prompt, `max_tokens=1`. jaxseek: the request's time to first token (TTFT,
  from `add_request` to the host holding the token; two 256-token chunks). HF: wall time of
  `generate(max_new_tokens=1)`. Tokens/s = 512 / that time.
- decode (batch 1 and 16): 32-token prompts, N new tokens. Tokens/s = tokens generated after every row has
  its first token / the time from then until the first row has all N tokens. HF prefills the whole batch in
  one forward, so this is B * (N - 1) / (t_last - t_first), from streamer timestamps inside one `generate`
  call. The engine admits `max_prefill_rows` = 2 prompts per step, so at batch 16 its first tokens arrive over
  ~8 steps and its rows finish ~8 steps apart; the window [all rows have a first token, first row done] keeps
  every one of its steps a full 16-row decode step (the engine is polled after each `step()`: tokens become
  visible to the host there).
- host overhead (zero-overhead scheduling on), at batch 16 (`host_overhead_fraction`) and batch 1
  (`host_overhead_fraction_b1`): with B requests in steady decode, the wall time of S `engine.step()` calls
  (each dispatches one decode step and reads the previous one) gives `wall_ms_per_step`. The batch the engine
  passed to its compiled decode executable is then captured (one more step through a recording wrapper) and
  that same executable is called S times back-to-back on it (inputs already on the device, the cache threaded
  through as the engine does, `block_until_ready` on the last result only, so the device never waits for the
  host): `device_ms_per_step`, the device-bound time of a step. `host_ms_per_step` = max(0, wall - device) is
  host work that did not overlap device work, and host_overhead_fraction = host_ms_per_step / wall_ms_per_step.
  On the CPU backend "device" work runs on the same cores as the host, so host work can only overlap device
  work where XLA leaves a core idle; the figure is an upper bound of what a separate accelerator would show.

Speedups are jaxseek tokens/s over HF tokens/s. `greedy_match_*` compares the greedy tokens of both sides (the
fraction of rows whose N tokens are identical): fp32 on both sides, so anything well below 1 is a numerics
problem (or a near-tie in a random model), not a timing one. If either side fails, its traceback is put into
the JSON (`jaxseek_error` / `hf_error`) and the speedups are null.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.api import init_model  # noqa: E402
from model.checkpoint import load_model, save_checkpoint  # noqa: E402
from model.config import preset  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402

HF_SCRIPT = Path(__file__).resolve().parent / "hf_bench.py"
MAX_SLOTS, PREFILL_CHUNK, MAX_PREFILL_ROWS = 16, 256, 2


def log(message: str) -> None:
    print(f"bench_engine: {message}", file=sys.stderr, flush=True)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---- jaxseek side -------------------------------------------------------------------------------------------
def prefill_ttft(engine: Engine, prompt: list[int]) -> float:
    """Seconds from `add_request` to the first token of a max_tokens=1 request."""
    out = engine.generate([prompt], greedy(1))[0]
    if len(out.token_ids) != 1 or out.time_to_first_token is None:
        raise RuntimeError(f"prefill request returned {out.token_ids} (ttft {out.time_to_first_token})")
    return out.time_to_first_token


def decode_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(tokens/s after every row's first token until the first row finishes, max TTFT, generated tokens)."""
    ids = [engine.add_request(p, greedy(new_tokens)) for p in prompts]
    requests = [engine.requests[i] for i in ids]
    start = time.perf_counter()
    window_start = window_end = None
    results = {}
    while engine.has_work:
        for out in engine.step():
            results[out.request_id] = out
        now = time.perf_counter()
        counts = [len(r.output) for r in requests]
        if window_start is None and min(counts) >= 1:
            window_start = (now, sum(counts))
        if window_end is None and max(counts) >= new_tokens:
            window_end = (now, sum(counts))
    tokens = [results[i].token_ids for i in ids]
    if any(len(t) != new_tokens for t in tokens):
        raise RuntimeError(f"decode requests returned {[len(t) for t in tokens]} tokens, expected {new_tokens}")
    if window_end[1] <= window_start[1]:
        raise RuntimeError("no decode window: the first row finished before the last row had its first token")
    tps = (window_end[1] - window_start[1]) / (window_end[0] - window_start[0])
    return tps, window_start[0] - start, tokens


def host_overhead(engine: Engine, prompts: list[list[int]], steps: int) -> dict:
    """Wall vs device-bound time per decode step with len(prompts) requests in steady decode."""
    batch = len(prompts)
    ids = [engine.add_request(p, greedy(steps * 3 + 64)) for p in prompts]
    requests = [engine.requests[i] for i in ids]
    while min(len(r.output) for r in requests) < 1:
        engine.step()
    for _ in range(3):  # steady state: every step is one decode step of all rows
        engine.step()
    before = sum(len(r.output) for r in requests)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t) / steps
    produced = sum(len(r.output) for r in requests) - before
    if produced != batch * steps:
        raise RuntimeError(f"{steps} steady decode steps produced {produced} tokens, expected {batch * steps}")

    bucket = (next(r for r in engine.decode_rows if r >= batch), 1)
    executable, captured = engine.compiled[bucket], []

    def recording(params, cache, step_batch):
        captured.append(step_batch)
        return executable(params, cache, step_batch)

    engine.compiled[bucket] = recording
    try:
        engine.step()
    finally:
        engine.compiled[bucket] = executable
    if len(captured) != 1:
        raise RuntimeError(f"expected one decode dispatch of bucket {bucket}, saw {len(captured)}")
    for i in ids:
        engine.cancel(i)
    while engine.has_work:
        engine.step()

    step_batch = jax.device_put(captured[0])
    params, cache = engine.model.params, engine.cache
    for _ in range(2):
        out, cache = executable(params, cache, step_batch)
    jax.block_until_ready((out, cache))
    t = time.perf_counter()
    for _ in range(steps):
        out, cache = executable(params, cache, step_batch)
    jax.block_until_ready((out, cache))
    device = (time.perf_counter() - t) / steps
    engine.cache = cache
    host = max(0.0, wall - device)
    return {"wall_ms_per_step": wall * 1e3, "device_ms_per_step": device * 1e3, "host_ms_per_step": host * 1e3,
            "host_overhead_fraction": host / wall, "bucket": list(bucket)}


def run_jaxseek(ckpt: Path, prompts: dict, args) -> dict:
    r: dict = {}
    t = time.perf_counter()
    model = load_model(ckpt, dtype="float32")
    r["jaxseek_load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    engine = Engine(model, max_slots=MAX_SLOTS, prefill_chunk=PREFILL_CHUNK, max_prefill_rows=MAX_PREFILL_ROWS)
    r["jaxseek_engine_init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    engine.warmup()
    r["jaxseek_compile_s"] = time.perf_counter() - t
    r["jaxseek_buckets"] = [list(b) for b in engine.buckets()]
    log(f"compiled {len(engine.buckets())} buckets in {r['jaxseek_compile_s']:.1f} s")

    prefill_ttft(engine, prompts["prefill"])  # warm-up
    runs = [prefill_ttft(engine, prompts["prefill"]) for _ in range(args.repeats)]
    r["jaxseek_prefill_ttft_s"] = statistics.median(runs)
    r["jaxseek_prefill_tps"] = len(prompts["prefill"]) / r["jaxseek_prefill_ttft_s"]
    r["jaxseek_prefill_runs_s"] = runs
    log(f"prefill: {r['jaxseek_prefill_tps']:.1f} tok/s")

    for batch in (1, 16):
        rows = prompts["decode"][:batch]
        decode_run(engine, rows, args.decode_tokens)  # warm-up
        runs = [decode_run(engine, rows, args.decode_tokens) for _ in range(args.repeats)]
        r[f"jaxseek_decode_tps_b{batch}"] = statistics.median(x[0] for x in runs)
        r[f"jaxseek_decode_runs_tps_b{batch}"] = [x[0] for x in runs]
        r[f"jaxseek_decode_ttft_s_b{batch}"] = statistics.median(x[1] for x in runs)
        r[f"jaxseek_tokens_b{batch}"] = runs[-1][2]
        log(f"decode b{batch}: {r[f'jaxseek_decode_tps_b{batch}']:.2f} tok/s")

    for batch in (1, 16):
        h = host_overhead(engine, prompts["decode"][:batch], args.host_steps)
        suffix = "" if batch == 16 else "_b1"
        for key, value in h.items():
            r[f"{key}{suffix}"] = value
        log(f"host overhead b{batch}: {h}")
    r["jaxseek_engine_stats"] = dict(engine.stats)
    return r


# ---- HF side ------------------------------------------------------------------------------------------------
def oracle_python() -> str:
    configured = os.environ.get("JAXSEEK_ORACLE_PYTHON")
    path = configured or str(REPO_ROOT / ".venv-oracle" / "bin" / "python")
    if not Path(path).exists():
        raise RuntimeError(f"no oracle interpreter at {path} (scripts/setup_oracle.sh or $JAXSEEK_ORACLE_PYTHON)")
    return path


def run_hf(ckpt: Path, prompts_file: Path, threads: int, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", PYTHONNOUSERSITE="1")
    command = [oracle_python(), str(HF_SCRIPT), "--model", str(ckpt), "--prompts", str(prompts_file),
               "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats), "--threads", str(threads)]
    t = time.perf_counter()
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=None, text=True, env=env, timeout=args.hf_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with status {proc.returncode} (its stderr is above)")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["hf_subprocess_s"] = time.perf_counter() - t
    return r


# ---- main ---------------------------------------------------------------------------------------------------
def match(a: list[list[int]] | None, b: list[list[int]] | None) -> float | None:
    if a is None or b is None:
        return None
    return sum(x == y for x, y in zip(a, b)) / len(a)


def ratio(r: dict, ours: str, theirs: str) -> float | None:
    return r[ours] / r[theirs] if r.get(ours) and r.get(theirs) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 repeats, 16 new tokens, 16 host-overhead steps")
    parser.add_argument("--repeats", type=int, help="timed runs per figure (default 5, quick 3)")
    parser.add_argument("--decode-tokens", type=int, help="new tokens per decode request (default 64, quick 16)")
    parser.add_argument("--host-steps", type=int, help="steps timed for host overhead (default 64, quick 16)")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--prompt-seed", type=int, default=1234)
    parser.add_argument("--hf-timeout", type=float, default=900.0, help="seconds before the HF subprocess is killed")
    parser.add_argument("--skip-hf", action="store_true", help="jaxseek figures only")
    parser.add_argument("--out", type=Path, help="also write the JSON line to this file")
    args = parser.parse_args()
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.decode_tokens = args.decode_tokens or (16 if args.quick else 64)
    args.host_steps = args.host_steps or (16 if args.quick else 64)
    if args.repeats < 3:
        parser.error("--repeats must be >= 3 (figures are medians)")

    t_start = time.perf_counter()
    config = preset("small")
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rng = np.random.default_rng(args.prompt_seed)
    prompts = {"prefill": rng.integers(2, config.vocab_size, args.prefill_len).tolist(),
               "decode": rng.integers(2, config.vocab_size, (MAX_SLOTS, args.decode_prompt_len)).tolist()}
    result: dict = {"benchmark": "jaxseek Engine vs transformers generate(), small preset, fp32, CPU"}

    with tempfile.TemporaryDirectory(prefix="jaxseek-bench-") as tmp:
        ckpt, prompts_file = Path(tmp) / "small", Path(tmp) / "prompts.json"
        t = time.perf_counter()
        model = init_model(config, seed=0)
        num_params = int(sum(x.size for x in jax.tree.leaves(model.params)))
        save_checkpoint(model, ckpt)
        del model
        result["checkpoint_s"] = time.perf_counter() - t
        prompts_file.write_text(json.dumps(prompts))

        try:
            result.update(run_jaxseek(ckpt, prompts, args))
        except Exception:  # report the engine's failure precisely, still run the HF side
            result["jaxseek_error"] = traceback.format_exc()
            log(result["jaxseek_error"])
        if not args.skip_hf:
            try:
                result.update(run_hf(ckpt, prompts_file, threads, args))
            except Exception:
                result["hf_error"] = traceback.format_exc()
                log(result["hf_error"])

    result["decode_speedup_b1"] = ratio(result, "jaxseek_decode_tps_b1", "hf_decode_tps_b1")
    result["decode_speedup_b16"] = ratio(result, "jaxseek_decode_tps_b16", "hf_decode_tps_b16")
    result["prefill_speedup"] = ratio(result, "jaxseek_prefill_tps", "hf_prefill_tps")
    for batch in (1, 16):
        ours, theirs = result.pop(f"jaxseek_tokens_b{batch}", None), result.pop(f"hf_tokens_b{batch}", None)
        result[f"greedy_match_b{batch}"] = match(ours, theirs)
    import flax

    result["config"] = {"preset": "small", "num_params": num_params, "dtype": "float32", "seed": 0,
                        **dataclasses.asdict(config)}
    result["machine"] = {
        "cpu_count": os.cpu_count(), "cpus_usable": threads, "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
        "jax_version": jax.__version__, "jaxlib_version": getattr(jax.lib, "__version__", None) or
        __import__("jaxlib").__version__, "flax_version": flax.__version__, "numpy_version": np.__version__,
        "jax_devices": [str(d) for d in jax.devices()], "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "torch_version": result.pop("torch_version", None),
        "transformers_version": result.pop("transformers_version", None),
        "torch_threads": result.pop("torch_threads", None),
        "torch_interop_threads": result.pop("torch_interop_threads", None), "hf_python": result.pop("hf_python", None),
    }
    result["settings"] = {
        "mode": "quick" if args.quick else "full", "repeats": args.repeats, "statistic": "median",
        "warmup_runs": 1, "prefill_len": args.prefill_len, "prefill_batch": 1,
        "decode_prompt_len": args.decode_prompt_len, "decode_new_tokens": args.decode_tokens,
        "decode_batches": [1, 16], "host_overhead_steps": args.host_steps, "prompt_seed": args.prompt_seed,
        "sampling": "greedy, ignore_eos", "engine": {"max_slots": MAX_SLOTS, "prefill_chunk": PREFILL_CHUNK,
                                                     "max_prefill_rows": MAX_PREFILL_ROWS, "zero_overhead": True},
        "threads_both_sides": threads, "hf_ran": not args.skip_hf,
    }
    result["total_s"] = time.perf_counter() - t_start
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
