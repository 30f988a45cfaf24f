"""Multi-process benchmark: one engine over two jax.distributed processes against one process with as many devices.

    jaxseek bench multiprocess                      # 16 prompts x 32 tokens, 3 runs of each (~6 min on 2 cores)
    jaxseek bench multiprocess --prompts 8 --runs 1

Prints ONE JSON line on stdout (progress on stderr). Never run by the test suite.

`jaxseek generate` on the bundled model with `--mesh dp=8,ep=2` and every bucket compiled first (`--warmup`), as
one process x 8 emulated CPU devices (XLA:CPU's in-process collectives), as a `jax.distributed` job of that one
process (`--num-processes 1 --coordinator ...`: every collective through gloo), and as two processes x 4 (on
localhost, gloo, the leader sending each call on the job's key-value store: `serving.core.lockstep`). For each,
the decode tokens/s over the generation loop (from the command's summary), the median of `--runs` runs;
`two_over_one` and `two_over_one_gloo` are the two-process job's against the plain process and against the
one-process job, and `tokens_equal` says whether all three wrote the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_json import json_line
from benchmarks.serving import free_port

ENGINE = ["--max-num-seqs", "16", "--max-len", "128", "--prefill-chunk", "16", "--mesh", "dp=8,ep=2", "--warmup",
          "--temperature", "0", "--output-format", "jsonl-compact"]


def log(message: str) -> None:
    print(f"bench multiprocess: {message}", file=sys.stderr, flush=True)


def run(processes: int, prompts: list[str], max_tokens: int, cache: str, out: Path, job: bool) -> float:
    """Decode tokens/s of `jaxseek generate` on `processes` processes (8 devices in all): a `jax.distributed` job
    (`job`, always for several processes: gloo collectives) or one plain process (XLA:CPU's own collectives)."""
    devices = 8 // processes
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    args = [sys.executable, "-m", "jaxseek.cli", "generate", *(a for p in prompts for a in ("--prompt", p)),
            "--max-tokens", str(max_tokens), "--compile-cache", cache, *ENGINE]
    job = ["--num-processes", str(processes), "--coordinator", f"127.0.0.1:{free_port()}"] if job else []
    procs = [subprocess.Popen([*args, *job, *(["--process-id", str(i)] if job else []), "--output",
                               str(out if i == 0 else out.with_suffix(f".{i}"))], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(processes)]
    logs = [p.communicate(timeout=1800)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a {processes}-process run failed:\n{logs[0][-2000:]}")
    match = re.search(r"throughput: prefill [\d.]+ tokens/s, decode ([\d.]+) tokens/s", logs[0])
    if match is None:
        raise RuntimeError(f"no throughput in the leader's summary:\n{logs[0][-2000:]}")
    return float(match[1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts in the batch (default 16)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each layout (default 3)")
    args = parser.parse_args(argv)
    words = ["ROMEO:", "JULIET:", "Thou art", "The king", "What light", "O, speak", "My lord", "Good night"]
    prompts = [f"{words[i % len(words)]} {i}" for i in range(args.prompts)]
    result: dict = {"load_avg_1m_start": round(os.getloadavg()[0], 2), "prompts": args.prompts,
                    "max_tokens": args.max_tokens, "mesh": "dp=8,ep=2"}
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, processes, job in (("1_process", 1, False), ("1_process_gloo", 1, True), ("2_process", 2, True)):
            out = Path(tmp) / f"{name}.jsonl"
            speeds = []
            for i in range(args.runs):
                log(f"{name}, run {i + 1} of {args.runs}")
                speeds.append(run(processes, prompts, args.max_tokens, str(Path(tmp) / "xla"), out, job))
            result[f"decode_tok_s_{name}"] = round(statistics.median(speeds), 2)
            tokens[name] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    result["two_over_one"] = round(result["decode_tok_s_2_process"] / result["decode_tok_s_1_process"], 3)
    result["two_over_one_gloo"] = round(result["decode_tok_s_2_process"] / result["decode_tok_s_1_process_gloo"], 3)
    result["tokens_equal"] = tokens["1_process"] == tokens["1_process_gloo"] == tokens["2_process"]
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json_line(result))
    return result


if __name__ == "__main__":
    main()
