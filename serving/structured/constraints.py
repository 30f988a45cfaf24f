"""Per-request output constraints (structured outputs): what a request asks for, and its compiled grammar.

A request may constrain its output to a `regex` (full match), a `json_schema` (`json_object`: any JSON object),
a `choice` (exactly one of a list of strings) or a `grammar` (Lark as llguidance extends it; a GBNF / EBNF
grammar, `root ::= ...`, is converted). `constraint_from_body` reads one from an OpenAI-style request body
(`response_format`) or a vLLM-style one (`structured_outputs`); `ConstraintCompiler` turns it into an
llguidance grammar for the serving tokenizer, once per distinct constraint (an LRU cache, failures included),
under a source-size limit, llguidance's parser limits and a wall-clock limit, since compiling a grammar a
client wrote is a known denial-of-service vector. Invalid constraints raise `ValueError` naming the problem,
for that request only. JSON is generated compact (`,` and `:` separators, no whitespace between tokens), which
keeps small models from wandering into runs of whitespace.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance as llg
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from serving.structured.grammar_budget import TokenBytes

KINDS = ("regex", "json_schema", "choice", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": False}
# The request-body fields `constraint_from_body` reads (a server splits these off the body).
CONSTRAINT_FIELDS = frozenset({"response_format", "structured_outputs"})
_STRUCTURED_KEYS = {"regex": "regex", "json": "json_schema", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_schema"}


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
    """One request's output constraint in canonical form, so equal constraints hash equal (the compile cache
    key). `source` is the regex, the JSON Schema as compact JSON (key order kept: properties are generated in
    schema order), the choices as a JSON list, or the grammar text."""

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise ValueError(f"a {self.kind} constraint's source must be a string, got {type(self.source).__name__}")

    @classmethod
    def regex(cls, pattern: str) -> ConstraintSpec:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"regex must be a non-empty string, got {pattern!r}")
        return cls("regex", pattern)

    @classmethod
    def json_schema(cls, schema: Any) -> ConstraintSpec:
        """A JSON Schema given as an object (a Mapping) or as its JSON text; anything else is a ValueError."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON Schema is not valid JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise ValueError(f"a JSON Schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        """Any JSON object (OpenAI's `json_object` response format)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def choice(cls, choices: Sequence[str]) -> ConstraintSpec:
        ok = isinstance(choices, (list, tuple)) and choices and all(isinstance(c, str) and c for c in choices)
        if not ok:
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {choices!r}")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, text: str) -> ConstraintSpec:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"grammar must be a non-empty string (Lark, or GBNF `root ::= ...`), got {text!r}")
        return cls("grammar", text)


def constraint_from_body(body: Mapping) -> ConstraintSpec | None:
    """The output constraint of a request body, or None when it has none.

    `response_format`: `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`,
    `{"type": "json_object"}` or `{"type": "text"}` (no constraint), as in the OpenAI API.
    `structured_outputs` (vLLM): exactly one of `{"json": schema}`, `{"regex": str}`, `{"choice": [str, ...]}`,
    `{"grammar": str}` or `{"json_object": true}`. A body may use one of the two fields; JSON null means not given.
    """
    if not isinstance(body, Mapping):
        raise ValueError(f"a request body must be a JSON object, got {type(body).__name__}")
    fmt, structured = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and structured is not None:
        raise ValueError("give response_format or structured_outputs, not both")
    if fmt is not None:
        return _from_response_format(fmt)
    if structured is not None:
        return _from_structured_outputs(structured)
    return None


def _from_response_format(fmt) -> ConstraintSpec | None:
    if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
        raise ValueError(f"response_format must be an object with a string `type`, got {fmt!r}")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec.json_object()
    if kind != "json_schema":
        raise ValueError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
                         "'json_schema'")
    spec = fmt.get("json_schema")
    if not isinstance(spec, Mapping) or "schema" not in spec:
        raise ValueError('response_format type json_schema needs "json_schema": {"name": ..., "schema": {...}}')
    if not isinstance(spec.get("name", ""), str):
        raise ValueError(f"response_format json_schema.name must be a string, got {spec['name']!r}")
    return ConstraintSpec.json_schema(spec["schema"])


def _from_structured_outputs(structured) -> ConstraintSpec:
    if not isinstance(structured, Mapping):
        raise ValueError(f"structured_outputs must be an object, got {type(structured).__name__}")
    given = {k: v for k, v in structured.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_STRUCTURED_KEYS))
    if unknown:
        raise ValueError(f"unsupported structured_outputs field(s): {', '.join(unknown)}; supported: "
                         f"{', '.join(_STRUCTURED_KEYS)}")
    if len(given) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KEYS)}, got "
                         f"{sorted(given) or 'none'}")
    (key, value), = given.items()
    if key == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
        return ConstraintSpec.json_object()
    return getattr(ConstraintSpec, _STRUCTURED_KEYS[key])(value)


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> llg.LLTokenizer:
    """llguidance's view of the serving tokenizer, built once per engine: the model's own (an object with a
    `tokenizers.Tokenizer` as `.tokenizer`, e.g. `model.tokenizer`), over the model's `vocab_size` ids (ids past
    the tokenizer's are never allowed); `eos_ids` end a constrained output."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is None or not hasattr(inner, "to_str"):
        raise ValueError("structured outputs need the model's own tokenizer (tokenizer.json); this model has "
                         f"{type(tokenizer).__name__}")
    eos = [int(t) for t in eos_ids]
    if not eos or not all(0 <= t < vocab_size for t in eos):
        raise ValueError(f"eos_ids must be a non-empty list of ids in [0, {vocab_size}), got {list(eos_ids)!r}")
    own = inner.get_vocab_size(with_added_tokens=True)
    if own > vocab_size:
        raise ValueError(f"the tokenizer has {own} ids, more than the model's vocab_size={vocab_size}")
    return llg.LLTokenizer(inner.to_str(), n_vocab=vocab_size, eos_token=eos)


@dataclasses.dataclass(frozen=True)
class CompiledConstraint:
    """A compiled constraint: a validated llguidance matcher in its start state, never advanced itself; each
    request decodes with its own copy (`new_matcher`), which shares the compiled grammar."""

    spec: ConstraintSpec = dataclasses.field(repr=False)
    prototype: llg.LLMatcher
    vocab_size: int
    eos_ids: tuple[int, ...]
    token_bytes: TokenBytes = dataclasses.field(repr=False)  # the tokenizer's bytes, for close mode

    def new_matcher(self) -> llg.LLMatcher:
        return self.prototype.deep_copy()


class ConstraintCompiler:
    """Compiles constraint specs for one tokenizer, each distinct spec once.

    Args: `tokenizer` from `grammar_tokenizer`; `cache_size` compiled (or refused) specs kept, least recently
    used first out; `timeout_s` wall-clock limit of one compilation (it runs on a worker thread, which
    llguidance's parser limits bound in turn); `max_source_bytes` of a spec's source; `max_grammar_symbols`
    llguidance's grammar size limit. Thread-safe: a server may compile from several threads.
    """

    def __init__(self, tokenizer: llg.LLTokenizer, *, cache_size: int = 256, timeout_s: float = 10.0,
                 max_source_bytes: int = 256 * 1024, max_grammar_symbols: int = 200_000, threads: int = 2):
        if cache_size < 1 or timeout_s <= 0 or max_source_bytes < 1 or max_grammar_symbols < 1 or threads < 1:
            raise ValueError("cache_size, max_source_bytes, max_grammar_symbols and threads must be >= 1 and "
                             "timeout_s > 0")
        self.tokenizer, self.vocab_size = tokenizer, tokenizer.vocab_size
        self.eos_ids = tuple(tokenizer.eos_tokens)
        self.token_bytes = TokenBytes.of(tokenizer)
        self.timeout_s, self.max_source_bytes = timeout_s, max_source_bytes
        self.limits = llg.LLParserLimits(max_grammar_size=max_grammar_symbols, verbose_errors=False)
        self._cache: collections.OrderedDict[ConstraintSpec, CompiledConstraint | str] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="constraint-compile")

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """The compiled constraint (from the cache when seen before); ValueError if it is invalid, too large or
        too slow to compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        if hit is None:
            hit = self._compile_uncached(spec)
            with self._lock:
                self._cache[spec] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise ValueError(hit)
        return hit

    def _compile_uncached(self, spec: ConstraintSpec) -> CompiledConstraint | str:
        """The compiled constraint, or the error message that refuses it (cached like a success)."""
        size = len(spec.source.encode("utf-8"))
        if size > self.max_source_bytes:
            return f"the {spec.kind} constraint is {size} bytes, over the limit of {self.max_source_bytes}"
        try:
            grammar = _llguidance_grammar(spec)
        except ValueError as e:
            return str(e)
        future = self._pool.submit(self._build, grammar)
        try:
            matcher, error = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            return f"compiling the {spec.kind} constraint took over {self.timeout_s:g} s; simplify it"
        if error:
            what = {"json_schema": "JSON Schema", "choice": "choice list"}.get(spec.kind, spec.kind)
            return f"invalid {what}: {error.strip()}"
        return CompiledConstraint(spec, matcher, self.vocab_size, self.eos_ids, self.token_bytes)

    def _build(self, grammar: str) -> tuple[llg.LLMatcher, str]:
        """Build and validate the start-state matcher; computing its first mask builds the lexer now, at compile
        time, and shows a constraint that no token sequence can satisfy."""
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            return matcher, matcher.get_error()
        first = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        if matcher.is_error():
            return matcher, matcher.get_error()
        if not first.any():
            return matcher, "no token of the vocabulary can start an output it allows"
        return matcher, ""


def _llguidance_grammar(spec: ConstraintSpec) -> str:
    """The llguidance grammar (its JSON form) of a spec; ValueError for a grammar the converter refuses."""
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)
    if spec.kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec.source)))
    try:
        return llg.LLMatcher.grammar_from_lark(any_to_lark(spec.source))
    except Exception as e:  # the GBNF converter raises its own error types on malformed input
        raise ValueError(f"invalid grammar: {e}") from None
