"""A request's life in the engine: its tokens, state, results and stop conditions (host side)."""

from __future__ import annotations

import collections
import dataclasses
import enum
import time
from collections.abc import Callable

from serving.base.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued
    PREEMPTED = "preempted"  # lost its slot and pages; queued to recompute its tokens
    RUNNING = "running"  # holds a slot and pages
    FINISHED = "finished"


@dataclasses.dataclass
class TokenLogprob:
    """The chosen token's logprob and the top alternatives (raw model distribution; for a constrained request,
    renormalised over the tokens its constraint allows at that position)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class RequestOutput:
    """What a finished request returns."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS, stop token or string, a complete constrained output), "length", "cancelled"
    logprobs: list[TokenLogprob] | None
    preemptions: int
    time_to_first_token: float | None
    latency: float
    logits: list | None = None  # per generated token, when the engine keeps logits (tests)
    cached_tokens: int = 0  # prompt tokens its (last) admission took from the prefix cache instead of prefilling
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first None), when asked


@dataclasses.dataclass
class Request:
    """Engine-side request state. `computed` counts tokens of `sequence` already in the slot's cache;
    `in_flight` holds, per dispatched step whose results the host has not read yet, the most tokens it may
    emit for this request (1, or 1 + drafts under verification: at least one of them is emitted)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    slot: int | None = None
    computed: int = 0
    replay_outputs: int = 0  # generated tokens to recompute after a preemption
    in_flight: collections.deque = dataclasses.field(default_factory=collections.deque)
    fresh_slot: bool = False
    finish_reason: str | None = None
    preemptions: int = 0
    first_token_time: float | None = None
    text: str | None = None
    logits: list | None = None
    engram_history: object = None  # V4.1: the canonical ids before the next token (host n-gram hashing)
    drafts: list[int] = dataclasses.field(default_factory=list)  # the slot's drafted block, as last read
    confidence: list[float] = dataclasses.field(default_factory=list)  # and its confidences
    prior_confidence: list[float] = dataclasses.field(default_factory=list)  # those of the block before it
    drafts_fresh: bool = True  # the slot's block was drafted by the request's last step (not a no-draft one)
    grammar: object = None  # a constrained request's `serving.structured.grammar_mask.RequestGrammar`, following `output`
    constraint: object = None  # and its `serving.structured.constraints.ConstraintSpec`
    counted_outputs: int = 0  # outputs in the slot's penalty counts already (a jump-forward row replays them)
    cached_tokens: int = 0  # prompt tokens its last admission took from the prefix cache (not prefilled)
    prompt_logprobs: list | None = None  # params.prompt_logprobs set: per prompt token `serving.prefix.prompt_logprobs`
    restore: list | None = None  # a partial hand-off's window state, which its first chunk starts from

    @property
    def sequence(self) -> list[int]:
        """Tokens whose state must be in the cache before the next token is sampled."""
        return self.prompt + self.output[: self.replay_outputs]

    @property
    def sampled_at_least(self) -> int:
        """Tokens sampled once every in-flight step is read, at least (each emits one or more)."""
        return len(self.output) + len(self.in_flight)

    @property
    def last_position_at_most(self) -> int:
        """The highest position the slot's last token can have once every in-flight step is read."""
        return len(self.prompt) + len(self.output) + sum(self.in_flight) - 1

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.sequence)

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason

    def accept(self, token: int, logprob: TokenLogprob | None, eos: int | None,
               detokenize: Callable[[list[int]], str] | None) -> None:
        """Record a sampled token and apply the stop conditions (EOS / stop ids, stop strings, max tokens); none
        but max tokens before `min_tokens` tokens, and a stop string only where it starts after their text (the
        step's token masks keep EOS and the stop ids out before then: `serving.structured.structured_outputs`)."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        p = self.params
        if len(self.output) <= p.min_tokens:
            pass  # within the first min_tokens tokens: nothing stops the output
        elif token in p.stop_token_ids or (token == eos and not p.ignore_eos):
            self.finish("stop")
        elif p.stop and detokenize is not None and self._stop_in_tail(detokenize):
            text = detokenize(self.output)
            start = len(detokenize(self.output[:p.min_tokens])) if p.min_tokens else 0
            hits = [text.find(s, start) for s in p.stop if s in text[start:]]
            if hits:
                self.text = text[: min(hits)]
                self.finish("stop")
        if self.status is not Status.FINISHED and len(self.output) >= p.max_tokens:
            self.finish("length")

    def _stop_in_tail(self, detokenize: Callable[[list[int]], str]) -> bool:
        """Whether a stop string shows in the text of the newest tokens: a stop string of L characters that
        ends in the newest token spans at most 4L bytes, so at most 4L + 4 tokens (one more each side for a
        character split between tokens). Decoding only this tail keeps each check independent of the output
        length; a hit is then confirmed on the whole text."""
        tail = 4 * max(len(s) for s in self.params.stop) + 4
        text = detokenize(self.output[-tail:])
        return any(s in text for s in self.params.stop)

    def result(self, detokenize: Callable[[list[int]], str] | None) -> RequestOutput:
        now = time.perf_counter()
        text = self.text if self.text is not None else detokenize(self.output) if detokenize else None
        return RequestOutput(
            request_id=self.request_id, prompt_ids=list(self.prompt), token_ids=list(self.output), text=text,
            finish_reason=self.finish_reason or "cancelled",
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            preemptions=self.preemptions,
            time_to_first_token=None if self.first_token_time is None else self.first_token_time - self.arrival,
            latency=now - self.arrival, logits=self.logits, cached_tokens=self.cached_tokens,
            prompt_logprobs=self.asked_prompt_logprobs())

    def asked_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs with the alternatives the request asked for (the engine computes all it keeps)."""
        n = self.params.prompt_logprobs
        if n is None or self.prompt_logprobs is None:
            return None
        return [None if e is None else TokenLogprob(e.token, e.logprob, e.top[:n]) for e in self.prompt_logprobs]


@dataclasses.dataclass
class Row:
    """One request's part of a step."""

    request: Request
    tokens: list[int]
    start: int
    from_prev: bool
    reset: bool
    sample: bool
    kinds: list[int]
    caps: int = 0  # a decode row: the most drafts it may verify
    frozen: int = 0  # tokens at the sequence start in shared pages (the step writes none of them)
    prompt_end: int = 0  # a (re)prefill row: where its sequence ends, which bounded replay counts back from
    restore: object = None  # a prefix hit's window-state snapshot, installed in the slot before the row runs
