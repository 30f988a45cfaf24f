"""The OpenAI API's request checks and response bodies, shared by the HTTP server (`serving.api.server`) and the batch
runner (`serving.api.batch`): a body's fields become the choices to run (`Submission`s), finished choices become a
`text_completion` or `chat.completion` body.

Fields this API does not know are ignored with a logged warning (as vLLM does); a known field with a wrong type or
value is an `ApiError` (HTTP 400)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

from serving.api.chat_format import Reply, format_for, normalize_messages, normalize_tools
from serving.structured.constraints import CONSTRAINT_FIELDS, ConstraintSpec, constraint_from_body
from serving.base.detokenize import markup_decoder
from serving.api.engine_loop import Submission
from serving.base.request import RequestOutput, TokenLogprob
from serving.base.sampling import SEED_LIMIT, SamplingParams, sampling_fields
from serving.base.tokenizer import tokenizer_for

log = logging.getLogger(__name__)

COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "user"}) | CONSTRAINT_FIELDS
CHAT_FIELDS = COMMON_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                               "thinking", "reasoning_effort"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})  # the latter vLLM's: usage on every chunk
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's older names
MAX_CHOICES = 16


def package_version() -> str:
    """The installed jaxseek's version (the server's `/version`, the command's `--version`)."""
    try:
        return version("jaxseek")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def model_name(checkpoint: str | None, preset: str | None) -> str:
    """The model's default name in responses: the checkpoint directory's name, the preset's, or the bundled
    model's."""
    return os.path.basename(os.path.normpath(checkpoint)) if checkpoint else preset or "jaxseek-bundled"


class ApiError(Exception):
    """A request the API refuses: HTTP status and an OpenAI-style error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        """The error's OpenAI `type`."""
        return {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error"}.get(self.status, "invalid_request_error" if self.status < 500 else
                                             "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A checked request: the choices to run, its prompt tokens, (a chat) its thinking mode, tools and whether
    `tool_choice` forces a call, and (a completion with `echo`) each choice's prompt text to echo, and whether it
    asked for the prompt alone (`max_tokens: 0`: the engine still samples one token, which is left out)."""

    submissions: list[Submission]
    prompt_tokens: int
    thinking: bool = False
    tools: list[dict] = dataclasses.field(default_factory=list)
    forced: bool = False
    echo: list[str] | None = None
    prompt_only: bool = False


def check_fields(body: dict, allowed: frozenset[str], model_name: str | None = None) -> None:
    """The checks every body passes: vLLM's old guided fields refused, unknown fields dropped from `body` with a
    warning (unknown `stream_options` keys too), `model` (when `model_name` is given), `stream` and
    `stream_options`."""
    guided = [f for f in GUIDED_FIELDS if f in body]
    if guided:
        raise ApiError(400, f"{guided[0]} is vLLM's older spelling; send structured_outputs "
                            "({\"json\" | \"regex\" | \"choice\" | \"grammar\": ...}) or response_format",
                       param=guided[0])
    unknown = sorted(set(body) - allowed - sampling_fields())
    if unknown:
        log.warning("ignoring unknown request field(s): %s", ", ".join(unknown))
        for name in unknown:
            del body[name]
    if model_name is not None:
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "model is required (a string; see GET /v1/models)", param="model")
        if model != model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
    if not isinstance(body.get("stream", False), bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object {\"include_usage\": bool, \"continuous_usage_stats\": "
                            "bool}", param="stream_options")
    if not body.get("stream"):
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    unknown = sorted(set(options) - STREAM_OPTIONS)
    if unknown:
        log.warning("ignoring unknown stream_options field(s): %s", ", ".join(unknown))
    body["stream_options"] = options = {k: v for k, v in options.items() if k in STREAM_OPTIONS}
    for key, value in options.items():
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"stream_options.{key} must be a boolean, got {value!r}", param="stream_options")


def choice_count(body: dict) -> int:
    """The body's `n`: how many choices each prompt gets."""
    n = body.get("n")
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", param="n")
    return n


class OpenAIRequests:
    """Turns request bodies into engine submissions and finished choices into response bodies, for one model's
    tokenizer, chat format (`serving.api.chat_format`), markup-keeping decoder and context length."""

    def __init__(self, tokenizer, fmt, decode: Callable[[list[int]], str], max_len: int):
        self.tokenizer, self.fmt, self.decode, self.max_len = tokenizer, fmt, decode, max_len

    @classmethod
    def for_model(cls, model, chat_format: str, checkpoint: str | None, max_len: int) -> OpenAIRequests:
        """For `model`: its tokenizer, the chat format by name or template file (`chat_format.format_for`), and a
        decoder that keeps the chat markup (so DeepSeek-V4 replies can be parsed) and drops bos / eos."""
        tokenizer = tokenizer_for(model)
        cfg = model.config
        decode = markup_decoder(tokenizer, (cfg.eos_token_id, getattr(cfg, "bos_token_id", None)))
        return cls(tokenizer, format_for(tokenizer, chat_format, checkpoint), decode, max_len)

    # ---- requests -----------------------------------------------------------------------------------------
    def completion(self, body: dict, fields: dict | None = None) -> Prepared:
        """The choices of a `/v1/completions` body (each prompt n times); `fields` are its sampling fields
        (default: the body's own)."""
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise ApiError(400, f"echo must be a boolean, got {echo!r}", param="echo")
        fields = self.without_prompt_logprobs(body if fields is None else fields)
        length = "max_tokens" if fields.get("max_tokens") is not None else "max_completion_tokens"
        prompt_only = bool(echo) and fields.get(length) == 0
        if prompt_only and body.get("stream"):
            raise ApiError(400, "echo with max_tokens 0 (the prompt alone) is not streamed: send stream false",
                           param="stream")
        if prompt_only:  # the prompt's logprobs alone: one token is sampled at the prefill's end, then dropped
            fields[length] = 1
        if echo and fields.get("logprobs") is not None:
            fields["prompt_logprobs"] = fields["logprobs"]
        prompts = self.prompts(body.get("prompt"))
        constraint, _ = self.constraint(body)
        choices = [(ids, text, p) for ids, text in prompts for p in self.params(body, len(ids), fields)]
        return Prepared([Submission(ids, p, constraint) for ids, _, p in choices], sum(len(ids) for ids, _ in prompts),
                        echo=[self.decode(ids) if text is None else text for ids, text, _ in choices] if echo else None,
                        prompt_only=prompt_only)

    def chat_prompt(self, body: dict) -> tuple[list[int], bool, list[dict]]:
        """A chat body's prompt tokens (its messages rendered by the chat format), thinking mode and tools."""
        thinking, effort, tools = self.chat_options(body)
        try:
            prompt = self.fmt.render(normalize_messages(body.get("messages")), tools, thinking, effort)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        return self.tokenizer.encode(prompt), thinking, tools

    def chat(self, body: dict, fields: dict | None = None) -> Prepared:
        """The n choices of a `/v1/chat/completions` body: its messages rendered by the chat format."""
        prompt_ids, thinking, tools = self.chat_prompt(body)
        forced = self.forced_tool_calls(body, tools)
        constraint, trigger = self.constraint(body, thinking, forced)
        params = self.params(body, len(prompt_ids), self.without_prompt_logprobs(body if fields is None else fields))
        return Prepared([Submission(prompt_ids, p, constraint, trigger) for p in params], len(prompt_ids), thinking,
                        tools, forced is not None)

    @staticmethod
    def without_prompt_logprobs(fields: dict) -> dict:
        """A copy of a body's sampling `fields`, refusing vLLM's `prompt_logprobs` (a completion asks with echo)."""
        if fields.get("prompt_logprobs") is not None:
            raise ApiError(400, "prompt_logprobs is not supported: ask /v1/completions for echo with logprobs",
                           param="prompt_logprobs")
        return dict(fields)

    def prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        """A completions `prompt`'s prompts, each as (token ids, its text or None when given as ids): a string,
        token ids, or a list of up to MAX_CHOICES of those."""
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
                out.append((self.tokenizer.encode(p), p))
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                out.append((list(p), None))
            else:
                raise ApiError(400, "each prompt must be a string or a list of token ids", param="prompt")
            if not out[-1][0]:
                raise ApiError(400, "the prompt is empty", param="prompt")
        return out

    def constraint(self, body: dict, thinking: bool = False, forced: ConstraintSpec | None = None
                   ) -> tuple[ConstraintSpec | None, int | None]:
        """The body's output constraint (`forced`: a forced tool call's, which excludes the body's own), and the
        token it starts after (a thinking-mode chat's end of reasoning) or None. The engine compiles it when the
        request is submitted."""
        param = "response_format" if body.get("response_format") is not None else "structured_outputs"
        if forced is not None and body.get(param) is not None:
            raise ApiError(400, f"tool_choice forces a tool call, which {param} would constrain too: give one of "
                                f"tool_choice ('required' or a named function) and {param}", param="tool_choice")
        try:
            spec = forced or constraint_from_body(body)
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

    def params(self, body: dict, prompt_tokens: int, fields: dict | None = None) -> list[SamplingParams]:
        """The sampling parameters of each of the body's `n` choices (seeds seed, seed + 1, ...); without
        max_tokens a choice may fill the context."""
        n = choice_count(body)
        fields = {k: v for k, v in (body if fields is None else fields).items() if k in sampling_fields() and k != "n"}
        if fields.get("max_tokens") is None and fields.get("max_completion_tokens") is None:
            room = self.max_len - prompt_tokens
            if room < 1:
                raise ApiError(400, f"the prompt ({prompt_tokens} tokens) fills the model's context of "
                                    f"{self.max_len} tokens", param="messages")
            fields["max_tokens"] = room
        try:
            params = SamplingParams.from_dict(fields)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        seeds = [None if params.seed is None else (params.seed + i) % SEED_LIMIT for i in range(n)]
        return [dataclasses.replace(params, seed=s) for s in seeds]

    @staticmethod
    def chat_options(body: dict) -> tuple[bool, str | None, list[dict]]:
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
        try:
            tools = normalize_tools(body.get("tools"))
        except ValueError as e:
            raise ApiError(400, str(e), param="tools") from None
        choice = OpenAIRequests.tool_choice(body, tools)
        return thinking, effort, [] if choice == "none" else tools

    @staticmethod
    def tool_choice(body: dict, tools: list[dict]) -> str:
        """A chat body's `tool_choice`, checked against its tools: 'auto', 'none', 'required' (some tool must
        be called), or the name of the function that must be called."""
        choice = body.get("tool_choice")
        if choice in (None, "auto", "none", "required"):
            if choice == "required" and not tools:
                raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")
            return choice or "auto"
        fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ApiError(400, "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                                f"\"function\": {{\"name\": ...}}}}, got {json.dumps(choice)[:80]}",
                           param="tool_choice")
        if name not in {t["name"] for t in tools}:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the request's tools "
                                f"({', '.join(t['name'] for t in tools) or 'none given'})", param="tool_choice")
        return name

    def forced_tool_calls(self, body: dict, tools: list[dict]) -> ConstraintSpec | None:
        """The constraint that makes a reply a tool call in the chat format, as `tool_choice` forces (one of
        `tools` for 'required', at most one call unless `parallel_tool_calls`), or None when it forces none."""
        choice = self.tool_choice(body, tools)
        if choice in ("auto", "none"):
            return None
        if self.fmt.tool_call_grammar is None:
            raise ApiError(400, f"this model's chat format ({self.fmt.name}) has no tool-call syntax to force: "
                                "send tool_choice 'auto'", param="tool_choice")
        chosen = tools if choice == "required" else [t for t in tools if t["name"] == choice]
        try:
            grammar = self.fmt.tool_call_grammar(chosen, body.get("parallel_tool_calls") is not False)
        except ValueError as e:
            raise ApiError(400, str(e), param="tools") from None
        return ConstraintSpec.grammar(grammar)

    # ---- responses ----------------------------------------------------------------------------------------
    @staticmethod
    def usage(prompt_tokens: int, outputs: Sequence[RequestOutput | None], generated: int = 0) -> dict:
        """A usage object: the finished `outputs`' tokens (None: a choice not finished) plus `generated` more,
        and the prompt tokens served from the prefix cache (`prompt_tokens_details.cached_tokens`, OpenAI's and
        vLLM's field: per prompt, its choice that took the most)."""
        finished = [o for o in outputs if o is not None]
        done = generated + sum(len(o.token_ids) for o in finished)
        cached: dict[tuple[int, ...], int] = {}
        for o in finished:
            key = tuple(o.prompt_ids)
            cached[key] = max(cached.get(key, 0), o.cached_tokens)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    def completion_body(self, rid: str, created: int, model: str, outputs: Sequence[RequestOutput],
                        prepared: Prepared) -> dict:
        """A `text_completion` body of finished choices (with `echo`: each text and its logprobs start with the
        prompt's)."""
        if prepared.prompt_only:
            outputs = [dataclasses.replace(o, token_ids=[], text="", logprobs=None if o.logprobs is None else [])
                       for o in outputs]
        choices = []
        for i, o in enumerate(outputs):
            echoed = prepared.echo[i] if prepared.echo is not None else ""
            logprobs = None
            if o.logprobs is not None:
                logprobs = self.completion_logprobs((o.prompt_logprobs or []) + o.logprobs, o.prompt_ids)
            choices.append({"index": i, "text": echoed + o.text, "finish_reason": o.finish_reason,
                            "logprobs": logprobs})
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": self.usage(prepared.prompt_tokens, outputs)}

    def chat_body(self, rid: str, created: int, model: str, outputs: Sequence[RequestOutput], prompt_tokens: int,
                  thinking: bool, forced: bool = False) -> dict:
        """A `chat.completion` body of finished choices: each reply parsed into content, reasoning and tool
        calls by the chat format (`forced`: a call `tool_choice` forced)."""
        choices = []
        for i, o in enumerate(outputs):
            reply = self.fmt.parse(o.text, thinking, forced)
            message = {"role": "assistant", "content": reply.content}
            if reply.reasoning is not None:
                message["reasoning_content"] = reply.reasoning
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            choices.append({"index": i, "message": message, "finish_reason": self.finish(o, reply),
                            "logprobs": {"content": self.chat_logprobs(o.logprobs)} if o.logprobs is not None
                            else None})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": self.usage(prompt_tokens, outputs)}

    @staticmethod
    def finish(output: RequestOutput, reply: Reply) -> str:
        return "tool_calls" if reply.tool_calls and output.finish_reason == "stop" else output.finish_reason

    def chat_logprobs(self, logprobs: Sequence[TokenLogprob]) -> list[dict]:
        def entry(token, lp):
            text = self.decode([token])
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]

    def completion_logprobs(self, logprobs: Sequence[TokenLogprob | None], prompt: Sequence[int] = (),
                            start: int = 0) -> dict:
        """The legacy completions `logprobs` object of `logprobs` (an echoed prompt's first entry is None: its
        token is `prompt[0]`), the text offsets counted from `start`."""
        tokens = [self.decode([prompt[0] if lp is None else lp.token]) for lp in logprobs]
        offsets, at = [], start
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
                "top_logprobs": [None if lp is None else {self.decode([t]): v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}
