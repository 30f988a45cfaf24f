"""A bounded load generator for the OpenAI-compatible server (localhost only): Poisson arrivals under a
concurrency cap, streaming chat clients of which some hang up mid-stream and some send bad requests, with the
latency metrics of vLLM's `bench serve` (TTFT: send to the first chunk with text; TPOT: (E2E - TTFT) /
(completion tokens - 1) with the server's usage count; ITL: gaps between text chunks; E2E) and a leak check:
after the run the server's free KV pages must be back to their baseline."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from urllib.parse import urlparse

import httpx
import numpy as np

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass
class Outcome:
    """What one client saw."""

    kind: str  # "ok", "disconnect" (hung up on purpose) or a bad-request name
    status: int | None = None
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    e2e: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # the server's error message (bad requests), or what went wrong


def bad_requests(model: str, max_len: int) -> dict[str, bytes]:
    """Request bodies the server must refuse with a 4xx, by name."""
    def body(**fields) -> bytes:
        return json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], **fields}).encode()

    return {
        "malformed_json": b'{"model": "' + model.encode() + b'", "messages": [',
        "unknown_model": json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}
                                    ).encode(),
        "invalid_schema": body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "no-such-type"}}}),
        "negative_max_tokens": body(max_tokens=-5),
        "oversize_prompt": json.dumps({"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": "word " * (4 * max_len)}]}).encode(),
    }


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict, hang_up_after: int | None
                  ) -> Outcome:
    outcome = Outcome("ok" if hang_up_after is None else "disconnect")
    start = last = time.perf_counter()
    chunks = 0
    async with client.stream("POST", url, json=body, headers=headers) as r:
        outcome.status = r.status_code
        if r.status_code != 200:
            outcome.error = (await r.aread()).decode(errors="replace")
            return outcome
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.e2e = time.perf_counter() - start
                break
            payload = json.loads(line[6:])
            if "error" in payload:
                outcome.error = payload["error"]["message"]
                break
            if payload.get("usage"):
                outcome.completion_tokens = payload["usage"]["completion_tokens"]
                outcome.prompt_tokens = payload["usage"]["prompt_tokens"]
            for choice in payload.get("choices", []):
                outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                if choice["delta"].get("content"):
                    now = time.perf_counter()
                    if outcome.ttft is None:
                        outcome.ttft = now - start
                    else:
                        outcome.itl.append(now - last)
                    last = now
                    chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                break  # leaving the block closes the connection mid-stream
    if outcome.kind == "ok" and outcome.e2e is None and outcome.error is None:
        outcome.error = "the stream ended without [DONE]"
    return outcome


async def _bad(client: httpx.AsyncClient, url: str, name: str, raw: bytes, headers: dict) -> Outcome:
    r = await client.post(url, content=raw, headers={**headers, "Content-Type": "application/json"})
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    return Outcome(name, status=r.status_code, error=message)


async def _pages(client: httpx.AsyncClient, base_url: str) -> dict:
    return (await client.get(base_url + "/health")).json()


async def run_load(base_url: str, model: str, prompts: list[str], *, num_requests: int, max_concurrency: int,
                   request_rate: float = float("inf"), disconnect_fraction: float = 0.0, bad_fraction: float = 0.0,
                   max_tokens: int = 16, max_len: int = 1024, api_key: str | None = None, seed: int = 0,
                   idle_timeout: float = 60.0) -> tuple[dict, list[Outcome]]:
    """Run the load; returns (summary, outcomes). Raises ValueError for a server that is not on this machine."""
    if urlparse(base_url).hostname not in LOCAL_HOSTS:
        raise ValueError(f"the load generator only targets this machine (127.0.0.1 / localhost), not {base_url}")
    if not prompts or num_requests < 1 or max_concurrency < 1:
        raise ValueError("need prompts, num_requests >= 1 and max_concurrency >= 1")
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url + "/v1/chat/completions"
    bad = bad_requests(model, max_len)
    limits = httpx.Limits(max_connections=max_concurrency + 4, max_keepalive_connections=max_concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        baseline = await _pages(client, base_url)
        gate = asyncio.Semaphore(max_concurrency)

        async def one(i: int) -> Outcome:
            draw = rng.random()
            async with gate:
                if draw < bad_fraction:
                    name = rng.choice(sorted(bad))
                    return await _bad(client, url, name, bad[name], headers)
                hang_up = rng.randint(1, 3) if draw < bad_fraction + disconnect_fraction else None
                body = {"model": model, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                        "max_tokens": max_tokens, "temperature": 1.0, "seed": seed * 100_003 + i, "stream": True,
                        "stream_options": {"include_usage": True}}
                try:
                    return await _stream(client, url, body, headers, hang_up)
                except httpx.HTTPError as e:
                    return Outcome("ok" if hang_up is None else "disconnect", error=f"{type(e).__name__}: {e}")

        start = time.perf_counter()
        tasks = []
        for i in range(num_requests):
            tasks.append(asyncio.ensure_future(one(i)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        end = time.perf_counter() + idle_timeout
        after = await _pages(client, base_url)
        while (after["running"] or after["waiting"] or after["in_flight"]) and time.perf_counter() < end:
            await asyncio.sleep(0.1)
            after = await _pages(client, base_url)
    summary = summarize(outcomes, duration)
    summary["pages_baseline"], summary["pages_free_after"] = baseline["free_pages"], after["free_pages"]
    summary["leaked_pages"] = baseline["free_pages"] - after["free_pages"]
    summary["server_up"] = after["status"] == "ok"
    return summary, list(outcomes)


def _stats(values: list[float], name: str) -> dict:
    if not values:
        return {}
    a = np.asarray(values) * 1000.0
    return {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
            f"p90_{name}_ms": float(np.percentile(a, 90)), f"p99_{name}_ms": float(np.percentile(a, 99))}


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    """vLLM bench-serve figures over the completed requests, plus counts of the other kinds."""
    done = [o for o in outcomes if o.kind == "ok" and o.error is None]
    failed = [o for o in outcomes if o.kind == "ok" and o.error is not None]
    bad = [o for o in outcomes if o.kind not in ("ok", "disconnect")]
    refused = [o for o in bad if o.status is not None and 400 <= o.status < 500 and o.error]
    out_tokens = sum(o.completion_tokens for o in done)
    tpot = [(o.e2e - o.ttft) / (o.completion_tokens - 1) for o in done if o.ttft is not None and o.completion_tokens > 1]
    summary = {
        "completed": len(done), "failed": len(failed), "disconnected": sum(o.kind == "disconnect" for o in outcomes),
        "bad_requests": len(bad), "bad_requests_refused_4xx": len(refused),
        "duration_s": duration, "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(o.prompt_tokens for o in done)) / duration,
        "total_output_tokens": out_tokens,
        **_stats([o.ttft for o in done if o.ttft is not None], "ttft"), **_stats(tpot, "tpot"),
        **_stats([x for o in done for x in o.itl], "itl"), **_stats([o.e2e for o in done], "e2el"),
    }
    if failed:
        summary["first_failure"] = failed[0].error
    return summary
