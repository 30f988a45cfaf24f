"""The OpenAI-compatible HTTP server (`jaxseek serve`): `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`, `/metrics`, vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`, over one `Engine`
running on its own thread (`serving.api.engine_loop`).

Streaming is server-sent events with hand-written `data:` lines, ending in `data: [DONE]`; streamed text is
detokenised incrementally and never ends in half a character or in what may be the start of a stop string. A
client that disconnects has its requests cancelled. Every bad request gets a 4xx with an OpenAI-style error
body `{"error": {"message", "type", "param", "code"}}`.

Structured outputs: `response_format` (`json_schema`, `json_object`) or vLLM's `structured_outputs` (`json`,
`regex`, `choice`, `grammar`, `json_object`) constrain a request's output; the engine compiles the constraint,
and an invalid one is that request's 400. In thinking mode the constraint starts after the end of the reasoning.
A forced `tool_choice` ('required' or a named function) is such a constraint too: the chat format's tool-call
grammar (`OpenAIRequests.forced_tool_calls`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
import uuid

import jax
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api.compile_progress import CompileProgress
from serving.base.detokenize import ChoiceStream
from serving.api.disagg import SPLITS, DisaggregatedEngine
from serving.api.prefill_link import link_key, parse_address
from serving.core.engine import Engine
from serving.core.lockstep import Leader, send_config
from serving.base.engine_config import EngineConfig
from serving.api.engine_loop import Delta, Done, EngineLoop, Failed, Sink, Submission
from serving.api.metrics import ServerMetrics
from serving.api.openai_api import (CHAT_FIELDS, COMPLETION_FIELDS, ApiError, OpenAIRequests, check_fields,
                                model_name, package_version)
from sharding.multihost import Channel, watch

LOST_GRACE_SECONDS = 1.0  # a job that lost a process writes its failed responses this long before it exits


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the server accepts: its model name, an optional API key, in-flight request and body-size limits,
    and the chat format (`auto`: DeepSeek-V4's when the tokenizer has its markup tokens, else the checkpoint's
    Jinja template if it ships one, else plain)."""

    model_name: str = "jaxseek"
    api_key: str | None = None
    max_concurrency: int = 256
    max_body_bytes: int = 1 << 20
    chat_format: str = "auto"
    checkpoint: str | None = None  # the checkpoint directory (its tokenizer_config.json may hold a chat template)
    disaggregate: bool = False  # prefill in a separate process (serving.api.disagg), loading `checkpoint`
    prefill_mesh: str | None = None  # with `disaggregate`: the prefill engine's own mesh (None: the decode engine's)
    pd_split: str = "symmetric"  # with `disaggregate`: what the prefill side computes (serving.api.disagg.SPLITS)
    # a prefill server on another host (`jaxseek serve --role prefill`) instead of a prefill process here, HOST:PORT
    prefill_address: str | None = None


TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "tools", "tool_choice", "chat_template_kwargs", "thinking",
                             "reasoning_effort", "return_token_strs", "add_special_tokens"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class Server:
    """An `Engine` behind the OpenAI-compatible API; `app` is the ASGI application.

    The engine's settings are `engine_config` and / or `EngineConfig` fields as keywords (`max_slots`, `max_len`,
    ...), as `Engine` takes them; the engine decodes with the chat markup kept (so DeepSeek-V4 replies can be
    parsed) and its requests run on the `EngineLoop` thread, started by `start()` (the app's lifespan does it)."""

    def __init__(self, model, config: ServerConfig = ServerConfig(), engine_config: EngineConfig | None = None,
                 **engine_settings):
        if config.prefill_address is not None:  # a prefill server's pair is disaggregated
            parse_address(config.prefill_address)
            link_key()  # both refused before the decode engine is built
            config = dataclasses.replace(config, disaggregate=True)
        if config.prefill_mesh is not None and not config.disaggregate:
            raise ValueError("prefill_mesh (--prefill-mesh) is the prefill process's mesh: it needs --disaggregate")
        if config.pd_split != "symmetric" and not config.disaggregate:
            raise ValueError(f"pd_split={config.pd_split!r} (--pd-split) splits the work of a prefill side: it "
                             "needs --disaggregate or --prefill-address")
        if config.disaggregate and jax.process_count() > 1:
            raise ValueError("a disaggregated pair's decode engine runs in one process: a multi-process job serves "
                             "without --disaggregate / --prefill-address")
        self.config, self.model = config, model
        self.api = OpenAIRequests.for_model(model, config.chat_format, config.checkpoint, 1024)
        self.tokenizer, self.fmt, self.decode = self.api.tokenizer, self.api.fmt, self.api.decode
        channel = Channel() if jax.process_count() > 1 else None  # a multi-process job's leader
        if channel is not None:  # the others build their engines from its settings, and run what it schedules
            settings = dataclasses.replace(engine_config or EngineConfig(), **engine_settings)
            send_config(channel, settings, model.config)
        self.engine = self.decode_engine = Engine(model, engine_config, detokenize=self.decode, **engine_settings)
        self.api.max_len = self.engine.layout.max_len
        if config.disaggregate:
            self.engine = DisaggregatedEngine(self.engine, config.checkpoint, jax.config.jax_compilation_cache_dir,
                                              prefill_mesh=config.prefill_mesh, split=config.pd_split,
                                              prefill_address=config.prefill_address)
        if channel is not None:
            self.engine = Leader(self.engine, channel)
        self.metrics = ServerMetrics(config.model_name, self.decode_engine.speculation.num_drafts)
        self.loop = EngineLoop(self.engine, self._observe, self.metrics.constraint_setup.observe)
        self.in_flight, self.max_concurrency = 0, config.max_concurrency
        self.state = {"running": 0, "waiting": 0, "free_pages": self.engine.layout.num_pages,
                      "total_pages": self.engine.layout.num_pages}
        self.app = self._build_app()

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        if isinstance(self.engine, (DisaggregatedEngine, Leader)):
            self.engine.close()
        self.decode_engine.close()

    def _observe(self, engine, finished) -> None:
        """After each engine step (engine thread): queue depths, page usage, finished requests' latencies."""
        s = engine.scheduler
        free, total = s.pages.idle(), engine.layout.num_pages  # cached prefix pages count as free
        self.state = {"running": len(s.running), "waiting": len(s.waiting), "free_pages": free, "total_pages": total}
        self.metrics.observe_engine(len(s.running), len(s.waiting), total - free, total)
        self.metrics.observe_speculation(self.decode_engine.stats)
        self.metrics.observe_grammar(self.decode_engine.stats)
        self.metrics.observe_eplb(self.decode_engine.stats)
        self.metrics.observe_prefix(self.decode_engine.prefix_cache_metrics())
        for output in finished:
            self.metrics.observe_finished(output)

    # ---- the app ------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(app):
            if not self.loop._thread.is_alive():
                self.start()
            yield
            self.stop()

        app = FastAPI(title="jaxseek", lifespan=lifespan)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, e: ApiError):
            if e.status < 500:
                self.metrics.observe_rejected(e.status)
            return _error_response(e)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            return _error_response(ApiError(e.status_code, str(e.detail)))

        @app.get("/health")
        async def health():
            body = {"status": "ok" if self.loop.alive else "failed", **self.state, "in_flight": self.in_flight}
            if self.loop.error:
                body["error"] = self.loop.error
            return JSONResponse(body, status_code=200 if self.loop.alive else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type=self.metrics.content_type)

        @app.get("/version")
        async def version():
            return {"version": package_version()}

        @app.get("/v1/models")
        async def models(request: Request):
            self._authorize(request)
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(request: Request, model_id: str):
            self._authorize(request)
            if model_id != self.config.model_name:
                raise ApiError(404, f"the model {model_id!r} does not exist; this server serves "
                                    f"{self.config.model_name!r}", param="model", code="model_not_found")
            return self._model_card()

        @app.get("/tokenizer_info")
        async def tokenizer_info(request: Request):
            self._authorize(request)
            return self._tokenizer_info()

        @app.post("/tokenize")
        async def tokenize(request: Request):
            body = await self._body(request, TOKENIZE_FIELDS, model_optional=True)
            return self._tokenize(body)

        @app.post("/detokenize")
        async def detokenize(request: Request):
            body = await self._body(request, DETOKENIZE_FIELDS, model_optional=True)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                       0 <= t < self.model.config.vocab_size for t in tokens):
                raise ApiError(400, "tokens must be a list of token ids in [0, "
                                    f"{self.model.config.vocab_size})", param="tokens")
            return {"prompt": self.decode(tokens)}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await self._body(request, CHAT_FIELDS)
            return await self._chat(request, body)

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await self._body(request, COMPLETION_FIELDS)
            return await self._completions(request, body)

        return app

    def _model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "jaxseek",
                "root": self.config.checkpoint or self.config.model_name, "parent": None,
                "max_model_len": self.engine.layout.max_len}

    def _tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's class, special tokens and context length, which a client's
        remote tokenizer reads (lm-eval's takes `eos_token` as its stop string); the text of a token the
        tokenizer has no text for (the byte-level fallback's) is null."""
        cfg = self.model.config
        eos, bos = cfg.eos_token_id, getattr(cfg, "bos_token_id", None)
        text = getattr(self.tokenizer, "token_text", None)

        def token(i):
            return None if i is None or text is None else text(i)

        return {"tokenizer_class": type(self.tokenizer).__name__, "bos_token": token(bos), "eos_token": token(eos),
                "pad_token": None, "bos_token_id": bos, "eos_token_id": eos,
                "model_max_length": self.engine.layout.max_len, "vocab_size": cfg.vocab_size,
                "chat_template": getattr(self.fmt, "source", None), "chat_format": self.fmt.name}

    def _tokenize(self, body: dict) -> dict:
        """vLLM's /tokenize: a prompt's token ids as /v1/completions tokenizes it (no special tokens; with
        `add_special_tokens: true`, those the tokenizer adds), or a chat's (its messages rendered as
        /v1/chat/completions renders them)."""
        if ("prompt" in body) == ("messages" in body):
            raise ApiError(400, "give a prompt (a string) or messages", param="prompt")
        special = body.get("add_special_tokens")
        if special is not None and not isinstance(special, bool):
            raise ApiError(400, "add_special_tokens must be a boolean", param="add_special_tokens")
        if "prompt" in body:
            if not isinstance(body["prompt"], str):
                raise ApiError(400, "prompt must be a string", param="prompt")
            tokens = (self.tokenizer.encode(body["prompt"], add_special_tokens=True) if special
                      else self.tokenizer.encode(body["prompt"]))
        else:
            if special:
                raise ApiError(400, "add_special_tokens: true goes with a prompt; a chat's tokens are its rendered "
                                    "messages, special tokens included", param="add_special_tokens")
            tokens = self.api.chat_prompt(body)[0]
        strs = body.get("return_token_strs")
        if strs is not None and not isinstance(strs, bool):
            raise ApiError(400, "return_token_strs must be a boolean", param="return_token_strs")
        return {"count": len(tokens), "max_model_len": self.engine.layout.max_len, "tokens": tokens,
                "token_strs": [self.decode([t]) for t in tokens] if strs else None}

    # ---- request checks -----------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.config.api_key is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.config.api_key}".encode()):  # constant time
                raise ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'")

    async def _body(self, request: Request, allowed: frozenset[str], model_optional: bool = False) -> dict:
        """The request's checked JSON body (`check_fields`); with `model_optional` a body may leave `model` out
        (vLLM's /tokenize and /detokenize), but one it names must be the server's."""
        self._authorize(request)
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body of {declared} bytes exceeds the server's limit of {limit} bytes")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise ApiError(413, f"request body exceeds the server's limit of {limit} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        check_fields(body, allowed, None if model_optional and "model" not in body else self.config.model_name)
        return body

    # ---- running ------------------------------------------------------------------------------------------
    async def _submit(self, requests: list[Submission]) -> tuple[Sink, list[str]]:
        if self.in_flight >= self.max_concurrency:
            raise ApiError(429, f"the server is at its limit of {self.max_concurrency} requests in flight; "
                                "retry later")
        if not self.loop.alive:
            raise ApiError(503, f"the engine is not running: {self.loop.error or 'stopped'}")
        sink = Sink()
        self.in_flight += 1
        try:
            ids = await asyncio.wrap_future(self.loop.submit(requests, sink))
        except ValueError as e:
            self.in_flight -= 1
            raise ApiError(400, str(e)) from None
        except RuntimeError as e:
            self.in_flight -= 1
            raise ApiError(503, str(e)) from None
        return sink, ids

    def _release(self, ids: list[str], finished: set[int]) -> None:
        self.loop.cancel([request_id for i, request_id in enumerate(ids) if i not in finished])
        self.in_flight -= 1

    async def _collect(self, request: Request, sink: Sink, ids: list[str]) -> list:
        """Every choice's RequestOutput (non-streaming); cancels them all if the client goes away."""
        outputs: list = [None] * len(ids)
        finished: set[int] = set()

        async def results():
            while len(finished) < len(ids):
                event = await sink.queue.get()
                if isinstance(event, Failed):
                    raise ApiError(500, f"the engine failed: {event.message}")
                if isinstance(event, Done):
                    outputs[event.index] = event.output
                    finished.add(event.index)

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, gone = asyncio.ensure_future(results()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()  # re-raises an engine failure
        finally:
            work.cancel()
            gone.cancel()
            self._release(ids, finished)
        if len(finished) < len(ids):
            raise ApiError(499, "the client closed the connection")
        return outputs

    def _stream(self, sink: Sink, ids: list[str], chunks, header: dict, prompt_tokens: int,
                options: dict | None) -> StreamingResponse:
        """An SSE response from `chunks(event) -> list of payloads`, with the requests cancelled if the client
        leaves before the end. `options` are the body's `stream_options`: `include_usage` ends the stream with a
        chunk of no choices holding the usage (`header`: its id, object, created and model), and with it
        `continuous_usage_stats` (vLLM's) puts the usage so far (the tokens every choice has streamed) on every
        chunk."""
        finished: set[int] = set()
        released = []
        usage = bool((options or {}).get("include_usage"))
        continuous = usage and bool(options.get("continuous_usage_stats"))
        generated, done = [0] * len(ids), [None] * len(ids)

        def payloads(event) -> list[dict]:
            if event is None:
                return [{**header, "choices": [], "usage": self.api.usage(prompt_tokens, done)}] if usage else []
            if isinstance(event, Done):
                done[event.index], generated[event.index] = event.output, len(event.output.token_ids)
            else:
                generated[event.index] += len(event.token_ids)
            out = chunks(event)
            if continuous:
                so_far = self.api.usage(prompt_tokens, [], sum(generated))
                for payload in out:
                    payload["usage"] = so_far
            return out

        def release():
            if not released:
                released.append(True)
                self._release(ids, finished)

        async def body():
            try:
                while len(finished) < len(ids):
                    event = await sink.queue.get()
                    if isinstance(event, Failed):
                        yield _sse({"error": {"message": f"the engine failed: {event.message}",
                                              "type": "server_error", "param": None, "code": None}})
                        return
                    if isinstance(event, Done):
                        finished.add(event.index)
                    for payload in payloads(event):
                        yield _sse(payload)
                for payload in payloads(None):
                    yield _sse(payload)
                yield b"data: [DONE]\n\n"
            finally:
                release()

        class Stream(StreamingResponse):
            async def __call__(self, scope, receive, send):
                try:
                    await super().__call__(scope, receive, send)
                finally:
                    release()

        return Stream(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ---- completions --------------------------------------------------------------------------------------
    async def _completions(self, request: Request, body: dict):
        prepared = self.api.completion(body)
        subs = prepared.submissions
        sink, ids = await self._submit(subs)
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.config.model_name

        if not body.get("stream"):
            outputs = await self._collect(request, sink, ids)
            return self.api.completion_body(rid, created, model, outputs, prepared)

        streams = [ChoiceStream(self.decode, s.params.stop) for s in subs]
        echoed = [prepared.echo is None] * len(subs)  # the choice's prompt was streamed (or is not echoed)
        header = {"id": rid, "object": "text_completion", "created": created, "model": model}

        def chunk(index, text, finish=None, logprobs=None):
            return {**header, "choices": [{"index": index, "text": text, "finish_reason": finish,
                                           "logprobs": logprobs}]}

        def echo(index: int, prompt_logprobs) -> list[dict]:
            """The choice's first chunk under `echo`: its prompt text, with the prompt's logprobs when asked."""
            echoed[index] = True
            sub = subs[index]
            lps = (self.api.completion_logprobs(prompt_logprobs, sub.prompt) if sub.params.logprobs is not None
                   else None)
            return [chunk(index, prepared.echo[index], logprobs=lps)]

        def chunks(event) -> list[dict]:
            prompt = event.prompt_logprobs if isinstance(event, Delta) else event.output.prompt_logprobs
            first = [] if echoed[event.index] else echo(event.index, prompt or [])
            if isinstance(event, Delta):
                text = "".join(t for _, t in streams[event.index].push(event.token_ids))
                wants = subs[event.index].params.logprobs is not None
                lps = self.api.completion_logprobs(event.logprobs) if wants else None
                return first + ([chunk(event.index, text, logprobs=lps)] if text or lps else [])
            text = "".join(t for _, t in streams[event.index].finish(event.output.text))
            return first + [chunk(event.index, text, event.output.finish_reason)]

        return self._stream(sink, ids, chunks, header, prepared.prompt_tokens, body.get("stream_options"))

    # ---- chat ---------------------------------------------------------------------------------------------
    async def _chat(self, request: Request, body: dict):
        prepared = self.api.chat(body)
        thinking, tools, forced = prepared.thinking, prepared.tools, prepared.forced
        params, n = [s.params for s in prepared.submissions], len(prepared.submissions)
        sink, ids = await self._submit(prepared.submissions)
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.config.model_name

        if not body.get("stream"):
            outputs = await self._collect(request, sink, ids)
            return self.api.chat_body(rid, created, model, outputs, prepared.prompt_tokens, thinking, forced)

        markers = {"reasoning": self.fmt.reasoning_end, "content": self.fmt.tool_calls_start if tools else None}
        streams = [ChoiceStream(self.decode, p.stop, {k: v for k, v in markers.items() if v}, thinking)
                   for p in params]
        if forced and self.fmt.tool_calls_start is None:  # the whole reply is the call (vLLM's JSON form)
            for stream in streams:
                stream.phase = "tools"
        header = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

        def chunk(index, delta, finish=None, logprobs=None):
            return {**header, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                           "logprobs": logprobs}]}

        def deltas(index, pieces) -> list[dict]:
            out = []
            for phase, text in pieces:
                key = "reasoning_content" if phase == "reasoning" else "content"
                out.append(chunk(index, {key: text}))
            return out

        started = [False] * n

        def chunks(event) -> list[dict]:
            first = [] if started[event.index] else [chunk(event.index, {"role": "assistant", "content": ""})]
            started[event.index] = True
            if isinstance(event, Delta):
                out = deltas(event.index, streams[event.index].push(event.token_ids))
                if params[event.index].logprobs is not None and event.logprobs:
                    out.append(chunk(event.index, {}, logprobs={"content": self.api.chat_logprobs(event.logprobs)}))
                return first + out
            o = event.output
            stream = streams[event.index]
            out = deltas(event.index, stream.finish(o.text))
            reply = self.fmt.parse(o.text, thinking, forced)
            if stream.phase == "tools":
                if reply.tool_calls:
                    calls = [{"index": j, **c} for j, c in enumerate(reply.tool_calls)]
                    out.append(chunk(event.index, {"tool_calls": calls}))
                else:  # a malformed block: its text is content after all
                    out.append(chunk(event.index, {"content": reply.content[len(stream.emitted["content"]):]}))
            return first + out + [chunk(event.index, {}, self.api.finish(o, reply))]

        return self._stream(sink, ids, chunks, header, prepared.prompt_tokens, body.get("stream_options"))


# ---- the command ----------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    """`jaxseek serve` flags (the model flags `--model`, `--config`, `--weights` / `--dtype`, `--seed`,
    `--chat-template` come from the CLI)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JAXSEEK_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $JAXSEEK_API_KEY; none: open)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint directory's "
                                               "name, or 'jaxseek-bundled')")
    p.add_argument("--max-concurrency", type=int, default=256, help="requests in flight before 429 (default 256)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--max-logprobs", type=int, default=5, help="most top_logprobs a request may ask (default 5)")
    p.add_argument("--role", choices=("api", "prefill"), default="api",
                   help="api: the OpenAI-compatible server; prefill: a prefill server on --host/--port for the "
                        "decode engine of a 'jaxseek serve --prefill-address HOST:PORT' on another host (it takes "
                        "that engine's settings, runs them on its own --mesh, and needs $JAXSEEK_PD_KEY)")
    p.add_argument("--disaggregate", action="store_true",
                   help="prefill in a separate process that hands each request's cache state to the decode engine")
    p.add_argument("--prefill-address", metavar="HOST:PORT",
                   help="prefill on the prefill server at HOST:PORT ('jaxseek serve --role prefill' on another "
                        "host, the same checkpoint and --pd-split, the same $JAXSEEK_PD_KEY), which hands each "
                        "request's cache state to the decode engine here")
    p.add_argument("--prefill-mesh", metavar="SPEC",
                   help="with --disaggregate: the prefill engine's own mesh, e.g. dp=2,ep=2 (default: --mesh)")
    p.add_argument("--pd-split", choices=SPLITS, default="symmetric",
                   help="with --disaggregate: symmetric (the prefill process runs the whole model on the whole "
                        "prompt) or asymmetric (V4.1: it holds the layers through the last KV source alone and "
                        "runs them on all but the prompt's last replay-keep tokens, which the decode engine "
                        "prefills through every layer)")


def serve_in_thread(app, host: str = "127.0.0.1") -> tuple[str, Callable[[], None]]:
    """Run an ASGI app under uvicorn on a free port of `host` in a daemon thread (tests, benchmarks); returns
    (base url, stop)."""
    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server could not start on {host}:{port}")
        time.sleep(0.02)

    def stop():
        http.should_exit = True
        thread.join()

    return f"http://{host}:{port}", stop


def _lost(server: Server, why: str) -> None:
    """A multi-process job lost a process: its step waits for ever, so fail the requests in flight (their
    responses are written within `LOST_GRACE_SECONDS`) and end this process."""
    server.loop.fail_all(why)
    time.sleep(LOST_GRACE_SECONDS)
    print(f"jaxseek serve: error: {why}", file=sys.stderr, flush=True)
    os._exit(1)


def serve(args, model, engine_config: EngineConfig) -> int:
    """Run the server until interrupted (the body of `jaxseek serve`), its engine set by `engine_config`."""
    import uvicorn

    disaggregated = args.disaggregate or args.prefill_address is not None
    if disaggregated and args.config:
        raise ValueError("the prefill side loads the model again: give --model (or neither, for the bundled model), "
                         "not a random --config")
    name = args.served_model_name or model_name(args.model, args.config)
    config = ServerConfig(model_name=name, api_key=args.api_key, max_concurrency=args.max_concurrency,
                          max_body_bytes=args.max_body_bytes, chat_format=args.chat_format, checkpoint=args.model,
                          disaggregate=args.disaggregate, prefill_mesh=args.prefill_mesh, pd_split=args.pd_split,
                          prefill_address=args.prefill_address)
    server = Server(model, config, engine_config)
    if isinstance(server.engine, Leader):
        watch(lambda why: _lost(server, why))
    print(f"jaxseek serve: {server.engine.startup_summary()}", file=sys.stderr)
    if disaggregated:
        where = f"server at {args.prefill_address}" if args.prefill_address else "process"
        print(f"jaxseek serve: the prefill {where} runs on {server.engine.prefill_layout}, "
              f"{server.engine.prefill_weight_bytes / 2**20:.1f} MiB of weights ({args.pd_split} split)",
              file=sys.stderr)
    if not args.no_warmup:
        # what the first requests run compiles before the server answers, the other buckets after, while it serves
        # (a disaggregated pair compiles everything first: its prefill process compiles on its own)
        progress = CompileProgress(server.decode_engine)
        if disaggregated:
            server.engine.warmup()
        else:
            server.engine.warmup(server.engine.first_buckets())
        print(progress.summary(), file=sys.stderr)
        if not disaggregated:
            server.engine.compile_in_background()
    http = uvicorn.Server(uvicorn.Config(server.app, host=args.host, port=args.port, log_level=args.log_level,
                                         timeout_graceful_shutdown=5))
    if isinstance(server.engine, Leader):
        # the job cannot run another step once a process is gone: its requests got the error, the server stops
        server.loop.on_failure = lambda: setattr(http, "should_exit", True)
    try:
        http.run()
    except KeyboardInterrupt:  # uvicorn raises the interrupt it stopped for again: the server stopped as asked
        pass
    if server.loop.error is not None and isinstance(server.engine, Leader):
        print(f"jaxseek serve: error: {server.loop.error}", file=sys.stderr)
        return 1
    return 0

