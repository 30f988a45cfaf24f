"""A router in front of several OpenAI-compatible engine replicas (`jaxseek serve` processes).

It sends each request to a live replica: the one that last served the same prompt prefix (its prefix cache
holds those pages) unless that one carries clearly more load than the least-loaded replica, else the
least-loaded one (requests in flight through this router). Health checks poll each replica's `/health`; a
replica that fails them, or a connection, is taken out of rotation and comes back when it answers again. A
request whose replica dies, or whose replica's engine fails it (a 5xx answer, or a stream's `server_error` event:
a multi-process replica that lost a process fails its requests so), is sent again to another one: before any byte
reached the client that is simply a retry; mid-stream the router gives the request a seed up front (so a retry draws the same tokens: sampling is
keyed by seed and position) and drops the part of the retried stream the client already has.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import random
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.base.sampling import SEED_LIMIT

ROUTED = ("/v1/chat/completions", "/v1/completions")
TEXT_FIELDS = ("content", "reasoning_content", "text")  # the streamed text of a chat delta / a completion choice


@dataclasses.dataclass
class Replica:
    """One engine replica as the router sees it."""

    url: str
    healthy: bool = True
    failures: int = 0  # consecutive failed health checks
    in_flight: int = 0
    served: int = 0


class ReplicaDown(Exception):
    """A replica failed while serving (connection error, 5xx, a stream's server error): the request goes
    elsewhere."""


class Diverged(Exception):
    """A retried stream's text differs from what the client already has (the replicas' numerics differ)."""


class Router:
    """Routes `/v1/chat/completions` and `/v1/completions` over `urls`; `app` is the ASGI application.

    `prefix_chars`: how much of the prompt (its JSON text) keys the prefix map; `slack`: how many more requests
    in flight than the least-loaded replica the prefix's replica may carry and still get it;
    `health_interval` seconds between health checks, `fail_threshold` failed checks before removal."""

    def __init__(self, urls: list[str], *, prefix_chars: int = 512, slack: int = 2, health_interval: float = 1.0,
                 fail_threshold: int = 2, prefix_entries: int = 4096, timeout: float = 600.0):
        if not urls:
            raise ValueError("the router needs at least one replica url")
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.prefix_chars, self.slack = prefix_chars, slack
        self.health_interval, self.fail_threshold = health_interval, fail_threshold
        self.prefixes: collections.OrderedDict[str, Replica] = collections.OrderedDict()
        self.prefix_entries = prefix_entries
        self.timeout = timeout
        self.retries = 0
        self.client: httpx.AsyncClient | None = None
        self.app = self._build_app()

    # ---- choosing ---------------------------------------------------------------------------------------------
    def prefix_key(self, body: dict) -> str:
        prompt = body.get("messages", body.get("prompt"))
        text = json.dumps(prompt, ensure_ascii=False, sort_keys=True)[: self.prefix_chars]
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def choose(self, body: dict, exclude: set[str] = frozenset()) -> Replica:
        """The replica for a request body (raises ReplicaDown if none is live)."""
        live = [r for r in self.replicas if r.healthy and r.url not in exclude]
        if not live:
            raise ReplicaDown("no live replica")
        least = min(live, key=lambda r: (r.in_flight, r.served))
        key = self.prefix_key(body)
        owner = self.prefixes.get(key)
        chosen = owner if owner in live and owner.in_flight <= least.in_flight + self.slack else least
        self.prefixes[key] = chosen
        self.prefixes.move_to_end(key)
        while len(self.prefixes) > self.prefix_entries:
            self.prefixes.popitem(last=False)
        return chosen

    def mark_down(self, replica: Replica) -> None:
        replica.healthy, replica.failures = False, max(replica.failures, self.fail_threshold)

    def _fail_over(self, replica: Replica, tried: set[str]) -> None:
        """A request failed on `replica`: take it out of rotation and try another one next."""
        self.mark_down(replica)
        tried.add(replica.url)
        self.retries += 1

    # ---- health -------------------------------------------------------------------------------------------------
    async def check(self) -> None:
        """One health check of every replica."""
        async def one(replica: Replica):
            try:
                ok = (await self.client.get(replica.url + "/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            replica.failures = 0 if ok else replica.failures + 1
            replica.healthy = ok or replica.failures < self.fail_threshold and replica.healthy

        await asyncio.gather(*(one(r) for r in self.replicas))

    async def _health_loop(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.health_interval)

    # ---- the app ------------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app):
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=5.0),
                                            limits=httpx.Limits(max_connections=1024))
            task = asyncio.ensure_future(self._health_loop())
            yield
            task.cancel()
            await self.client.aclose()

        app = FastAPI(title="jaxseek router", lifespan=lifespan)

        @app.get("/health")
        async def health():
            body = {"replicas": [dataclasses.asdict(r) for r in self.replicas], "retries": self.retries}
            live = any(r.healthy for r in self.replicas)
            return JSONResponse({"status": "ok" if live else "no live replica", **body},
                                status_code=200 if live else 503)

        @app.get("/v1/models")
        async def models(request: Request):
            for replica in [r for r in self.replicas if r.healthy]:
                try:
                    r = await self.client.get(replica.url + "/v1/models", headers=self._headers(request))
                    return Response(r.content, status_code=r.status_code, media_type="application/json")
                except httpx.HTTPError:
                    self.mark_down(replica)
            return _error(503, "no live replica")

        for path in ROUTED:
            app.add_api_route(path, self._route_handler(path), methods=["POST"])
        return app

    @staticmethod
    def _headers(request: Request) -> dict:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    def _route_handler(self, path: str):
        async def handler(request: Request):
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                body = None
            if not isinstance(body, dict):  # the replica words the error
                return await self._forward_once(path, raw, self._headers(request), {})
            if body.get("seed") is None:  # so a retry draws the same tokens
                body["seed"] = random.randrange(SEED_LIMIT)
            if body.get("stream"):
                return await self._stream(path, body, self._headers(request))
            return await self._forward_once(path, json.dumps(body).encode(), self._headers(request), body)

        return handler

    async def _forward_once(self, path: str, raw: bytes, headers: dict, body: dict) -> Response:
        """A non-streamed request: try replicas until one answers without failing."""
        tried: set[str] = set()
        while True:
            try:
                replica = self.choose(body, tried)
            except ReplicaDown:
                return _error(503, "no live replica could serve the request")
            replica.in_flight += 1
            try:
                r = await self.client.post(replica.url + path, content=raw,
                                           headers={**headers, "Content-Type": "application/json"})
                if r.status_code >= 500:
                    raise ReplicaDown(r.text)
                replica.served += 1
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            except (httpx.HTTPError, ReplicaDown):
                self._fail_over(replica, tried)
            finally:
                replica.in_flight -= 1

    async def _open_stream(self, path: str, body: dict, headers: dict, tried: set[str]
                           ) -> tuple[Replica, httpx.Response]:
        """A stream opened on a live replica (ReplicaDown if none could open it): a replica that fails to connect
        or answers 5xx is marked down and the next one tried; a 4xx answer comes back as is."""
        while True:
            replica = self.choose(body, tried)
            replica.in_flight += 1
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", replica.url + path, json=body, headers=headers), stream=True)
            except httpx.HTTPError:
                upstream = None
            if upstream is not None and upstream.status_code < 500:
                if upstream.status_code != 200:
                    replica.in_flight -= 1
                return replica, upstream
            if upstream is not None:
                await upstream.aclose()
            replica.in_flight -= 1
            self._fail_over(replica, tried)

    async def _stream(self, path: str, body: dict, headers: dict) -> Response:
        """A streamed request: open the first replica's stream here, so a refusal (4xx) passes through as is."""
        tried: set[str] = set()
        try:
            replica, upstream = await self._open_stream(path, body, headers, tried)
        except ReplicaDown:
            return _error(503, "no live replica could serve the request")
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type="application/json")
        return StreamingResponse(self._relay(path, body, headers, replica, upstream, tried),
                                 media_type="text/event-stream")

    async def _relay(self, path, body, headers, replica, upstream, tried):
        """Relay SSE lines; when the replica dies mid-stream, continue on another one, skipping what was sent."""
        sent: dict[tuple[int, str], str] = collections.defaultdict(str)  # (choice, field) -> text the client has
        started: set[int] = set()  # choices whose opening (role) chunk the client has
        replayed: dict[tuple[int, str], int] | None = None  # during a retry: how much of `sent` came again
        while True:
            try:
                async for line in upstream.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        replica.served += 1
                        yield b"data: [DONE]\n\n"
                        return
                    payload = json.loads(line[6:])
                    error = payload.get("error")
                    if isinstance(error, dict) and error.get("type") == "server_error":
                        # the replica's engine failed (a job that lost a process): not the client's to see
                        raise ReplicaDown(str(error.get("message")))
                    if replayed is not None:
                        payload = _skip_replayed(payload, sent, replayed, started)
                        if payload is None:
                            continue
                    for choice in payload.get("choices", []):
                        started.add(choice["index"])
                        part = choice.get("delta", choice)
                        for field in TEXT_FIELDS:
                            if isinstance(part.get(field), str):
                                sent[choice["index"], field] += part[field]
                                if replayed is not None:  # the retry is past what was sent before
                                    replayed[choice["index"], field] += len(part[field])
                    yield b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
                raise ReplicaDown("the stream ended without [DONE]")
            except Diverged as e:
                yield _sse_error(str(e))
                return
            except (httpx.HTTPError, ReplicaDown):
                self._fail_over(replica, tried)
            finally:
                replica.in_flight -= 1
                await upstream.aclose()
            try:  # the next replica
                replica, upstream = await self._open_stream(path, body, headers, tried)
            except ReplicaDown:
                yield _sse_error("the replica serving this stream died and no other could take it over")
                return
            if upstream.status_code != 200:
                yield _sse_error(f"the replica serving this stream died and the retry was refused: "
                                 f"{(await upstream.aread()).decode(errors='replace')[:200]}")
                await upstream.aclose()
                return
            replayed = collections.defaultdict(int)


def _skip_replayed(payload: dict, sent: dict, replayed: dict, started: set[int]) -> dict | None:
    """A retried stream's payload less the text the client already has (None: nothing new in it)."""
    choices = []
    for choice in payload.get("choices", []):
        index = choice["index"]
        part = choice.get("delta", choice)
        for field in TEXT_FIELDS:
            text = part.get(field)
            if not isinstance(text, str):
                continue
            have = sent[index, field]
            at = replayed[index, field]
            overlap = min(len(text), len(have) - at)
            if overlap > 0:
                if text[:overlap] != have[at:at + overlap]:
                    raise Diverged(f"the stream's replica died and the retry's text ({text[:overlap]!r}) differs "
                                   f"from what was sent ({have[at:at + overlap]!r}); run the replicas "
                                   "batch-invariant for exact retries")
                replayed[index, field] += overlap
                part[field] = text[overlap:]
        new = [f for f in TEXT_FIELDS + ("tool_calls",) if part.get(f)]
        if new or choice.get("finish_reason") or index not in started:
            choices.append(choice)
    if not choices and payload.get("choices"):
        return None
    return {**payload, "choices": choices}


def _sse_error(message: str) -> bytes:
    return b"data: " + json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                             "code": None}}).encode() + b"\n\n"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": None}},
                        status_code=status)


def main(argv=None) -> int:
    """`python -m serving.router --replica URL --replica URL [--port 8000]`: run the router."""
    import argparse

    import uvicorn

    p = argparse.ArgumentParser(prog="python -m serving.router", description=__doc__)
    p.add_argument("--replica", action="append", required=True, metavar="URL", help="a replica's base url (repeat)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--health-interval", type=float, default=1.0)
    p.add_argument("--slack", type=int, default=2, help="extra in-flight requests a prefix's replica may carry")
    args = p.parse_args(argv)
    router = Router(args.replica, slack=args.slack, health_interval=args.health_interval)
    uvicorn.run(router.app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
