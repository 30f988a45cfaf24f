"""The engine over `jax.distributed` (serving.core.lockstep): two processes x 4 emulated CPU devices (gloo), one
dp=8,ep=2 mesh over their 8 devices, give what one process x 8 devices gives, token for token: `jaxseek generate`
(only the leader writes its output) and `jaxseek serve` (requests to the leader's port, speculation and the prefix
cache on). A process killed mid-stream or mid-batch: the leader fails each request in flight with an error naming
the lost process and exits non-zero, in bounded time; a killed leader takes the others down. Each process runs the
bundled model from the command line, as a user starts one per host."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from jaxseek.flags import ProcessJob, add_process_args, process_job
from serving.base.host_choices import HostChoices
from benchmarks.serving import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
MODEL = "jaxseek-bundled"
LONG = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. Arise, "
        "fair sun, and kill the envious moon, who is already sick and pale with grief. That thou her maid art far "
        "more fair than she. Be not her maid, since she is envious.")  # 75 tokens: over one 64-token page
BODIES = [{"prompt": LONG, "max_tokens": 8, "temperature": 0},
          {"prompt": LONG, "max_tokens": 8, "temperature": 0.8, "seed": 11},
          {"prompt": "JULIET:", "max_tokens": 8, "temperature": 0.8, "seed": 5},
          {"prompt": "Thou", "max_tokens": 8, "temperature": 0}]
# one engine for every run: 8 slots (one per attention rank), fixed speculation (its tokens do not depend on
# timing), the prefix cache on, EPLB rebalancing every 4 steps
ENGINE = ["--max-num-seqs", "8", "--max-len", "96", "--prefill-chunk", "8", "--mesh", "dp=8,ep=2",
          "--speculation", "fixed", "--enable-prefix-caching", "--redundant-experts", "2", "--eplb-every", "4"]
WAIT = 420  # seconds a job may take on 2 shared cores, compiling included


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(JAX_NUM_CPU_DEVICES=str(devices), JAX_DEFAULT_MATMUL_PRECISION="highest",
               XLA_FLAGS="--xla_backend_optimization_level=0")  # tiny programs: compile time is all that counts
    return env


def _jaxseek(args: list[str], devices: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxseek.cli", *args], cwd=ROOT, env=_env(devices),
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _job(args: list[str], tmp_path: Path, name: str) -> list[subprocess.Popen]:
    """Two processes of one job, process 0 first."""
    flags = ["--num-processes", "2", "--coordinator", f"localhost:{free_port()}"]
    return [_jaxseek([*args, *flags, "--process-id", str(i)], 4, tmp_path / f"{name}{i}.log") for i in range(2)]


def _finish(procs: list[subprocess.Popen], tmp_path: Path, names: list[str], timeout: float = WAIT) -> list[int]:
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a process did not finish:\n{_logs(tmp_path, names)}")
    return [p.returncode for p in procs]


def _logs(tmp_path: Path, names: list[str]) -> str:
    return "\n".join(f"--- {n}\n" + "\n".join(line for line in (tmp_path / f"{n}.log").read_text().splitlines()
                                              if "Gloo" not in line)[-3000:] for n in names)


def _wait_up(url: str, procs: list[subprocess.Popen], tmp_path: Path, names: list[str]) -> None:
    wait_healthy(url, procs, WAIT, lambda: _logs(tmp_path, names))


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


@pytest.fixture(scope="module")
def xla(tmp_path_factory) -> str:
    """The jobs' persistent compile cache (each job keeps its entries in a subdirectory of its own)."""
    return str(tmp_path_factory.mktemp("xla"))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process x 8 devices: `jaxseek generate` over the bodies, as the job's reference."""
    tmp = tmp_path_factory.mktemp("single")
    batch = tmp / "batch.jsonl"
    batch.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                         "body": {"model": MODEL, **body}}) + "\n" for i, body in enumerate(BODIES)))
    out = tmp / "single.jsonl"
    proc = _jaxseek(["generate", "--input", str(batch), "--output", str(out), "--output-format", "jsonl-compact",
                     "--no-warmup", "--compile-cache", "off", *ENGINE], 8, tmp / "single.log")
    assert _finish([proc], tmp, ["single"]) == [0], _logs(tmp, ["single"])
    return batch, [json.loads(line) for line in out.read_text().splitlines()]


def test_generate_two_processes_equal_one(single, xla, tmp_path):
    batch, reference = single
    out, other = tmp_path / "leader.jsonl", tmp_path / "follower.jsonl"
    args = ["generate", "--input", str(batch), "--output-format", "jsonl-compact", "--no-warmup",
            "--compile-cache", xla, *ENGINE]
    procs = [_jaxseek([*args, "--output", str(path), "--nnodes", "2", "--node-rank", str(i), "--master-addr",
                       "localhost", "--master-port", str(port)], 4, tmp_path / f"gen{i}.log")
             for port in [free_port()] for i, path in enumerate((out, other))]  # vLLM's flag names
    names = ["gen0", "gen1"]
    assert _finish(procs, tmp_path, names) == [0, 0], _logs(tmp_path, names)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in records] == [r["token_ids"] for r in reference]
    assert [r["text"] for r in records] == [r["text"] for r in reference]
    assert not other.exists()  # only the leader writes the output
    assert len({tuple(r["token_ids"]) for r in reference}) == len(BODIES)  # the bodies ask different things


def test_serve_two_processes_equal_one(single, xla, tmp_path):
    _, reference = single
    port = free_port()
    procs = _job(["serve", "--port", str(port), "--compile-cache", xla, *ENGINE], tmp_path, "serve")
    names = ["serve0", "serve1"]
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, procs, tmp_path, names)
        answers = [httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=WAIT).json()
                   for body in BODIES]
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGINT)  # the leader stops; the other process exits with it
    assert _finish(procs, tmp_path, names, 60) == [0, 0], _logs(tmp_path, names)
    assert [a["choices"][0]["text"] for a in answers] == [r["text"] for r in reference], answers
    # every prompt went through the prefix cache's admission (the bundled V4.1 replays a prompt's last 125 tokens,
    # so these short prompts reuse no pages: which pages they could is the single-process engine's test)
    queried = [line.split()[-1] for line in metrics.splitlines() if line.startswith("jaxseek:prefix_cache_queries")]
    assert float(queried[0]) == sum(a["usage"]["prompt_tokens"] for a in answers)


def test_a_process_killed_mid_stream_fails_the_request_and_ends_the_job(xla, tmp_path):
    engine = ["--max-num-seqs", "8", "--max-len", "96", "--prefill-chunk", "8", "--mesh", "dp=8,ep=2",
              "--compile-cache", xla]
    for victim in (1, 0):  # the follower, then (a new job) the leader
        port = free_port()
        procs = _job(["serve", "--port", str(port), *engine], tmp_path, f"kill{victim}-")
        names = [f"kill{victim}-0", f"kill{victim}-1"]
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_up(url, procs, tmp_path, names)
            events = []
            with httpx.stream("POST", url + "/v1/completions", timeout=WAIT, json={
                    "model": MODEL, "prompt": "ROMEO:", "max_tokens": 80, "temperature": 0, "stream": True}) as r:
                try:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            events.append(json.loads(line[6:]))
                            if len(events) == 1:
                                procs[victim].kill()
                                killed = time.monotonic()
                except httpx.HTTPError:
                    assert victim == 0  # the leader answered the stream: killed, it cannot say why
            survivor = procs[1 - victim]
            survivor.wait(timeout=60)
            ended = time.monotonic() - killed
        finally:
            _stop(procs)
        assert survivor.returncode != 0 and ended < 40, _logs(tmp_path, names)
        assert all("error" not in e for e in events[:-1]) and len(events) < 80
        if victim == 1:  # the leader failed the request in flight, naming the lost process
            assert "process 1 of the 2-process job stopped" in events[-1]["error"]["message"], events[-1]
            assert "process 1 of the 2-process job stopped" in (tmp_path / "kill1-0.log").read_text()


def test_generate_with_a_process_lost_records_why_for_each_request_not_done(xla, tmp_path):
    """`jaxseek generate` whose follower dies mid-batch: the finished request keeps its result, the running one
    gets an error record naming the lost process, and the leader exits 1. The job decodes with DSpark, whose cost
    table the leader times (its profile runs before the first decode step) and every process uses."""
    batch, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch.write_text("".join(json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": {
        "model": MODEL, "prompt": "ROMEO:", "max_tokens": n, "temperature": 0, "ignore_eos": True}}) + "\n"
        for i, n in enumerate((2, 88))))
    procs = _job(["generate", "--input", str(batch), "--output", str(out), "--max-num-seqs", "8", "--max-len", "96",
                  "--prefill-chunk", "8", "--mesh", "dp=8,ep=2", "--speculation", "dspark", "--no-warmup",
                  "--compile-cache", xla], tmp_path,
                 "lost")
    names = ["lost0", "lost1"]
    try:
        end = time.monotonic() + WAIT
        while not (out.exists() and out.read_text().count("\n") >= 1):  # the short request is done
            assert time.monotonic() < end and procs[0].poll() is None, _logs(tmp_path, names)
            time.sleep(0.2)
        procs[1].kill()
        assert procs[0].wait(timeout=60) == 1, _logs(tmp_path, names)
    finally:
        _stop(procs)
    done, lost = [json.loads(line) for line in out.read_text().splitlines()]
    assert done["error"] is None and done["response"]["body"]["usage"]["completion_tokens"] == 2
    assert lost["custom_id"] == "r1" and lost["response"]["status_code"] == 500
    assert "process 1 of the 2-process job stopped" in lost["error"]["message"], lost


@pytest.mark.parametrize("argv, job", [
    ([], None),
    (["--num-processes", "2", "--process-id", "1", "--coordinator", "h:1"], ProcessJob("h:1", 2, 1)),
    (["--nnodes", "3", "--node-rank", "2", "--master-addr", "10.0.0.1"], ProcessJob("10.0.0.1:29501", 3, 2)),
    (["--nnodes", "2", "--master-port", "7000"], ProcessJob("127.0.0.1:7000", 2, 0)),
    (["--coordinator", "h:1"], ProcessJob("h:1", 1, 0)),  # a job of one process
])
def test_process_flags(argv, job):
    import argparse

    p = argparse.ArgumentParser()
    add_process_args(p)
    assert process_job(p.parse_args(argv)) == job


@pytest.mark.parametrize("argv, message", [
    (["--num-processes", "2"], "needs --coordinator"),
    (["--process-id", "1"], "give --num-processes N"),
    (["--process-id", "1", "--coordinator", "h:1"], r"--process-id must be in \[0, 1\)"),
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "h:1"], r"--process-id must be in \[0, 2\)"),
    (["--num-processes", "2", "--coordinator", "h"], "must be HOST:PORT"),
    (["--num-processes", "2", "--coordinator", "h:1", "--master-addr", "h"], "not both"),
])
def test_process_flags_refused(argv, message):
    import argparse

    p = argparse.ArgumentParser()
    add_process_args(p)
    with pytest.raises(ValueError, match=message):
        process_job(p.parse_args(argv))


class _Channel:
    def __init__(self):
        self.messages, self.read = [], 0

    def send(self, message):
        self.messages.append(message)

    def receive(self):
        self.read += 1
        return self.messages[self.read - 1]


def test_followers_take_the_leaders_clock_and_choices():
    """The DSpark cost table's timings and the background-dependent bucket choices are the leader's everywhere."""
    channel, leader, follower = _Channel(), HostChoices(), HostChoices()
    leader.publish(channel)
    follower.follow(channel)
    taken = [leader.now(), leader.choose(lambda: (1, 8, 1, 2)), leader.now()]
    assert [follower.now(), follower.choose(lambda: (8, 8, 1, 2)), follower.now()] == taken
    assert np.diff([taken[0], taken[2]]) >= 0
    channel.send(("calls", []))
    with pytest.raises(RuntimeError, match="out of step with the leader"):
        follower.now()


def test_the_leaders_settings_check_the_mesh_and_the_model():
    """The leader refuses a mesh short of the job's devices; a process whose model differs is refused by name."""
    import dataclasses

    from model.config import preset
    from serving.base.engine_config import EngineConfig
    from serving.core.lockstep import follower_config, send_config

    channel, tiny = _Channel(), preset("tiny")
    with pytest.raises(ValueError, match="needs a --mesh over all 8 devices of the job .* got one of 4"):
        send_config(channel, EngineConfig(mesh="dp=4,ep=2"), tiny)
    assert channel.messages == []
    send_config(channel, EngineConfig(mesh="dp=8,ep=2", detokenize=str), tiny)
    assert follower_config(channel, tiny) == EngineConfig(mesh="dp=8,ep=2")  # each process brings its detokenize
    send_config(channel, EngineConfig(mesh="dp=8"), tiny)
    with pytest.raises(ValueError, match="model is not the leader's .*vocab_size"):
        follower_config(channel, dataclasses.replace(tiny, vocab_size=tiny.vocab_size * 2))
