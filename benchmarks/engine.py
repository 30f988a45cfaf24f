"""Engine benchmark: jaxseek's serving `Engine` against `transformers`' `generate()`, same weights, fp32, CPU.

    jaxseek bench engine            # full run (~7 min on 2 idle cores)
    jaxseek bench engine --quick    # 3 repeats, 16 new tokens (~4 min)

Prints ONE JSON line on stdout (progress goes to stderr). Never run by the test suite (`testpaths = tests`).
About 2 of those minutes are the engine's compilation; waiting for a busy machine adds up to `--wait-idle`.

Weights: `init_model(preset("small"), seed=0)` written with `save_checkpoint` to a temporary directory; jaxseek
reloads it with `load_model`, `transformers` with `DeepseekV4ForCausalLM.from_pretrained` (which must load every
tensor exactly; only the `mtp.*` tensors go unused, HF has no MTP). Nothing else is randomised: prompts are
fixed token ids (numpy seed `--prompt-seed`) given to both sides. The HF side runs in the oracle interpreter
(`$JAXSEEK_ORACLE_PYTHON` or `.venv-oracle/bin/python`, Python 3.11) as `scripts/hf_bench.py --serve`, a
subprocess that loads the model once and then does one timed run per command; torch gets as many intra-op
threads as the cores this process may use (all of them), which is what XLA's CPU backend uses.

Engine: `Engine(model, max_slots=16, prefill_chunk=256, max_prefill_rows=2, host_layout=True)` (zero-overhead
scheduling on, the weights held transposed as `jaxseek generate` and `serve` hold them on a CPU, the defaults
otherwise), `warmup()` first: the compile time of every bucket is `jaxseek_compile_s`, outside
every other figure. Each figure is the median of `--repeats` timed runs after one untimed warm-up run per side
(`*_runs_tps*` lists them), and requests are greedy (temperature 0) with `ignore_eos` (HF: `eos_token_id=None`,
so EOS neither stops nor is suppressed on either side).

- prefill (batch 1): a 512-token prompt, `max_tokens=1`. jaxseek: the request's time to first token (TTFT,
  from `add_request` to the host holding the token; two 256-token chunks). HF: wall time of
  `generate(max_new_tokens=1)`. Tokens/s = 512 / that time.
- decode (batch 1 and 16): 32-token prompts, N new tokens. Tokens/s = tokens generated after every row has
  its first token / the time from then until the first row has all N tokens. HF prefills the whole batch in
  one forward, so this is B * (N - 1) / (t_last - t_first), from streamer timestamps inside one `generate`
  call (not a difference of two `generate` calls). The engine admits `max_prefill_rows` = 2 prompts per step,
  so at batch 16 its first tokens arrive over ~8 steps and its rows finish ~8 steps apart; the window [all
  rows have a first token, first row done] keeps every one of its steps a full 16-row decode step (the engine
  is polled after each `step()`: tokens become visible to the host there).
- host overhead (zero-overhead scheduling on), at batch 16 (`host_overhead_fraction`) and batch 1
  (`host_overhead_fraction_b1`): with B requests in steady decode, the batch the engine passes to its compiled
  decode executable is captured (one step through a recording wrapper). Then, in each of `--repeats` rounds,
  the wall time of S `engine.step()` calls (each dispatches one decode step and reads the previous one) gives
  the wall time per step, and that same executable called S times back-to-back on the captured batch (inputs
  already on the device, a private copy of the engine's cache threaded through as the engine does,
  `block_until_ready` on the last result only, so the device never waits for the host) gives the device-bound
  time per step. `wall_ms_per_step` and `device_ms_per_step` are the medians over rounds (`rounds_*` lists
  them); `host_ms_per_step` = max(0, wall - device) is host work that did not overlap device work, and
  host_overhead_fraction = host_ms_per_step / wall_ms_per_step. Rounds differ by about +-5 %, so fractions of a
  few percent mean "no measurable overhead". On the CPU backend the "device" is the same cores as the host,
  so this describes this setup only: on an accelerator device steps are far shorter and the same host work
  would be a larger fraction.

Interleaving and background load: the two sides never run at the same time, but their runs alternate
(jaxseek, HF, then HF, jaxseek, ...), so a machine shared with other jobs (other containers, invisible to `ps`)
slows both alike. Every timed run records `background_load_cores`: the CPU time /proc/stat counts on the whole
machine minus what this process and the HF subprocess used, over the run's wall time. Before each timed round
the script waits for the machine to go idle (below 0.25 cores of other work), at most `--wait-idle` seconds
over the whole run (`waited_for_idle_s`), and a round that ran under more load than that (on either side) is
run again, at most 2 x `--repeats` rounds in all: the figures come from the clean rounds, topped up with the
least loaded others (`dropped_rounds_*` counts the rounds left out); any figure that still includes a busy run
gets a warning. `speedups_median_of_paired_rounds` (median over rounds of jaxseek / HF of the same round) is
the ratio least disturbed by a load that changes over time. A busy machine hurts HF far more than XLA: torch's
per-op thread barriers stall whenever one of its threads has no core (seen here: HF decode steps of ~50 ms
took ~1.5 s while a test suite ran alongside), so never trust a result with a warning.

Roofline (`benchmarks/roofline.py`): this machine's fp32 GEMM peak at each decode step's matmul shapes (1 and 16
rows) and its streaming read bandwidth, measured right after each of jaxseek's timed decode rounds (the machine
may be shared, and its speed drifts over minutes; `roofline_rounds_b*` lists them) and once more after all the
runs (the top-level `read_bytes_per_s`, `gemm_flops_per_s_b*`). `model.step_cost` counts the FLOPs and bytes a
decode step needs at the runs' middle position (each row's chosen experts only, each hit expert read once).
`roofline_fraction_b*` is the median over rounds of the least time such a step takes on the round's roofline
(max of FLOPs / peak, bytes / bandwidth) over the round's measured time per step (rows / decode tokens/s);
`roofline_fraction_end_b*` pairs the median decode with the measurement after all the runs instead.

Step products (`benchmarks/step_products.py`): after each of those rounds, the least time of a program made of
nothing but the step's weight products (the FLOPs `model.step_cost` counts, the engine's weights and product
forms, one after the other). `products_ceiling_fraction_b*` (median over rounds of the round's roofline over
it) is the most a step multiplying these weights in these forms can reach on this machine; `products_share_b*`
(median over rounds of it over the round's time per step) is the part of the step those products are.

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
import threading
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

import jax
import numpy as np

from benchmarks import roofline
from benchmarks.bench_json import json_line
from benchmarks.step_products import StepProducts
from model.checkpoint import load_model, save_checkpoint
from model.config import preset
from model.initialize import init_model
from model.step_cost import decode_step_cost, roofline_seconds
from serving.core.engine import Engine
from serving.base.engine_config import EngineConfig
from serving.base.sampling import SamplingParams

HF_SCRIPT = REPO_ROOT / "scripts" / "hf_bench.py"  # runs in the oracle venv, from a source checkout
MAX_SLOTS, PREFILL_CHUNK, MAX_PREFILL_ROWS = 16, 256, 2
ENGINE = EngineConfig(max_slots=MAX_SLOTS, prefill_chunk=PREFILL_CHUNK, max_prefill_rows=MAX_PREFILL_ROWS,
                      host_layout=True)
BUSY_CORES = 0.25  # background load above which the result carries a warning
HEADLINE = ("benchmark", "decode_speedup_b1", "decode_speedup_b16", "roofline_fraction_b1", "roofline_fraction_b16",
            "products_ceiling_fraction_b1", "products_ceiling_fraction_b16", "products_share_b1", "products_share_b16",
            "prefill_speedup", "host_overhead_fraction",
            "jaxseek_decode_tps_b1", "hf_decode_tps_b1", "jaxseek_decode_tps_b16", "hf_decode_tps_b16",
            "jaxseek_prefill_tps", "hf_prefill_tps", "device_ms_per_step", "host_ms_per_step", "wall_ms_per_step",
            "host_overhead_fraction_b1", "device_ms_per_step_b1", "host_ms_per_step_b1", "wall_ms_per_step_b1",
            "jaxseek_compile_s", "greedy_match_b1", "greedy_match_b16", "warnings", "background_load_cores")


def log(message: str) -> None:
    print(f"bench_engine: {message}", file=sys.stderr, flush=True)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---- background load ------------------------------------------------------------------------------------------
class CpuMeter:
    """CPU time spent on this machine by processes other than this one and the HF subprocess (in cores).

    The machine may be shared (other jobs in other containers, invisible to `ps`); /proc/stat counts them.
    A timed run is only meaningful if this is near 0.
    """

    def __init__(self):
        self.child_pid: int | None = None
        self.tick = os.sysconf("SC_CLK_TCK")

    def _busy_s(self) -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / self.tick  # all but idle and iowait

    def _child_s(self) -> float:
        if self.child_pid is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.child_pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime, stime

    def snapshot(self) -> tuple[float, float, float]:
        t = os.times()
        return time.perf_counter(), self._busy_s(), t.user + t.system + self._child_s()

    def foreign_cores(self, since: tuple[float, float, float]) -> float:
        now = self.snapshot()
        return max(0.0, (now[1] - since[1]) - (now[2] - since[2])) / (now[0] - since[0])


METER = CpuMeter() if Path("/proc/stat").exists() else None


class IdleWaiter:
    """Before each timed round, wait (2 s samples) until the background load is below BUSY_CORES, spending at
    most `budget_s` seconds over the whole benchmark; then go on regardless (the load is recorded anyway)."""

    def __init__(self, budget_s: float):
        self.budget_s, self.waited_s = budget_s, 0.0

    def __call__(self) -> None:
        while METER and self.waited_s < self.budget_s:
            since = METER.snapshot()
            time.sleep(min(2.0, self.budget_s - self.waited_s))
            self.waited_s += time.perf_counter() - since[0]
            load = METER.foreign_cores(since)
            if load < BUSY_CORES:
                return
            log(f"machine busy ({load:.2f} cores of other processes), waiting ({self.waited_s:.0f} of "
                f"{self.budget_s:.0f} s)")


WAIT_IDLE = IdleWaiter(0.0)


def metered(fn):
    """(fn(), cores of foreign CPU load while it ran, or None where /proc/stat is missing)."""
    since = METER.snapshot() if METER else None
    value = fn()
    return value, METER.foreign_cores(since) if METER else None


def clean_rounds(run_round, repeats: int) -> tuple[list, int]:
    """Run rounds (`run_round(i)` -> (payload, background load or None)) until `repeats` of them ran with a
    background load <= BUSY_CORES, at most 2 * repeats rounds. Returns (kept payloads in run order: the clean
    rounds, topped up with the least loaded others if fewer were clean; number of rounds dropped)."""
    rounds = []
    for i in range(2 * repeats):
        WAIT_IDLE()
        rounds.append(run_round(i))
        if sum(load is None or load <= BUSY_CORES for _, load in rounds) >= repeats:
            break
    by_load = sorted(range(len(rounds)), key=lambda j: rounds[j][1] or 0.0)
    keep = sorted(by_load[:repeats])
    return [rounds[j][0] for j in keep], len(rounds) - len(keep)


# ---- jaxseek side -------------------------------------------------------------------------------------------
def prefill_ttft(engine: Engine, prompt: list[int]) -> dict:
    """Seconds from `add_request` to the first token of a max_tokens=1 request."""
    out = engine.generate([prompt], greedy(1))[0]
    if len(out.token_ids) != 1 or out.time_to_first_token is None:
        raise RuntimeError(f"prefill request returned {out.token_ids} (ttft {out.time_to_first_token})")
    return {"ttft_s": out.time_to_first_token, "tps": len(prompt) / out.time_to_first_token}


def decode_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Tokens/s after every row's first token until the first row finishes, max TTFT, generated tokens."""
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
    return {"tps": (window_end[1] - window_start[1]) / (window_end[0] - window_start[0]),
            "ttft_s": window_start[0] - start, "tokens": tokens}


def host_overhead(engine: Engine, prompts: list[list[int]], steps: int, rounds: int) -> dict:
    """Wall vs device-bound time per decode step with len(prompts) requests in steady decode; `rounds` rounds
    of (S engine steps, S back-to-back calls of the captured step), medians over rounds."""
    batch = len(prompts)
    ids = [engine.add_request(p, greedy(2 * rounds * steps + steps + 64)) for p in prompts]
    requests = [engine.requests[i] for i in ids]
    while min(len(r.output) for r in requests) < 1:
        engine.step()
    for _ in range(3):  # steady state: every step is one decode step of all rows
        engine.step()

    bucket = (next(r for r in engine.decode_rows if r >= batch), 1, 1, engine.context_pages[0])  # short prompts
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
    step_batch = jax.device_put(captured[0])
    params = engine.weights

    def device_loop(n: int) -> float:
        cache = jax.tree.map(lambda x: x.copy(), engine.cache)  # private copy: the engine's cache is untouched
        jax.block_until_ready(cache)
        t = time.perf_counter()
        for _ in range(n):
            out, cache = executable(params, cache, step_batch)
        jax.block_until_ready((out, cache))
        return (time.perf_counter() - t) / n

    device_loop(2)  # warm-up

    def one_round(_):
        before = sum(len(r.output) for r in requests)
        since = METER.snapshot() if METER else None
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t) / steps
        produced = sum(len(r.output) for r in requests) - before
        if produced != batch * steps:
            raise RuntimeError(f"{steps} steady decode steps produced {produced} tokens, expected {batch * steps}")
        device = device_loop(steps)
        load = METER.foreign_cores(since) if METER else None
        return (wall, device, load), load

    kept, dropped = clean_rounds(one_round, rounds)
    walls, devices, loads = zip(*kept)
    for i in ids:
        engine.cancel(i)
    while engine.has_work:
        engine.step()
    wall, device = statistics.median(walls), statistics.median(devices)
    host = max(0.0, wall - device)
    return {"wall_ms_per_step": wall * 1e3, "device_ms_per_step": device * 1e3, "host_ms_per_step": host * 1e3,
            "host_overhead_fraction": host / wall, "bucket": list(bucket),
            "rounds_wall_ms": [w * 1e3 for w in walls], "rounds_device_ms": [d * 1e3 for d in devices],
            "background_load_cores": [None if x is None else round(x, 2) for x in loads], "dropped_rounds": dropped}


# ---- HF side ------------------------------------------------------------------------------------------------
def oracle_python() -> str:
    configured = os.environ.get("JAXSEEK_ORACLE_PYTHON")
    path = configured or str(REPO_ROOT / ".venv-oracle" / "bin" / "python")
    if not Path(path).exists():
        raise RuntimeError(f"no oracle interpreter at {path} (scripts/setup_oracle.sh or $JAXSEEK_ORACLE_PYTHON)")
    return path


class HFServer:
    """`scripts/hf_bench.py --serve` in the oracle interpreter: one timed HF run per `call`."""

    def __init__(self, ckpt: Path, prompts_file: Path, threads: int, timeout: float):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", PYTHONNOUSERSITE="1")
        self.command = [oracle_python(), str(HF_SCRIPT), "--model", str(ckpt), "--prompts", str(prompts_file),
                        "--threads", str(threads), "--serve"]
        t = time.perf_counter()
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        if METER:
            METER.child_pid = self.proc.pid
        self.watchdog = threading.Timer(timeout, self.proc.kill)
        self.watchdog.daemon = True
        self.watchdog.start()
        self.info = self._read()
        self.info["hf_load_s"] = time.perf_counter() - t

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{' '.join(self.command)} exited with status {self.proc.wait()} (stderr above)")
        return json.loads(line)

    def call(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.watchdog.cancel()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if METER:
            METER.child_pid = None


# ---- interleaved measurement --------------------------------------------------------------------------------
def measure(name: str, ours, theirs, repeats: int, r: dict, errors: dict) -> None:
    """One untimed warm-up per side, then `repeats` rounds of one run per side, alternating which side goes
    first, so both see the same background load (rounds under background load are re-run, see `clean_rounds`).
    Fills r[f"jaxseek_{name}"], r[f"hf_{name}"] (run lists) and r[f"dropped_rounds_{name}"]."""
    sides = {"jaxseek": ours, "hf": theirs}
    for side, fn in sides.items():
        if fn is not None and side not in errors:
            try:
                fn()
            except Exception:
                errors[side] = traceback.format_exc()
                log(f"{side} failed during {name}:\n{errors[side]}")

    def one_round(i):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        done = {}
        for side in order:
            if sides[side] is None or side in errors:
                continue
            try:
                value, load = metered(sides[side])
            except Exception:
                errors[side] = traceback.format_exc()
                log(f"{side} failed during {name}:\n{errors[side]}")
                continue
            done[side] = {**value, "background_load_cores": load}
        loads = [v["background_load_cores"] for v in done.values() if v["background_load_cores"] is not None]
        return done, max(loads) if loads else None

    kept, dropped = clean_rounds(one_round, repeats)
    r[f"dropped_rounds_{name}"] = dropped
    runs = {side: [d[side] for d in kept if side in d] for side in sides}
    for side, values in runs.items():
        if values:
            r[f"{side}_{name}"] = values
            loads = [v["background_load_cores"] for v in values]
            log(f"{name} {side}: tok/s {[round(v['tps'], 2) for v in values]}, background load (cores) "
                f"{[None if x is None else round(x, 2) for x in loads]}")


def median_of(runs: list[dict] | None, key: str) -> float | None:
    return statistics.median(v[key] for v in runs) if runs else None


def run_all(ckpt: Path, prompts: dict, prompts_file: Path, threads: int, args) -> dict:
    r: dict = {}
    errors: dict[str, str] = {}
    engine = hf = None
    try:
        t = time.perf_counter()
        model = load_model(ckpt, weights="float32")
        r["jaxseek_load_s"] = time.perf_counter() - t
        t = time.perf_counter()
        engine = Engine(model, ENGINE)
        r["jaxseek_engine_init_s"] = time.perf_counter() - t
        t = time.perf_counter()
        engine.warmup()
        r["jaxseek_compile_s"] = time.perf_counter() - t
        r["jaxseek_buckets"] = [list(b) for b in engine.buckets()]
        log(f"compiled {len(engine.buckets())} buckets in {r['jaxseek_compile_s']:.1f} s")
    except Exception:
        errors["jaxseek"] = traceback.format_exc()
        log(f"jaxseek failed to start:\n{errors['jaxseek']}")
    if not args.skip_hf:
        try:
            hf = HFServer(ckpt, prompts_file, threads, args.hf_timeout)
            r.update({k: v for k, v in hf.info.items() if k != "ready"})
        except Exception:
            errors["hf"] = traceback.format_exc()
            log(f"hf failed to start:\n{errors['hf']}")
    ok = lambda side, obj: obj if side not in errors and obj is not None else None  # noqa: E731

    products = StepProducts(engine.model) if ok("jaxseek", engine) else None
    try:
        e, h = ok("jaxseek", engine), ok("hf", hf)
        measure("prefill", e and (lambda: prefill_ttft(e, prompts["prefill"])),
                h and (lambda: h.call(op="prefill")), args.repeats, r, errors)
        for batch in (1, 16):
            e, h = ok("jaxseek", engine), ok("hf", hf)
            rows = prompts["decode"][:batch]
            measure(f"decode_b{batch}", e and (lambda: decode_run(e, rows, args.decode_tokens)
                                               | roofline.measure(e.model_config, (batch,))
                                               | {"products_s": products.seconds(batch)}),
                    h and (lambda: h.call(op="decode", batch=batch, new_tokens=args.decode_tokens)),
                    args.repeats, r, errors)
    finally:
        if hf is not None:
            hf.close()
    if ok("jaxseek", engine):
        for batch in (1, 16):  # jaxseek only
            try:
                h = host_overhead(engine, prompts["decode"][:batch], args.host_steps, args.repeats)
            except Exception:
                errors["jaxseek"] = traceback.format_exc()
                log(f"jaxseek failed during host overhead:\n{errors['jaxseek']}")
                break
            suffix = "" if batch == 16 else "_b1"
            r.update({f"{key}{suffix}": value for key, value in h.items()})
            log(f"host overhead b{batch}: {h}")
        r["jaxseek_engine_stats"] = dict(engine.stats)
    r.update({f"{side}_error": tb for side, tb in errors.items()})
    return r


# ---- roofline -----------------------------------------------------------------------------------------------
def roofline_figures(config, result: dict, context: int) -> dict:
    """This machine's roofline (GEMM peak at each decode step's shapes, streaming read bandwidth), the FLOPs and
    bytes a decode step of 1 and 16 rows needs at position `context` (`model.step_cost`), and the fraction of
    that roofline the measured decode reaches: (least time a step can take) / (measured time per step). Each
    round in `result["roofline_rounds_b{rows}"]` (tps and the roofline measured right after it) gives one
    fraction, and `roofline_fraction_b{rows}` is their median; without rounds, the median decode over the
    measurement made here (also reported as `roofline_fraction_end_b{rows}`). Rounds that also timed the step's
    weight products alone (`products_s`) give their median time, `products_ceiling_fraction_b{rows}` (roofline
    over products) and `products_share_b{rows}` (products over the time per step), each the median over rounds."""
    measured = roofline.measure(config, (1, 16))
    out = dict(measured)
    for rows in (1, 16):
        cost = decode_step_cost(config, rows, context)
        ideal = roofline_seconds(cost, measured[f"gemm_flops_per_s_b{rows}"], measured["read_bytes_per_s"])
        tps = result.get(f"jaxseek_decode_tps_b{rows}")
        end = ideal * tps / rows if tps else None
        runs = result.get(f"roofline_rounds_b{rows}") or ()
        rounds = [(roofline_seconds(cost, r[f"gemm_flops_per_s_b{rows}"], r["read_bytes_per_s"]), r["tps"])
                  for r in runs]
        products = [(i, r["products_s"], r["tps"]) for (i, _), r in zip(rounds, runs) if r.get("products_s")]
        out |= {f"step_flops_b{rows}": cost["flops"], f"step_bytes_b{rows}": cost["bytes"],
                f"roofline_ms_per_step_b{rows}": statistics.median(i for i, _ in rounds) * 1e3 if rounds
                else ideal * 1e3,
                f"roofline_fraction_end_b{rows}": end,
                f"roofline_fraction_b{rows}": statistics.median(i * t / rows for i, t in rounds) if rounds else end,
                f"products_ms_per_step_b{rows}": statistics.median(p for _, p, _ in products) * 1e3
                if products else None,
                f"products_ceiling_fraction_b{rows}": statistics.median(i / p for i, p, _ in products)
                if products else None,
                f"products_share_b{rows}": statistics.median(p * t / rows for _, p, t in products)
                if products else None}
    return out


# ---- main ---------------------------------------------------------------------------------------------------
def code_state() -> dict:
    """The commit measured and the files that differ from it (the working tree is what ran)."""
    def git(*a):
        proc = subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
        return proc.stdout.rstrip("\n") if proc.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"),
            "modified_files": None if status is None else [line[3:] for line in status.splitlines() if line]}


def ratio(r: dict, ours: str, theirs: str) -> float | None:
    return r[ours] / r[theirs] if r.get(ours) and r.get(theirs) else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 repeats, 16 new tokens, 16 host-overhead steps")
    parser.add_argument("--repeats", type=int, help="timed runs per figure (default 5, quick 3)")
    parser.add_argument("--decode-tokens", type=int, help="new tokens per decode request (default 64, quick 16)")
    parser.add_argument("--host-steps", type=int, help="steps timed for host overhead (default 64, quick 16)")
    parser.add_argument("--preset", default="small", help="model preset (small; tiny for a smoke test)")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--prompt-seed", type=int, default=1234)
    parser.add_argument("--hf-timeout", type=float, default=1800.0,
                        help="seconds the HF subprocess may live (killed after)")
    parser.add_argument("--wait-idle", type=float, default=300.0,
                        help="seconds in all to wait for a busy machine to go idle before timed rounds")
    parser.add_argument("--skip-hf", action="store_true", help="jaxseek figures only")
    parser.add_argument("--out", type=Path, help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.decode_tokens = args.decode_tokens or (16 if args.quick else 64)
    args.host_steps = args.host_steps or (16 if args.quick else 64)
    if args.repeats < 3:
        parser.error("--repeats must be >= 3 (figures are medians)")
    if args.decode_tokens < 16:
        parser.error("--decode-tokens must be >= 16 (at batch 16 the engine admits prompts over 8 steps)")

    t_start = time.perf_counter()
    WAIT_IDLE.budget_s = args.wait_idle
    config = preset(args.preset)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rng = np.random.default_rng(args.prompt_seed)
    prompts = {"prefill": rng.integers(2, config.vocab_size, args.prefill_len).tolist(),
               "decode": rng.integers(2, config.vocab_size, (MAX_SLOTS, args.decode_prompt_len)).tolist()}
    result: dict = {"benchmark": f"jaxseek Engine vs transformers generate(), {args.preset} preset, fp32, CPU"}

    with tempfile.TemporaryDirectory(prefix="jaxseek-bench-") as tmp:
        ckpt, prompts_file = Path(tmp) / "small", Path(tmp) / "prompts.json"
        t = time.perf_counter()
        model = init_model(config, seed=0)
        num_params = int(sum(x.size for x in jax.tree.leaves(model.params)))
        save_checkpoint(model, ckpt)
        del model
        result["checkpoint_s"] = time.perf_counter() - t
        prompts_file.write_text(json.dumps(prompts))

        result.update(run_all(ckpt, prompts, prompts_file, threads, args))

    loads, paired = {}, {}
    for name in ("prefill", "decode_b1", "decode_b16"):
        runs = {side: result.pop(f"{side}_{name}", None) for side in ("jaxseek", "hf")}
        suffix = "" if name == "prefill" else name[len("decode"):]
        kind = "prefill" if name == "prefill" else "decode"
        for side, values in runs.items():
            result[f"{side}_{kind}_tps{suffix}"] = median_of(values, "tps")
            result[f"{side}_{kind}_ttft_s{suffix}"] = median_of(values, "ttft_s")
            result[f"{side}_{kind}_runs_tps{suffix}"] = [v["tps"] for v in values] if values else None
            if side == "jaxseek" and kind == "decode" and values:
                result[f"roofline_rounds{suffix}"] = [
                    {k: v[k] for k in ("tps", f"gemm_flops_per_s{suffix}", "read_bytes_per_s", "products_s")}
                    for v in values]
            loads[f"{side}_{name}"] = [None if v["background_load_cores"] is None else
                                       round(v["background_load_cores"], 2) for v in values or ()]
        if runs["jaxseek"] and runs["hf"]:
            paired[name] = statistics.median(a["tps"] / b["tps"] for a, b in zip(runs["jaxseek"], runs["hf"]))
            if kind == "decode":
                ours, theirs = runs["jaxseek"][-1]["tokens"], runs["hf"][-1]["tokens"]
                result[f"greedy_match{suffix}"] = sum(x == y for x, y in zip(ours, theirs)) / len(ours)
        elif kind == "decode":
            result[f"greedy_match{suffix}"] = None
    result["decode_speedup_b1"] = ratio(result, "jaxseek_decode_tps_b1", "hf_decode_tps_b1")
    result["decode_speedup_b16"] = ratio(result, "jaxseek_decode_tps_b16", "hf_decode_tps_b16")
    result["prefill_speedup"] = ratio(result, "jaxseek_prefill_tps", "hf_prefill_tps")
    result["speedups_median_of_paired_rounds"] = paired
    log("measuring this machine's roofline")
    result.update(roofline_figures(config, result, args.decode_prompt_len + args.decode_tokens // 2))
    for suffix in ("", "_b1"):
        if f"background_load_cores{suffix}" in result:
            loads[f"host_overhead{suffix or '_b16'}"] = result.pop(f"background_load_cores{suffix}")
    result["background_load_cores"] = loads
    result["waited_for_idle_s"] = WAIT_IDLE.waited_s
    busy = {k: v for k, v in loads.items()
            if max((x for x in (v if isinstance(v, list) else [v]) if x is not None), default=0.0) > BUSY_CORES}
    warnings = []
    if busy:
        warnings.append(f"other processes used more than {BUSY_CORES} of {threads} cores during {sorted(busy)} "
                        f"(background_load_cores): those figures describe a busy machine, not this code")
    for key in ("jaxseek_error", "hf_error"):
        if key in result:
            warnings.append(f"{key.split('_')[0]} failed: see {key}")
    for key in ("greedy_match_b1", "greedy_match_b16"):
        if result.get(key) is not None and result[key] < 1:
            warnings.append(f"{key}={result[key]:.3f}: the two sides' greedy tokens differ (same weights, fp32)")
    result["warnings"] = warnings

    import flax

    result["config"] = {"preset": args.preset, "num_params": num_params, "dtype": "float32", "seed": 0,
                        **dataclasses.asdict(config)}
    result["machine"] = {
        "cpu_count": os.cpu_count(), "cpus_usable": threads, "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
        "jax_version": jax.__version__, "jaxlib_version": getattr(jax.lib, "__version__", None) or
        __import__("jaxlib").__version__, "flax_version": flax.__version__, "numpy_version": np.__version__,
        "jax_devices": [str(d) for d in jax.devices()], "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_compilation_cache_dir": jax.config.jax_compilation_cache_dir,
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
        "threads_both_sides": threads, "hf_ran": not args.skip_hf, "wait_idle_budget_s": args.wait_idle,
        "busy_threshold_cores": BUSY_CORES,
    }
    result["code"] = code_state()
    for key in ("hf_decode_timing", "hf_prefill_timing"):
        result["settings"][key] = result.pop(key, None)
    result["total_s"] = time.perf_counter() - t_start
    first = [k for k in HEADLINE if k in result]
    line = json_line({**{k: result[k] for k in first}, **{k: v for k, v in result.items() if k not in first}})
    if args.out:
        args.out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
