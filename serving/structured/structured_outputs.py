"""The engine's structured outputs: the constraint compiler over the model's tokenizer, each constrained request's
grammar state (closed within its `max_tokens` by the close policy), the token masks of a step's rows, the
matchers' advance over emitted tokens, and whether constrained requests jump forward over forced tokens; with
the time all of it takes and how much of it the device may have waited for (`stats`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import jax
import llguidance as llg
import numpy as np
from jaxtyping import Int

from model.api import Model
from serving.structured.constraints import ConstraintCompiler, ConstraintSpec, grammar_tokenizer
from serving.base.engine_config import ClosePolicy
from serving.structured.grammar_mask import MaskFill, RequestGrammar, fill_masks, speculate_masks
from serving.base.request import Row


class StructuredOutputs:
    """Constraint compilation and token masks for one engine. `close` (a `ClosePolicy`, None: the limit may cut an
    output mid-structure) and `jump_forward` may be changed between steps; `stats` is the engine's, whose grammar
    counters this updates."""

    def __init__(self, model: Model, close: ClosePolicy | None, jump_forward: bool, stats: dict):
        self.model, self.close, self.jump_forward, self.stats = model, close, jump_forward, stats
        self._compiler: ConstraintCompiler | None = None  # built with the first constrained request
        self.executor: MaskFill | None = None  # computes constrained rows' masks (llguidance's pool or serial)
        self._all_allowed: dict[tuple[int, ...], jax.Array] = {}  # bitmask of unconstrained batches, on device
        self._forward_in_flight = False  # a forward half runs while the host reads the previous step
        self._overlapped = 0.0  # commit seconds spent while a forward half ran

    def grammar(self, constraint: ConstraintSpec | None, trigger: int | None, max_tokens: int
                ) -> RequestGrammar | None:
        """A new request's grammar state for `constraint` (compiled once per distinct spec), starting after the
        token `trigger` if given and closed within `max_tokens` by `close`; None without a constraint. Raises
        ValueError for an invalid constraint."""
        if constraint is None:
            if trigger is not None:
                raise ValueError("constraint_trigger needs a constraint")
            return None
        return RequestGrammar(self.compiler().compile(constraint), trigger, max_tokens, self.close)

    def compiler(self) -> ConstraintCompiler:
        """The constraint compiler over the model's tokenizer (built on first use)."""
        if self._compiler is None:
            config = self.model.config
            if not isinstance(config.eos_token_id, int):
                raise ValueError("structured outputs need a model with an eos_token_id (a constrained output ends "
                                 "with it)")
            tokenizer = getattr(self.model, "tokenizer", None)
            if tokenizer is None:
                raise ValueError("structured outputs need the model's own tokenizer (tokenizer.json); this model "
                                 "has none")
            self._compiler = ConstraintCompiler(grammar_tokenizer(tokenizer, config.vocab_size, [config.eos_token_id]))
            self.executor = MaskFill(llg.LLExecutor())
        return self._compiler

    def bitmask(self, rows: list[Row], masks: Int[np.ndarray, "rows v words"]):
        """The step's token masks [rows, v, W]: constrained rows from their grammars (a verify row's drafts are
        taken tentatively, up to the first the grammar refuses, which the verifier will reject), the rest all
        allowed; and at the positions before a request's `min_tokens`-th token, no EOS or stop token id
        (`refuse_stops`). A batch with neither passes an all-allowed array kept on the device."""
        grammars = [row.request.grammar if row.sample else None for row in rows]
        short = any(row.sample and row.request.params.min_tokens > row.request.sampled_at_least for row in rows)
        if all(g is None for g in grammars) and not short:
            shape = masks.shape
            if shape not in self._all_allowed:
                self._all_allowed[shape] = jax.device_put(masks)
            return self._all_allowed[shape]
        start = time.perf_counter()
        num_rows, verify_len, words = masks.shape
        if all(g is None for g in grammars):
            pass  # the masks are all allowed already
        elif verify_len == 1:
            fill_masks(grammars, masks.reshape(num_rows, words), self.executor)
        else:
            speculate_masks(grammars, [row.request.drafts[:row.caps] for row in rows], masks, self.executor)
        if short:
            self.refuse_stops(rows, masks)
        self.stats["grammar_seconds"] += time.perf_counter() - start
        return masks

    def refuse_stops(self, rows: list[Row], masks: Int[np.ndarray, "rows v words"]) -> None:
        """Clear EOS (unless the request ignores it) and its stop token ids from the masks of each position at
        which a row's request would emit one of its first `min_tokens` tokens (vLLM's min_tokens). Tokens in
        flight count as one each, the fewest they emit, so a speculative row may hold its stops back a little
        longer than it needs, never shorter. A position whose constraint allows nothing else keeps them."""
        eos = self.model.config.eos_token_id
        bits = masks.view(np.uint32)
        for i, row in enumerate(rows):
            request = row.request
            p, before = request.params, request.sampled_at_least
            if not row.sample or p.min_tokens <= before:
                continue
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos or eos is None else {eos})
            stops = [t for t in stops if t < 32 * bits.shape[-1]]
            for j in range(min(bits.shape[1], p.min_tokens - before)):
                kept = bits[i, j].copy()
                for t in stops:
                    bits[i, j, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
                if not bits[i, j].any():
                    bits[i, j] = kept

    def bitmask_during_forward(self, rows: list[Row], masks: Int[np.ndarray, "rows v words"],
                               forward_done: Callable[[], bool]):
        """`bitmask` for a step whose forward half runs. Mask work the device may have waited for counts as
        exposed (`stats["grammar_exposed_seconds"]`): all of it if the forward had finished (`forward_done`)
        when the masks were ready, commits made meanwhile included."""
        filled = self.stats["grammar_seconds"]
        masks = self.bitmask(rows, masks)
        self.stats["masked_during_forward"] += 1
        if forward_done():
            self.stats["grammar_exposed_seconds"] += self.stats["grammar_seconds"] - filled + self._overlapped
        self._overlapped = 0.0
        return masks

    @contextlib.contextmanager
    def overlapping(self, forward: bool):
        """Commits within are made while a forward half runs (`forward`): `bitmask_during_forward` judges them."""
        self._forward_in_flight = forward
        try:
            yield
        finally:
            self._forward_in_flight = False

    def commit(self, grammar: RequestGrammar, tokens: list[int], accepted: int) -> int | None:
        """Move a constrained request's matcher over a row's emitted `tokens` (settling a verify row's drafts:
        `accepted` of them); None while the output is not complete, else how many of `tokens` it keeps: all when
        it took an EOS the constraint allowed, up to the token after which the constraint admits nothing more
        otherwise (one-token decoding stops there, so an EOS a verify row emitted after it is not the output's).
        Its time is exposed unless a forward half runs meanwhile (`overlapping`)."""
        start, row = time.perf_counter(), tokens
        if grammar.speculating:
            grammar.settle(accepted)
            tokens = tokens[accepted:]
        grammar.accept(tokens)
        spent = time.perf_counter() - start
        self.stats["grammar_commit_seconds"] += spent
        if self._forward_in_flight:
            self._overlapped += spent
        else:
            self.stats["grammar_exposed_seconds"] += spent
        if not grammar.finished:
            return None
        if not grammar.stopped:
            return len(row)
        return 1 + max((j for j, t in enumerate(row) if t not in grammar.eos_ids), default=-1)
