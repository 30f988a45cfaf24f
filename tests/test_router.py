"""The replica router: prefix-aware / least-load choice, outputs equal to a single replica's, and a replica killed
mid-load (SIGKILL of its `jaxseek serve` process) loses no request. Replicas run the bundled model
batch-invariant, so a request's tokens do not depend on which replica or batch ran it."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from model import load_model
from serving.api.router import Router
from serving.api.server import Server, ServerConfig, serve_in_thread
from benchmarks.serving import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bundled"
TOKENS = 56  # tokens a stream of the kill test generates (prompt + tokens within max_len 96)
PROMPTS = ["ROMEO:\n", "JULIET:\n", "KING:\nWhat news?", "HAMLET:\nTo be", "First Citizen:\n", "PORTIA:\nThe quality"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Replica 0 in this process, replica 1 a `jaxseek serve` process (the one the tests kill)."""
    # the replicas compile what tests/test_server.py's engine compiles, with conftest's JAX settings, so the
    # persistent compile cache serves both modules
    env = {**os.environ, "JAXSEEK_COMPILE_CACHE": str(ROOT / ".pytest_cache" / "jax"), "JAX_NUM_CPU_DEVICES": "8",
           "JAX_DEFAULT_MATMUL_PRECISION": "highest", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    log = tmp_path_factory.mktemp("replica") / "replica1.log"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxseek.cli", "serve", "--port", str(port), "--served-model-name", MODEL,
         "--max-slots", "2", "--max-len", "96", "--prefill-chunk", "8", "--batch-invariant"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    local = Server(load_model(), ServerConfig(model_name=MODEL), max_slots=2, max_len=96, prefill_chunk=8,
                   batch_invariant=True)
    local.engine.warmup()
    url0, stop0 = serve_in_thread(local.app)
    url1, end = f"http://127.0.0.1:{port}", time.time() + 240
    while True:
        try:
            if httpx.get(url1 + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > end:
            proc.kill()
            stop0()
            pytest.fail(f"replica 1 did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    yield proc, [url0, url1]
    stop0()
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)


def completion(url: str, prompt: str, max_tokens: int = 12) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def stream_text(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, first: asyncio.Event) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = ""
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return text
            if line.startswith("data: "):
                payload = json.loads(line[6:])
                assert "error" not in payload, payload
                text += "".join(c["text"] for c in payload["choices"])
                first.set()
    raise AssertionError("the stream ended without [DONE]")


def streams_with_a_fault(url: str, prompts: list[str], busy, fault) -> list[str]:
    """Stream each prompt's completion through the router at `url`; once some stream is half sent and `busy()` (the
    replica to fail still serves some), `fault()`; the streams' texts."""
    async def run():
        firsts = [asyncio.Event() for _ in prompts]
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.ensure_future(stream_text(client, url, p, TOKENS, e)) for p, e in zip(prompts, firsts)]

            async def mid_load():
                while not (any(e.is_set() for e in firsts) and busy()):
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(mid_load(), 60)
            fault()
            return await asyncio.gather(*tasks)

    return asyncio.run(run())


def test_choice_prefers_the_prefix_owner_within_slack():
    router = Router(["http://a", "http://b"], slack=1)
    a, b = router.replicas
    body = {"messages": [{"role": "user", "content": "long shared system prompt"}]}
    assert router.choose(body) is a  # least loaded (ties: fewest served)
    a.in_flight = 1
    assert router.choose(body) is a  # the prefix owner, within the slack
    assert router.choose({"prompt": "something else"}) is b  # a new prefix: least loaded
    a.in_flight = 2
    assert router.choose(body) is b  # the owner carries too much more: the prefix moves
    router.mark_down(b)
    assert router.choose(body) is a


def test_router_outputs_equal_a_single_replica_and_spread_load(replicas):
    _, urls = replicas
    expected = [completion(urls[0], p) for p in PROMPTS]
    router = Router(urls, health_interval=0.2)
    url, stop = serve_in_thread(router.app)
    try:
        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(client.post(url + "/v1/completions", json={
                    "model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
                    for p in PROMPTS))

        got = [r.json()["choices"][0]["text"] for r in asyncio.run(run())]
        assert got == expected
        assert all(r.served > 0 for r in router.replicas)
        bad = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"})
        assert bad.status_code == 404 and "does not exist" in bad.json()["error"]["message"]
    finally:
        stop()


def test_a_replica_whose_engine_fails_mid_stream_loses_no_request(replicas):
    """A replica fails every request in flight as a multi-process job that lost a process does (`fail_all` with
    the loss, a `server_error` event in each stream): the router does not relay the error but takes each stream
    over on the other replica, whose tokens it continues exactly."""
    _, urls = replicas
    doomed = Server(load_model(), ServerConfig(model_name=MODEL), max_slots=2, max_len=96, prefill_chunk=8,
                    batch_invariant=True)
    doomed.engine.warmup()
    doomed_url, stop_doomed = serve_in_thread(doomed.app)
    prompts = PROMPTS[:4]
    expected = [completion(urls[0], p, TOKENS) for p in prompts]
    router = Router([doomed_url, urls[0]], health_interval=0.2)
    url, stop = serve_in_thread(router.app)
    try:
        got = streams_with_a_fault(url, prompts, lambda: router.replicas[0].in_flight,
                                   lambda: doomed.loop.fail_all("process 1 of the job is gone (no pulse for 5 s)"))
        assert got == expected
        assert router.retries >= 1 and not router.replicas[0].healthy
    finally:
        stop()
        stop_doomed()


def test_killed_replica_loses_no_request(replicas):
    """Replica 1 dies while it serves some streams (and others are half sent): every stream still completes."""
    proc, urls = replicas
    prompts = PROMPTS + [p + " again" for p in PROMPTS[:2]]
    expected = [completion(urls[0], p, TOKENS) for p in prompts]
    router = Router(urls, health_interval=0.2)
    url, stop = serve_in_thread(router.app)
    try:
        got = streams_with_a_fault(url, prompts, lambda: router.replicas[1].in_flight,
                                   lambda: os.kill(proc.pid, signal.SIGKILL))
        assert got == expected
        health = httpx.get(url + "/health").json()
        assert [r["healthy"] for r in health["replicas"]] == [True, False] and health["retries"] >= 1
    finally:
        stop()
