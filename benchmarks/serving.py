"""The serving benchmark: a live `jaxseek serve` (the bundled model unless --base-url names a running server,
started as a subprocess on a free 127.0.0.1 port, answered once /health does) under load, one JSON line out.

Two sources of load:
- by default the third-party tool inference-perf 0.7.0 (`benchmarks/load_tool.py`; installed in its own venv),
  one stage per `--concurrency` (1, 4, 16 by default) of streaming /v1/completions requests with fixed prompt and
  output lengths; the line holds, per concurrency, the tool's own figures read from its result files: TTFT, ITL
  and TPOT p50 / p90 / p99, output tokens/s, requests completed / failed, and the tool's name and version.
- `--loadgen`: the project's own load generator (serving/api/loadgen.py), kept because the tool sends no faults:
  Poisson arrivals under a concurrency cap, streaming chat clients of which some hang up mid-stream and some send
  bad requests, with vLLM bench-serve's figures and the checks (bad requests refused with a 4xx, no leaked KV
  pages, server up); docs/benchmarks.md's earlier "Serving" figures come from it.

Before the measured load a warm-up (not measured; with the tool, a stage per concurrency) compiles what the load
needs, and the benchmark waits until the server's process is idle (its background compilation done) before measuring.

    jaxseek bench serving                                   # the tool at concurrencies 1, 4, 16
    jaxseek bench serving --tool-bin .venv-bench/bin/inference-perf --concurrency 1 4
    jaxseek bench serving --loadgen                         # the own load generator with faults

Install the tool: `python3.12 -m venv .venv-bench && .venv-bench/bin/pip install inference-perf==0.7.0` (the
`bench` extra names it). Exit status 1 if a request failed (or, with --loadgen, a bad request was not refused
with a 4xx, pages leaked or the server went down), 2 if the benchmark could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks import load_tool
from benchmarks.bench_json import json_line

PROMPTS = ["Who goes there?", "Speak, what news from Venice?", "What light through yonder window breaks?",
           "Tell me of the king.", "Is this a dagger which I see before me?", "Where is the duke?"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_server(args, work_dir: Path, timeout: float) -> tuple[str, subprocess.Popen]:
    """`jaxseek serve` with the bundled model on a free 127.0.0.1 port, in a subprocess (its log in work_dir);
    returns (base url, process) once /health answers 200. Raises RuntimeError if it exits or times out first."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxseek.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", args.model, "--max-num-seqs", str(args.max_slots),
           "--max-model-len", str(args.max_len), "--log-level", "warning"]
    if args.prefill_chunk:
        cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    env = {**os.environ, **({"JAXSEEK_API_KEY": args.api_key} if args.api_key else {})}
    log = work_dir / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, [proc], timeout, lambda: _tail(log), poll=1.0)
    except RuntimeError:
        stop_server(proc)
        raise
    return base_url, proc


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float | None, logs: Callable[[], str],
                 poll: float = 0.5) -> None:
    """Until `url`/health answers 200 (a `jaxseek serve` up), asking every `poll` seconds. Raises RuntimeError,
    with `logs()`, if one of `procs` exits first or `timeout` seconds pass (None: no limit)."""
    end = None if timeout is None else time.monotonic() + timeout
    while end is None or time.monotonic() < end:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"jaxseek serve exited ({[p.poll() for p in procs]}):\n{logs()}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise RuntimeError(f"jaxseek serve did not answer /health within {timeout:.0f} s:\n{logs()}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def wait_idle(pid: int, cores: float = 0.1, window: float = 3.0, timeout: float = 900.0) -> float:
    """Wait until process `pid` uses under `cores` CPU cores over `window` seconds (a server whose background
    compilation has finished); returns the seconds waited. Linux only (elsewhere returns at once)."""
    start = time.monotonic()
    before = _cpu_seconds(pid)
    while before is not None and time.monotonic() - start < timeout:
        time.sleep(window)
        after = _cpu_seconds(pid)
        if after is None or (after - before) / window < cores:
            break
        before = after
    return time.monotonic() - start


def tool_executable(args) -> Path:
    """The load tool's executable; raises FileNotFoundError, saying how to install it, when there is none."""
    executable = load_tool.find_executable(args.tool_bin)
    if executable is None:
        raise FileNotFoundError(f"{load_tool.NAME} not found: give --tool-bin or ${load_tool.ENV}, or install it "
                                f"(python3.12 -m venv .venv-bench && .venv-bench/bin/pip install "
                                f"inference-perf==0.7.0); --loadgen runs the own load generator instead")
    return executable


def run_tool(args, executable: Path, base_url: str, pid: int | None, work_dir: Path) -> tuple[dict, int]:
    """The tool's warm-up run, then one run with a stage per concurrency; returns (the JSON line's dict, status)."""
    from model.checkpoint import BUNDLED

    tokenizer = load_tool.tokenizer_dir(BUNDLED / "tokenizer.json", work_dir / "tokenizer")
    stages = [(c, max(args.requests_per_stream * c, args.min_requests)) for c in args.concurrency]

    def tool_run(name: str, runs: list[tuple[int, int]]) -> dict[int, dict]:
        cfg = load_tool.config(base_url, args.model, tokenizer, work_dir / name / "reports", runs,
                               prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                               api_key=args.api_key)
        done = load_tool.run(executable, cfg, work_dir / name, timeout=args.tool_timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{load_tool.NAME} exited with {done.returncode}:\n"
                               f"{_tail(work_dir / name / (load_tool.NAME + '.log'))}")
        return load_tool.read_stages(work_dir / name / "reports")

    started = time.perf_counter()
    warmup_stages = [(c, args.warmup_requests or 2 * c) for c in args.concurrency]
    warmup = tool_run("warmup", warmup_stages) if args.warmup_requests != 0 else {}
    warmup_s = time.perf_counter() - started
    idle_s = wait_idle(pid) if pid is not None else 0.0
    load_before = os.getloadavg()[0]
    measured = tool_run("measured", stages)
    result = {
        "benchmark": "serving", "tool": load_tool.NAME, "tool_version": load_tool.version(executable),
        "endpoint": "/v1/completions", "streaming": True, "ignore_eos": True,
        "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
        "server": {"base_url": base_url, "started": pid is not None, "max_num_seqs": args.max_slots,
                   "max_model_len": args.max_len},
        "warmup": {"requests": sum(s["completed"] + s["failed"] for s in warmup.values()), "seconds": warmup_s,
                   "idle_wait_s": idle_s},
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "by_concurrency": [],
        "report_dir": work_dir / "measured" / "reports",
    }
    status = 0
    for index, (c, n) in enumerate(stages):
        figures = measured.get(index)
        if figures is None:
            figures, status = {"concurrency": c, "error": "the tool wrote no report for this stage"}, 1
        elif figures["failed"] or figures["completed"] != n:
            status = 1
        result["by_concurrency"].append({"requests": n, **figures, "concurrency": c})
    return result, status


def run_loadgen(args, base_url: str, pid: int | None) -> tuple[dict, int]:
    """The own load generator (serving/api/loadgen.py), after a warm-up without faults; returns (summary, status)."""
    from serving.api.loadgen import run_load

    common = dict(max_tokens=args.max_tokens, max_len=args.max_len, api_key=args.api_key)
    if args.warmup_requests != 0:
        asyncio.run(run_load(base_url, args.model, PROMPTS, num_requests=args.warmup_requests or args.max_slots,
                             max_concurrency=args.max_slots, seed=args.seed + 1, **common))
        if pid is not None:
            wait_idle(pid)
    summary, _ = asyncio.run(run_load(
        base_url, args.model, PROMPTS, num_requests=args.num_requests, max_concurrency=args.max_concurrency,
        request_rate=args.request_rate, disconnect_fraction=args.disconnect_fraction, bad_fraction=args.bad_fraction,
        seed=args.seed, **common))
    ok = (summary["failed"] == 0 and summary["bad_requests_refused_4xx"] == summary["bad_requests"]
          and summary["leaked_pages"] == 0 and summary["server_up"])
    return {"benchmark": "serving", "tool": "serving.api.loadgen", **summary}, 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="a running server on this machine (default: start the bundled model's)")
    p.add_argument("--model", default="jaxseek-bundled", help="the served model name")
    p.add_argument("--api-key")
    p.add_argument("--warmup-requests", type=int, help="warm-up requests before the measured load, per concurrency "
                                                       "(default: twice it; --loadgen: --max-slots; 0: none)")
    p.add_argument("--work-dir", type=Path, help="where the server's log and the tool's config, log and result "
                                                 "files go (default: a new temporary directory, kept)")
    t = p.add_argument_group("the load tool (default)")
    t.add_argument("--tool-bin", help=f"the {load_tool.NAME} executable (default: ${load_tool.ENV}, "
                                      f".venv-bench/bin/{load_tool.NAME}, the PATH)")
    t.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    t.add_argument("--requests-per-stream", type=int, default=8, help="requests per stage: this times its "
                                                                      "concurrency (at least --min-requests)")
    t.add_argument("--min-requests", type=int, default=16)
    t.add_argument("--prompt-tokens", type=int, default=64)
    t.add_argument("--output-tokens", type=int, default=32)
    t.add_argument("--tool-timeout", type=float, default=1800.0, help="seconds for one run of the tool")
    g = p.add_argument_group("the own load generator (--loadgen)")
    g.add_argument("--loadgen", action="store_true", help="serving/api/loadgen.py's load with faults instead of the "
                                                          "tool")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--max-concurrency", type=int, default=64)
    g.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all "
                                                                           "at once)")
    g.add_argument("--disconnect-fraction", type=float, default=0.125)
    g.add_argument("--bad-fraction", type=float, default=0.125)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("the started server (without --base-url)")
    s.add_argument("--max-slots", type=int, help="--max-num-seqs (default: the top --concurrency; 8 with "
                                                 "--loadgen)")
    s.add_argument("--max-len", type=int, help="--max-model-len (default 1024; 256 with --loadgen)")
    s.add_argument("--prefill-chunk", type=int, help="--prefill-chunk (default: serve's; 32 with --loadgen)")
    s.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds for /health to answer")
    args = p.parse_args(argv)
    if args.loadgen:
        args.max_slots, args.max_len = args.max_slots or 8, args.max_len or 256
        args.prefill_chunk = args.prefill_chunk or 32
    else:
        args.max_slots, args.max_len = args.max_slots or max(args.concurrency), args.max_len or 1024
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="jaxseek-bench-serving-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    proc = None
    try:
        executable = None if args.loadgen else tool_executable(args)
        base_url = args.base_url
        if base_url is None:
            base_url, proc = start_server(args, work_dir, args.startup_timeout)
        pid = proc.pid if proc is not None else None
        result, status = (run_loadgen(args, base_url, pid) if args.loadgen
                          else run_tool(args, executable, base_url, pid, work_dir))
    except (ValueError, RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"bench serving: error: {e}", file=sys.stderr)
        return 2
    finally:
        if proc is not None:
            stop_server(proc)
    print(json_line(result))
    return status


if __name__ == "__main__":
    sys.exit(main())
