"""Offline batch inference (`jaxseek generate`): read prompts (command line, a text file, or an OpenAI batch JSONL
file), run them through the `Engine`, write one JSON result per request in input order.

A JSONL body is checked and run as the server runs it (`serving.api.openai_api`): completions with several prompts,
chats with tools, thinking mode, `n` choices, output constraints (`response_format`, vLLM's `structured_outputs`);
`stream` is ignored (a batch line holds the whole body). Results are written in OpenAI's batch output format
(`openai_record`: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, the body a
`text_completion` or `chat.completion` as the server answers) or as compact lines (`compact_record`:
`{"custom_id", "text", "token_ids", "finish_reason"}`, one choice per request). A request that fails validation
(bad JSON, a wrong sampling value, empty or too long prompt, invalid constraint, ...) gets an error record; every
other request still runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from serving.base.engine_config import EngineConfig
from serving.api.openai_api import CHAT_FIELDS, COMPLETION_FIELDS, ApiError, OpenAIRequests, Prepared, check_fields
from serving.base.request import RequestOutput
from serving.base.sampling import SEED_LIMIT, SamplingParams, sampling_fields

log = logging.getLogger(__name__)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BOM = b"\xef\xbb\xbf"
OUTPUT_FORMATS = ("openai", "jsonl-compact")


@dataclasses.dataclass
class BatchRequest:
    """One input request: its url and body (a prompt given on the command line or in a text file is a completion
    body), the choices it runs once checked, or why it cannot run (with the HTTP status the server would give)."""

    index: int
    custom_id: str
    url: str = COMPLETIONS
    body: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    status: int = 400
    prepared: Prepared | None = None


# ---- reading inputs -------------------------------------------------------------------------------------------
def _lines(path: Path):
    """(1-based line number, raw bytes) of every line that is not blank; a UTF-8 BOM is dropped."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield number, raw


def _decode_line(path: Path, number: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path.name} line {number} is not valid UTF-8 (byte {e.start}: "
                         f"{raw[e.start:e.start + 1]!r})") from None


def from_prompts(prompts: Sequence[str]) -> list[BatchRequest]:
    """Requests from command-line prompts."""
    return [BatchRequest(i, f"request-{i}", body={"prompt": p}) for i, p in enumerate(prompts)]


def read_txt(path: str | Path) -> list[BatchRequest]:
    """One request per non-blank line (the line without its line break)."""
    path, out = Path(path), []
    for number, raw in _lines(path):
        request = BatchRequest(len(out), f"request-{len(out)}")
        try:
            request.body = {"prompt": _decode_line(path, number, raw)}
        except ValueError as e:
            request.error = str(e)
        out.append(request)
    return out


def read_jsonl(path: str | Path) -> list[BatchRequest]:
    """One request per non-blank line in the OpenAI batch format:
    `{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body": {...}}`."""
    path, out, seen = Path(path), [], {}
    for number, raw in _lines(path):
        request = BatchRequest(len(out), f"request-{len(out)}")
        out.append(request)
        try:
            line = json.loads(_decode_line(path, number, raw))
            if not isinstance(line, dict):
                raise ValueError(f"expected a JSON object, got {type(line).__name__}")
            custom_id = line.get("custom_id", request.custom_id)
            if not isinstance(custom_id, str) or not custom_id:
                raise ValueError(f"custom_id must be a non-empty string, got {custom_id!r}")
            request.custom_id = custom_id
            if custom_id in seen:
                raise ValueError(f"custom_id {custom_id!r} is already used on line {seen[custom_id]}")
            seen[custom_id] = number
            _parse_line(request, line)
        except json.JSONDecodeError as e:
            request.error = f"{path.name} line {number}: invalid JSON: {e}"
        except ValueError as e:
            request.error = f"{path.name} line {number}: {e}"
    return out


def _parse_line(request: BatchRequest, line: dict) -> None:
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; a line holds custom_id, method, url and body")
    if line.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, got {line['method']!r}")
    url, body = line.get("url"), line.get("body")
    if url not in (COMPLETIONS, CHAT):
        raise ValueError(f"unsupported url {url!r}: use {COMPLETIONS} or {CHAT}")
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    if url == COMPLETIONS and "messages" in body:
        raise ValueError(f"{COMPLETIONS} takes a prompt, not messages")
    if url == CHAT and "prompt" in body:
        raise ValueError(f"{CHAT} takes messages, not a prompt")
    request.url, request.body = url, body


def read_input(path: str | Path) -> list[BatchRequest]:
    """Requests from a `.txt` (one prompt per non-blank line) or `.jsonl` (OpenAI batch) file."""
    path = Path(path)
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"--input must be a .txt (one prompt per line) or .jsonl (OpenAI batch) file, got {path}")
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    return read_txt(path) if path.suffix == ".txt" else read_jsonl(path)


# ---- sampling parameters ---------------------------------------------------------------------------------------
def merge_sampling(defaults: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """A request's sampling fields over the command-line defaults (JSON null means "not given")."""
    own = {k: v for k, v in own.items() if v is not None}
    merged = dict(defaults)
    if "max_completion_tokens" in own:
        merged.pop("max_tokens", None)
    if "logprobs" in own or "top_logprobs" in own:
        merged.pop("logprobs", None)
    return {**merged, **own}


def request_seed(seed: int, index: int) -> int:
    """The sampling seed of request `index` of a batch run with `--seed seed` (when the request gives none)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0]) % SEED_LIMIT


def prepare(requests: list[BatchRequest], api: OpenAIRequests, defaults: dict[str, Any], seed: int,
            one_choice: bool = False) -> None:
    """Check each valid request's body as the server does and set its choices (or its error): the body's sampling
    fields over the command-line `defaults`, 16 tokens when neither gives a length, and request i's seed drawn
    from (seed, i) when the body has none. `one_choice`: refuse bodies with several choices (compact output)."""
    for r in requests:
        if r.error is not None:
            continue
        try:
            check_fields(r.body, CHAT_FIELDS if r.url == CHAT else COMPLETION_FIELDS)
            fields = merge_sampling(defaults, {k: v for k, v in r.body.items() if k in sampling_fields()})
            if "max_tokens" not in fields and "max_completion_tokens" not in fields:
                fields["max_tokens"] = SamplingParams.max_tokens
            fields.setdefault("seed", request_seed(seed, r.index))
            r.prepared = api.chat(r.body, fields) if r.url == CHAT else api.completion(r.body, fields)
            if one_choice and len(r.prepared.submissions) > 1:
                raise ApiError(400, f"the request has {len(r.prepared.submissions)} choices (n or several "
                                    "prompts); --output-format jsonl-compact writes one: use --output-format openai")
        except ApiError as e:
            r.error, r.status, r.prepared = e.message, e.status, None


# ---- running --------------------------------------------------------------------------------------------------
def compact_record(r: BatchRequest, outputs: list[RequestOutput] | None) -> dict[str, Any]:
    """A compact line: `{"custom_id", "text", "token_ids", "finish_reason"[, "logprobs"]}` of the request's one
    choice, or `{"custom_id", "error": {"message"}}`."""
    if outputs is None:
        return {"custom_id": r.custom_id, "error": {"message": r.error}}
    [output] = outputs
    record = {"custom_id": r.custom_id, "text": output.text, "token_ids": output.token_ids,
              "finish_reason": output.finish_reason}
    if output.logprobs is not None:
        record["logprobs"] = [{"token_id": lp.token, "logprob": lp.logprob,
                               "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top]}
                              for lp in output.logprobs]
    return record


def openai_record(api: OpenAIRequests, model_name: str) -> Callable[[BatchRequest, list | None], dict]:
    """Lines in OpenAI's batch output format: the body the server would answer (its `model` the request's own, else
    `model_name`), or the error with the status the server would give."""

    def record(r: BatchRequest, outputs: list[RequestOutput] | None) -> dict[str, Any]:
        line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": r.custom_id}
        request_id = f"batch-{uuid.uuid4().hex}"
        if outputs is None:
            kind = ApiError(r.status, r.error).kind
            return {**line, "response": {"status_code": r.status, "request_id": request_id, "body": None},
                    "error": {"code": kind, "message": r.error}}
        model = r.body.get("model") if isinstance(r.body.get("model"), str) else model_name
        created, p = int(time.time()), r.prepared
        body = (api.chat_body(f"chatcmpl-{uuid.uuid4().hex}", created, model, outputs, p.prompt_tokens, p.thinking,
                              p.forced)
                if r.url == CHAT else
                api.completion_body(f"cmpl-{uuid.uuid4().hex}", created, model, outputs, p))
        return {**line, "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}

    return record


class OrderedWriter:
    """Emits records in input order as soon as every earlier one is known (so a crash keeps what is done)."""

    def __init__(self, emit: Callable[[dict], None]):
        self.emit, self.ready, self.next = emit, {}, 0

    def put(self, index: int, record: dict) -> None:
        self.ready[index] = record
        while self.next in self.ready:
            self.emit(self.ready.pop(self.next))
            self.next += 1


def fitted_config(requests: list[BatchRequest], config: EngineConfig) -> EngineConfig:
    """`config` fitted to a batch known up front: no more slots than submissions, and a chunk no wider than the
    bucket of the longest prompt (at least 8), so start-up compiles only buckets the batch can use. Batch-invariant
    configs keep their shapes (a request's numbers must not depend on the batch's size), and so do mesh ones (the
    slots split evenly over the attention ranks)."""
    if config.batch_invariant or config.mesh is not None:
        return config
    lengths = [len(s.prompt) for r in requests if r.error is None for s in r.prepared.submissions] or [1]
    return dataclasses.replace(config, max_slots=min(config.max_slots, len(lengths)), prefill_chunk=min(
        config.prefill_chunk, max(8, 1 << (max(lengths) - 1).bit_length())))


def submit(engine, requests: list[BatchRequest]) -> None:
    """Queue each checked request's choices on the engine (ids `index/choice`); a prompt or constraint the engine
    refuses (empty, too long, ids outside the vocabulary, an invalid schema / regex / grammar) becomes the
    request's error, and its choices already queued are cancelled."""
    for r in requests:
        if r.error is not None:
            continue
        queued = []
        try:
            for j, s in enumerate(r.prepared.submissions):
                queued.append(engine.add_request(s.prompt, s.params, request_id=f"{r.index}/{j}",
                                                 constraint=s.constraint, constraint_trigger=s.trigger))
        except ValueError as e:
            for request_id in queued:
                engine.cancel(request_id)
            r.error, r.prepared = str(e), None


class BatchRun:
    """A batch's submitted requests run to completion (`run`), each one's `record(request, outputs)` emitted in input
    order (`outputs` None for a request that failed). `fail_rest` fails, with its error, every request without a
    record yet: the engine failed, or (from another thread) a multi-process job lost a process mid-step."""

    def __init__(self, requests: list[BatchRequest], emit: Callable[[dict], None],
                 record: Callable[[BatchRequest, list | None], dict]):
        self.requests, self.record, self.writer = requests, record, OrderedWriter(emit)
        self.lock = threading.Lock()  # `fail_rest` may come from another thread
        for r in requests:
            if r.error is not None:
                self.writer.put(r.index, record(r, None))
        self.running = [r for r in requests if r.error is None]
        self.outputs: dict[int, list] = {r.index: [None] * len(r.prepared.submissions) for r in self.running}
        self.failed = len(requests) - len(self.running)

    def run(self, engine, progress: bool = True) -> dict:
        """Step `engine` until it has no work; the run's figures (requests, failures, tokens, generation seconds,
        when the first token came)."""
        from tqdm import tqdm

        generated, start, first_token = 0, time.perf_counter(), None
        with tqdm(total=len(self.running), unit="req", file=sys.stderr, disable=not progress or not self.running,
                  desc="generate") as bar:
            while engine.has_work:
                try:
                    finished = engine.step()
                except Exception as e:  # noqa: BLE001  (the engine is gone: every request not done fails with why)
                    log.exception("engine step failed")
                    self.fail_rest(f"the engine failed: {type(e).__name__}: {e}")
                    break
                if first_token is None and engine.stats["decode_tokens"]:
                    first_token = time.perf_counter()
                for output in finished:
                    index, choice = (int(part) for part in output.request_id.split("/"))
                    if index not in self.outputs:
                        continue  # cancelled with its request
                    choices = self.outputs[index]
                    choices[choice] = output
                    generated += len(output.token_ids)
                    if all(o is not None for o in choices):
                        with self.lock:
                            self.writer.put(index, self.record(self.requests[index], choices))
                        bar.update(1)
                        bar.set_postfix(tokens=generated, refresh=False)
        return {"requests": len(self.requests), "failed": self.failed,
                "prompt_tokens": sum(r.prepared.prompt_tokens for r in self.running),
                "generated_tokens": generated, "generate_s": time.perf_counter() - start,
                "first_token_at": first_token or time.perf_counter()}

    def fail_rest(self, error: str) -> None:
        with self.lock:
            for r in self.running:
                if r.error is None and any(o is None for o in self.outputs[r.index]):
                    r.error, r.status = error, 500
                    self.failed += 1
                    self.writer.put(r.index, self.record(r, None))


def summary_lines(summary: dict, stats: dict, compiled: Sequence) -> list[str]:
    """The closing summary: counts, tokens, time and throughput (engine tokens over the generation loop)."""
    seconds = max(summary["generate_s"], 1e-9)
    prefill, decode, steps = (stats.get(k, 0) for k in ("prefill_tokens", "decode_tokens", "steps"))
    return [
        f"requests: {summary['requests']} ({summary['failed']} failed)",
        f"tokens: {summary['prompt_tokens']} prompt, {summary['generated_tokens']} generated",
        f"wall: {summary['wall_s']:.2f} s (load {summary['load_s']:.2f} s, warmup {summary['warmup_s']:.2f} s, "
        f"generate {summary['generate_s']:.2f} s); first token after {summary['first_token_s']:.2f} s",
        f"throughput: prefill {prefill / seconds:.1f} tokens/s, decode {decode / seconds:.1f} tokens/s over the "
        f"generation loop ({steps} steps"
        + (", incl. compiling each bucket on first use)" if not summary["warmup"] else ")"),
        f"compiled buckets (rows, tokens, verify, context pages): {len(compiled)} {sorted(compiled)}",
    ]
