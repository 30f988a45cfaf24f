"""The OpenAI-compatible HTTP server (`jaxseek serve`): `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`, `/metrics`, over one `Engine` running on its own thread (`serving.engine_loop`).

Streaming is server-sent events with hand-written `data:` lines, ending in `data: [DONE]`; streamed text is
detokenised incrementally and never ends in half a character or in what may be the start of a stop string. A
client that disconnects has its requests cancelled. Every bad request gets a 4xx with an OpenAI-style error
body `{"error": {"message", "type", "param", "code"}}`.

Structured outputs: `response_format` (`json_schema`, `json_object`) or vLLM's `structured_outputs` (`json`,
`regex`, `choice`, `grammar`, `json_object`) constrain a request's output; the engine compiles the constraint,
and an invalid one is that request's 400. In thinking mode the constraint starts after the end of the reasoning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Callable
import uuid

import jax
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.chat_format import Reply, format_for, normalize_messages, normalize_tools
from serving.constraints import CONSTRAINT_FIELDS, ConstraintSpec, constraint_from_body
from serving.detokenize import ChoiceStream, markup_decoder
from serving.disagg import DisaggregatedEngine
from serving.engine import Engine
from serving.engine_loop import Delta, Done, EngineLoop, Failed, Sink, Submission
from serving.metrics import ServerMetrics
from serving.sampling import SEED_LIMIT, SamplingParams, sampling_fields
from serving.tokenizer import tokenizer_for

COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "user"}) | CONSTRAINT_FIELDS
CHAT_FIELDS = COMMON_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                               "thinking", "reasoning_effort"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's older names
MAX_CHOICES = 16


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
    disaggregate: bool = False  # prefill in a separate process (serving.disagg), loading `checkpoint`


class ApiError(Exception):
    """A request the server refuses: HTTP status and an OpenAI-style error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error"}.get(self.status, "invalid_request_error" if self.status < 500 else
                                             "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class Server:
    """An `Engine` behind the OpenAI-compatible API; `app` is the ASGI application.

    Engine arguments (`max_slots`, `max_len`, ...) pass through; the engine decodes with the chat markup kept
    (so DeepSeek-V4 replies can be parsed) and its requests run on the `EngineLoop` thread, started by
    `start()` (the app's lifespan does it)."""

    def __init__(self, model, config: ServerConfig = ServerConfig(), **engine_args):
        self.config, self.model = config, model
        self.tokenizer = tokenizer_for(model)
        self.fmt = format_for(self.tokenizer, config.chat_format, config.checkpoint)
        cfg = model.config
        self.decode = markup_decoder(self.tokenizer, (cfg.eos_token_id, getattr(cfg, "bos_token_id", None)))
        self.engine = self.decode_engine = Engine(model, detokenize=self.decode, **engine_args)
        if config.disaggregate:
            self.engine = DisaggregatedEngine(self.engine, config.checkpoint, engine_args,
                                              jax.config.jax_compilation_cache_dir)
        self.metrics = ServerMetrics(config.model_name, self.decode_engine.num_drafts)
        self.loop = EngineLoop(self.engine, self._observe, self.metrics.constraint_setup.observe)
        self.in_flight, self.max_concurrency = 0, config.max_concurrency
        self.state = {"running": 0, "waiting": 0, "free_pages": self.engine.layout.num_pages,
                      "total_pages": self.engine.layout.num_pages}
        self.app = self._build_app()

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        if isinstance(self.engine, DisaggregatedEngine):
            self.engine.close()

    def _observe(self, engine, finished) -> None:
        """After each engine step (engine thread): queue depths, page usage, finished requests' latencies."""
        s = engine.scheduler
        free, total = s.pages.idle(), engine.layout.num_pages  # cached prefix pages count as free
        self.state = {"running": len(s.running), "waiting": len(s.waiting), "free_pages": free, "total_pages": total}
        self.metrics.observe_engine(len(s.running), len(s.waiting), total - free, total)
        self.metrics.observe_speculation(self.decode_engine.stats)
        self.metrics.observe_grammar(self.decode_engine.stats)
        self.metrics.observe_eplb(self.decode_engine.stats)
        self.metrics.prefix_hit_rate.set(self.decode_engine.prefix_cache_metrics().get("hit_rate", 0.0))
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
            return e.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            return ApiError(e.status_code, str(e.detail)).response()

        @app.get("/health")
        async def health():
            body = {"status": "ok" if self.loop.alive else "failed", **self.state, "in_flight": self.in_flight}
            if self.loop.error:
                body["error"] = self.loop.error
            return JSONResponse(body, status_code=200 if self.loop.alive else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type=self.metrics.content_type)

        @app.get("/v1/models")
        async def models(request: Request):
            self._authorize(request)
            return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": 0,
                                                "owned_by": "jaxseek", "max_model_len": self.engine.layout.max_len}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await self._body(request, CHAT_FIELDS)
            return await self._chat(request, body)

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await self._body(request, COMPLETION_FIELDS)
            return await self._completions(request, body)

        return app

    # ---- request checks -----------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.config.api_key is not None:
            given = request.headers.get("authorization", "")
            if given != f"Bearer {self.config.api_key}":
                raise ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'")

    async def _body(self, request: Request, allowed: frozenset[str]) -> dict:
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
        guided = [f for f in GUIDED_FIELDS if f in body]
        if guided:
            raise ApiError(400, f"{guided[0]} is vLLM's older spelling; send structured_outputs "
                                "({\"json\" | \"regex\" | \"choice\" | \"grammar\": ...}) or response_format",
                           param=guided[0])
        unknown = sorted(set(body) - allowed - sampling_fields())
        if unknown:
            raise ApiError(400, f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "model is required (a string; see GET /v1/models)", param="model")
        if model != self.config.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", param="model", code="model_not_found")
        if not isinstance(body.get("stream", False), bool):
            raise ApiError(400, "stream must be a boolean", param="stream")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
            raise ApiError(400, "stream_options must be {\"include_usage\": bool}", param="stream_options")
        if options is not None and not body.get("stream"):
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        return body

    def _constraint(self, body: dict, thinking: bool = False) -> tuple[ConstraintSpec | None, int | None]:
        """The body's output constraint, and the token it starts after (a thinking-mode chat's end of
        reasoning) or None. The engine compiles it when the request is submitted."""
        param = "response_format" if body.get("response_format") is not None else "structured_outputs"
        try:
            spec = constraint_from_body(body)
        except ValueError as e:
            raise ApiError(400, str(e), param=param) from None
        if spec is None:
            return None, None
        if not thinking or self.fmt.reasoning_end is None:
            return spec, None
        end = self.tokenizer.encode(self.fmt.reasoning_end)
        if len(end) != 1:
            raise ApiError(400, f"structured outputs in thinking mode need {self.fmt.reasoning_end!r} to be one "
                                f"token of this tokenizer (it is {len(end)}); disable thinking", param=param)
        return spec, end[0]

    def _params(self, body: dict, prompt_tokens: int) -> tuple[list[SamplingParams], int]:
        """The sampling parameters of each of the body's `n` choices, and n."""
        fields = {k: body[k] for k in sampling_fields() if k in body}
        n = fields.pop("n", 1)
        n = 1 if n is None else n
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
            raise ApiError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", param="n")
        if fields.get("max_tokens") is None and fields.get("max_completion_tokens") is None:
            room = self.engine.layout.max_len - prompt_tokens
            if room < 1:
                raise ApiError(400, f"the prompt ({prompt_tokens} tokens) fills the model's context of "
                                    f"{self.engine.layout.max_len} tokens", param="messages")
            fields["max_tokens"] = room
        try:
            params = SamplingParams.from_dict(fields)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        seeds = [None if params.seed is None else (params.seed + i) % SEED_LIMIT for i in range(n)]
        return [dataclasses.replace(params, seed=s) for s in seeds], n

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

    def _stream(self, sink: Sink, ids: list[str], chunks) -> StreamingResponse:
        """An SSE response from `chunks(event) -> list of payloads`, with the requests cancelled if the client
        leaves before the end."""
        finished: set[int] = set()
        released = []

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
                    for payload in chunks(event):
                        yield _sse(payload)
                for payload in chunks(None):
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
    def _prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt or len(prompt) > MAX_CHOICES:
            raise ApiError(400, f"prompt must be a string, a list of token ids, or a list of up to {MAX_CHOICES} of "
                                "those", param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(self.tokenizer.encode(p))
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                out.append(list(p))
            else:
                raise ApiError(400, "each prompt must be a string or a list of token ids", param="prompt")
            if not out[-1]:
                raise ApiError(400, "the prompt is empty", param="prompt")
        return out

    async def _completions(self, request: Request, body: dict):
        if body.get("echo"):
            raise ApiError(400, "echo is not supported", param="echo")
        prompts = self._prompts(body.get("prompt"))
        constraint, _ = self._constraint(body)
        subs, n = [], 1
        for ids in prompts:
            params, n = self._params(body, len(ids))
            subs += [Submission(ids, p, constraint) for p in params]
        sink, ids = await self._submit(subs)
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.config.model_name
        usage_prompt = sum(len(p) for p in prompts)

        def usage(outputs) -> dict:
            done = sum(len(o.token_ids) for o in outputs)
            return {"prompt_tokens": usage_prompt, "completion_tokens": done, "total_tokens": usage_prompt + done}

        if not body.get("stream"):
            outputs = await self._collect(request, sink, ids)
            choices = [{"index": i, "text": o.text, "finish_reason": o.finish_reason,
                        "logprobs": self._completion_logprobs(o.logprobs) if o.logprobs is not None else None}
                       for i, o in enumerate(outputs)]
            return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                    "usage": usage(outputs)}

        streams = [ChoiceStream(self.decode, s.params.stop) for s in subs]
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)
        done: list = [None] * len(subs)

        def chunk(index, text, finish=None, logprobs=None):
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]}

        def chunks(event) -> list[dict]:
            if event is None:
                return [{"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                         "usage": usage(done)}] if include_usage else []
            if isinstance(event, Delta):
                text = "".join(t for _, t in streams[event.index].push(event.token_ids))
                wants = subs[event.index].params.logprobs is not None
                lps = self._completion_logprobs(event.logprobs) if wants else None
                return [chunk(event.index, text, logprobs=lps)] if text or lps else []
            done[event.index] = event.output
            text = "".join(t for _, t in streams[event.index].finish(event.output.text))
            return [chunk(event.index, text, event.output.finish_reason)]

        return self._stream(sink, ids, chunks)

    # ---- chat ---------------------------------------------------------------------------------------------
    def _chat_options(self, body: dict) -> tuple[bool, str | None, list[dict]]:
        """(thinking mode, reasoning effort, tools) of a chat request."""
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or set(kwargs) - {"thinking"}:
            raise ApiError(400, "chat_template_kwargs may only hold {\"thinking\": bool}", param="chat_template_kwargs")
        thinking = kwargs.get("thinking", False)
        deepseek = body.get("thinking")
        if deepseek is not None:
            if not isinstance(deepseek, dict) or deepseek.get("type") not in ("enabled", "disabled"):
                raise ApiError(400, "thinking must be {\"type\": \"enabled\" | \"disabled\"}", param="thinking")
            thinking = deepseek["type"] == "enabled"
        if not isinstance(thinking, bool):
            raise ApiError(400, "chat_template_kwargs.thinking must be a boolean", param="chat_template_kwargs")
        effort = body.get("reasoning_effort")
        if effort not in (None, "low", "medium", "high", "max"):
            raise ApiError(400, "reasoning_effort must be low, medium, high or max", param="reasoning_effort")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise ApiError(400, "tool_choice must be 'auto' or 'none': forcing a tool call is not supported",
                           param="tool_choice")
        try:
            tools = normalize_tools(body.get("tools"))
        except ValueError as e:
            raise ApiError(400, str(e), param="tools") from None
        return thinking, effort, [] if choice == "none" else tools

    async def _chat(self, request: Request, body: dict):
        thinking, effort, tools = self._chat_options(body)
        try:
            prompt = self.fmt.render(normalize_messages(body.get("messages")), tools, thinking, effort)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        prompt_ids = self.tokenizer.encode(prompt)
        constraint, trigger = self._constraint(body, thinking)
        params, n = self._params(body, len(prompt_ids))
        sink, ids = await self._submit([Submission(prompt_ids, p, constraint, trigger) for p in params])
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.config.model_name

        def usage(outputs) -> dict:
            done = sum(len(o.token_ids) for o in outputs)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": done,
                    "total_tokens": len(prompt_ids) + done}

        if not body.get("stream"):
            outputs = await self._collect(request, sink, ids)
            choices = []
            for i, o in enumerate(outputs):
                reply = self.fmt.parse(o.text, thinking)
                message = {"role": "assistant", "content": reply.content}
                if reply.reasoning is not None:
                    message["reasoning_content"] = reply.reasoning
                if reply.tool_calls:
                    message["tool_calls"] = reply.tool_calls
                choices.append({"index": i, "message": message, "finish_reason": self._finish(o, reply),
                                "logprobs": {"content": self._chat_logprobs(o.logprobs)} if o.logprobs is not None
                                else None})
            return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                    "usage": usage(outputs)}

        markers = {"reasoning": self.fmt.reasoning_end, "content": self.fmt.tool_calls_start if tools else None}
        streams = [ChoiceStream(self.decode, p.stop, {k: v for k, v in markers.items() if v}, thinking)
                   for p in params]
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)
        done: list = [None] * n

        def chunk(index, delta, finish=None, logprobs=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

        def deltas(index, pieces) -> list[dict]:
            out = []
            for phase, text in pieces:
                key = "reasoning_content" if phase == "reasoning" else "content"
                out.append(chunk(index, {key: text}))
            return out

        started = [False] * n

        def chunks(event) -> list[dict]:
            if event is None:
                return [{"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": [], "usage": usage(done)}] if include_usage else []
            first = [] if started[event.index] else [chunk(event.index, {"role": "assistant", "content": ""})]
            started[event.index] = True
            if isinstance(event, Delta):
                out = deltas(event.index, streams[event.index].push(event.token_ids))
                if params[event.index].logprobs is not None and event.logprobs:
                    out.append(chunk(event.index, {}, logprobs={"content": self._chat_logprobs(event.logprobs)}))
                return first + out
            done[event.index] = o = event.output
            stream = streams[event.index]
            out = deltas(event.index, stream.finish(o.text))
            reply = self.fmt.parse(o.text, thinking)
            if stream.phase == "tools":
                if reply.tool_calls:
                    calls = [{"index": j, **c} for j, c in enumerate(reply.tool_calls)]
                    out.append(chunk(event.index, {"tool_calls": calls}))
                else:  # a malformed block: its text is content after all
                    out.append(chunk(event.index, {"content": reply.content[len(stream.emitted["content"]):]}))
            return first + out + [chunk(event.index, {}, self._finish(o, reply))]

        return self._stream(sink, ids, chunks)

    @staticmethod
    def _finish(output, reply: Reply) -> str:
        return "tool_calls" if reply.tool_calls and output.finish_reason == "stop" else output.finish_reason

    # ---- logprobs -----------------------------------------------------------------------------------------
    def _token_text(self, token: int) -> str:
        return self.decode([token])

    def _chat_logprobs(self, logprobs) -> list[dict]:
        def entry(token, lp):
            text = self._token_text(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]

    def _completion_logprobs(self, logprobs) -> dict:
        tokens = [self._token_text(lp.token) for lp in logprobs]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}


# ---- the command ----------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    """`jaxseek serve` flags (the model flags `--model`, `--config`, `--dtype`, `--seed`, `--chat-template` come from
    the CLI)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JAXSEEK_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $JAXSEEK_API_KEY; none: open)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint directory's "
                                               "name, or 'jaxseek-bundled')")
    p.add_argument("--max-concurrency", type=int, default=256, help="requests in flight before 429 (default 256)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--max-logprobs", type=int, default=5, help="most top_logprobs a request may ask (default 5)")
    p.add_argument("--disaggregate", action="store_true",
                   help="prefill in a separate process that hands each request's cache state to the decode engine")


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


def serve(args, model, **engine_args) -> int:
    """Run the server until interrupted (the body of `jaxseek serve`)."""
    import uvicorn

    if args.disaggregate and args.config:
        raise ValueError("--disaggregate loads the model again in the prefill process: give --model (or neither, "
                         "for the bundled model), not a random --config")
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model else
                                      args.config or "jaxseek-bundled")
    config = ServerConfig(model_name=name, api_key=args.api_key, max_concurrency=args.max_concurrency,
                          max_body_bytes=args.max_body_bytes, chat_format=args.chat_format, checkpoint=args.model,
                          disaggregate=args.disaggregate)
    server = Server(model, config, max_slots=args.max_slots, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                    batch_invariant=args.batch_invariant, num_top_logprobs=args.max_logprobs, seed=args.seed,
                    speculation=args.speculation, num_drafts=args.num_drafts, **engine_args)
    if not args.no_warmup:
        server.engine.warmup()
    uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level)
    return 0

