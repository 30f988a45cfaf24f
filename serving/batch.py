"""Offline batch inference (`jaxseek generate`): read prompts (command line, a text file, or an OpenAI batch JSONL
file), run them through the `Engine`, write one JSON result per request in input order.

A JSONL body may constrain its output (`response_format` as in the OpenAI API, or vLLM's `structured_outputs`;
see `serving.constraints`). A request that fails validation (bad JSON, unknown sampling field, empty or too long
prompt, invalid constraint, ...) becomes an error record `{"custom_id", "error": {"message"}}`; every other
request still runs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from serving.chat_format import normalize_messages
from serving.constraints import CONSTRAINT_FIELDS, ConstraintSpec, constraint_from_body
from serving.engine_config import EngineConfig
from serving.sampling import SEED_LIMIT, SamplingParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT_FIELDS = ("model", "prompt", "messages")  # body fields that are not sampling parameters
BOM = b"\xef\xbb\xbf"


@dataclasses.dataclass
class BatchRequest:
    """One input request: its prompt (text, token ids, or chat messages rendered by the model's chat format),
    sampling fields and output constraint, or why it cannot run."""

    index: int
    custom_id: str
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None  # a chat request's checked messages (`chat_format.normalize_messages`)
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # the body's own sampling fields
    error: str | None = None
    params: SamplingParams | None = None
    prompt_ids: list[int] | None = None
    constraint: ConstraintSpec | None = None


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
    return [BatchRequest(i, f"request-{i}", prompt=p) for i, p in enumerate(prompts)]


def read_txt(path: str | Path) -> list[BatchRequest]:
    """One request per non-blank line (the line without its line break)."""
    path, out = Path(path), []
    for number, raw in _lines(path):
        request = BatchRequest(len(out), f"request-{len(out)}")
        try:
            request.prompt = _decode_line(path, number, raw)
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
    if url == COMPLETIONS:
        if "messages" in body:
            raise ValueError(f"{COMPLETIONS} takes a prompt, not messages")
        request.prompt = _completion_prompt(body.get("prompt"))
    else:
        if "prompt" in body:
            raise ValueError(f"{CHAT} takes messages, not a prompt")
        request.messages = normalize_messages(body.get("messages"))
    request.constraint = constraint_from_body(body)
    request.sampling = {k: v for k, v in body.items() if k not in PROMPT_FIELDS and k not in CONSTRAINT_FIELDS}


def _completion_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt  # token ids (checked against the vocabulary by the engine)
    raise ValueError("prompt must be a string or a list of token ids (one prompt per request), got "
                     f"{json.dumps(prompt)[:80]}")


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


def resolve_params(requests: list[BatchRequest], defaults: dict[str, Any], seed: int) -> None:
    """Set each valid request's SamplingParams (or its error)."""
    for r in requests:
        if r.error is None:
            try:
                fields = merge_sampling(defaults, r.sampling)
                fields.setdefault("seed", request_seed(seed, r.index))
                r.params = SamplingParams.from_dict(fields)
            except (ValueError, TypeError) as e:
                r.error = str(e)


# ---- running --------------------------------------------------------------------------------------------------
def result_record(custom_id: str, output) -> dict[str, Any]:
    """The JSON record of a finished request (`serving.request.RequestOutput`)."""
    record = {"custom_id": custom_id, "text": output.text, "token_ids": output.token_ids,
              "finish_reason": output.finish_reason}
    if output.logprobs is not None:
        record["logprobs"] = [{"token_id": lp.token, "logprob": lp.logprob,
                               "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top]}
                              for lp in output.logprobs]
    return record


def error_record(custom_id: str, message: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "error": {"message": message}}


class OrderedWriter:
    """Emits records in input order as soon as every earlier one is known (so a crash keeps what is done)."""

    def __init__(self, emit: Callable[[dict], None]):
        self.emit, self.ready, self.next = emit, {}, 0

    def put(self, index: int, record: dict) -> None:
        self.ready[index] = record
        while self.next in self.ready:
            self.emit(self.ready.pop(self.next))
            self.next += 1


def encode_prompts(tokenizer, requests: list[BatchRequest], chat_format) -> None:
    """Token ids of each valid request's prompt, a chat request's messages rendered by `chat_format` (one of
    `serving.chat_format`'s formats) first; a prompt that cannot be rendered or encoded becomes the request's
    error."""
    for r in requests:
        if r.error is None:
            try:
                if r.messages is not None:
                    r.prompt = chat_format.render(r.messages)
                r.prompt_ids = list(r.prompt) if isinstance(r.prompt, list) else tokenizer.encode(r.prompt)
            except ValueError as e:
                r.error = str(e)


def fitted_config(requests: list[BatchRequest], config: EngineConfig) -> EngineConfig:
    """`config` fitted to a batch known up front: no more slots than requests, and a chunk no wider than the
    bucket of the longest prompt (at least 8), so start-up compiles only buckets the batch can use. Batch-invariant
    configs keep their shapes (a request's numbers must not depend on the batch's size), and so do mesh ones (the
    slots split evenly over the attention ranks)."""
    if config.batch_invariant or config.mesh is not None:
        return config
    lengths = [len(r.prompt_ids) for r in requests if r.error is None] or [1]
    return dataclasses.replace(config, max_slots=min(config.max_slots, len(lengths)), prefill_chunk=min(
        config.prefill_chunk, max(8, 1 << (max(lengths) - 1).bit_length())))


def submit(engine, requests: list[BatchRequest]) -> None:
    """Queue each encoded request on the engine (its id is its index); a prompt or constraint the engine refuses
    (empty, too long, ids outside the vocabulary, an invalid schema / regex / grammar) becomes the request's
    error."""
    for r in requests:
        if r.error is None:
            try:
                constrained = {} if r.constraint is None else {"constraint": r.constraint}
                engine.add_request(r.prompt_ids, r.params, request_id=str(r.index), **constrained)
            except ValueError as e:
                r.error = str(e)


def run_batch(engine, requests: list[BatchRequest], emit: Callable[[dict], None], progress: bool = True) -> dict:
    """Run the submitted requests to completion, emitting every record (errors too) in input order; returns the
    run's figures (requests, failures, tokens, generation seconds)."""
    from tqdm import tqdm

    writer = OrderedWriter(emit)
    for r in requests:
        if r.error is not None:
            writer.put(r.index, error_record(r.custom_id, r.error))
    running = [r for r in requests if r.error is None]
    generated, start = 0, time.perf_counter()
    with tqdm(total=len(running), unit="req", file=sys.stderr, disable=not progress or not running,
              desc="generate") as bar:
        while engine.has_work:
            for output in engine.step():
                r = requests[int(output.request_id)]
                writer.put(r.index, result_record(r.custom_id, output))
                generated += len(output.token_ids)
                bar.update(1)
                bar.set_postfix(tokens=generated, refresh=False)
    return {"requests": len(requests), "failed": len(requests) - len(running),
            "prompt_tokens": sum(len(r.prompt_ids) for r in running), "generated_tokens": generated,
            "generate_s": time.perf_counter() - start}


def summary_lines(summary: dict, stats: dict, compiled: Sequence) -> list[str]:
    """The closing summary: counts, tokens, time and throughput (engine tokens over the generation loop)."""
    seconds = max(summary["generate_s"], 1e-9)
    prefill, decode, steps = (stats.get(k, 0) for k in ("prefill_tokens", "decode_tokens", "steps"))
    return [
        f"requests: {summary['requests']} ({summary['failed']} failed)",
        f"tokens: {summary['prompt_tokens']} prompt, {summary['generated_tokens']} generated",
        f"wall: {summary['wall_s']:.2f} s (load {summary['load_s']:.2f} s, warmup {summary['warmup_s']:.2f} s, "
        f"generate {summary['generate_s']:.2f} s)",
        f"throughput: prefill {prefill / seconds:.1f} tokens/s, decode {decode / seconds:.1f} tokens/s over the "
        f"generation loop ({steps} steps" + (", incl. compiling: --no-warmup)" if not summary["warmup"] else ")"),
        f"compiled buckets (rows, tokens, verify, context pages): {len(compiled)} {sorted(compiled)}",
    ]
