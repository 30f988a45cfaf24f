"""Continuous batching: which requests run in the next step, in which rows, with which pages.

Every iteration runs the decode rows of all running requests, then fills the remaining token budget with
prefill chunks (continuing prompts first, then newly admitted requests, FIFO). When a running request
needs a page and none is free, unlocked prefix-cache pages are evicted first (least recently used), then the
most recently admitted request is preempted: its slot and pages are freed and it recomputes its prompt and
generated tokens later (randomness is keyed by position, so its continuation does not change). With a prefix
cache (`serving.prefix.prefix_admission`) an admitted request adopts the pages of its prompt's cached prefix and
prefills only from shortly before the hit's end.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from serving.base.kv_cache import CacheLayout, PageAllocator
from serving.prefix.prefix_admission import PrefixAdmission
from serving.base.request import Request, Row, Status
from serving.core.step import COUNTED, PROMPT, RECOMPUTED


class NeedsFlush(Exception):
    """Preemption is needed but some results are still in flight: read them first."""


class Scheduler:
    """Queues, slots and pages of the engine (host side)."""

    def __init__(self, layout: CacheLayout, prefill_chunk: int, token_budget: int, max_prefill_rows: int,
                 fixed_chunks: bool, num_drafts: int = 0, pages: PageAllocator | None = None,
                 prefix: PrefixAdmission | None = None):
        self.layout, self.pages, self.prefix = layout, pages or PageAllocator(layout), prefix
        self.prefill_chunk, self.token_budget = prefill_chunk, token_budget
        self.max_prefill_rows, self.fixed_chunks, self.num_drafts = max_prefill_rows, fixed_chunks, num_drafts
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free_slots = list(range(layout.max_slots - 1, -1, -1))
        self.scored_chunk: int | None = None  # a prompt-logprob request's chunk cap (bounded replay's keep)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def release(self, request: Request) -> None:
        """Free a finished (or cancelled) request's slot and pages (their full pages go to the prefix cache)."""
        if request.slot is not None:
            if self.prefix is not None:
                self.prefix.finished(request)
            self.pages.release(request.slot)
            self.free_slots.append(request.slot)
            request.slot = None
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def schedule(self, in_flight: bool) -> tuple[list[Row], list[Row]]:
        """(decode rows, prefill rows) of the next iteration. Raises NeedsFlush if a preemption is needed
        while results are in flight.

        When every running request is a prompt partly prefilled that the pool has no pages left to continue
        (several of them took the pool between them), none of them would ever give a page back: the latest
        arrival is preempted, as a decode row short of a page preempts one, until one of them can go on."""
        if self.prefix is not None:
            self.prefix.flush()
        decode, prefill = self._rows(in_flight)
        while not decode and not prefill and len(self.running) > 1:
            if in_flight:
                raise NeedsFlush
            self._preempt(max(self.running, key=lambda r: r.arrival))
            decode, prefill = self._rows(in_flight)
        return decode, prefill

    def _rows(self, in_flight: bool) -> tuple[list[Row], list[Row]]:
        decode: list[Row] = []
        for request in list(self.running):
            if request.status is not Status.RUNNING or request.prefilling:
                continue
            if request.sampled_at_least >= request.params.max_tokens:
                continue  # its last token is in flight
            last = request.last_position_at_most
            # drafts worth verifying: all of them and the bonus token stay within max_tokens and max_len
            caps = max(0, min(self.num_drafts, request.params.max_tokens - request.sampled_at_least - 1,
                              self.layout.max_len - 1 - last))
            if not self._ensure_pages(request, last + caps + 1, in_flight):
                continue  # it was preempted itself
            decode.append(Row(request, [0], last, True, False, True, [COUNTED], caps))
        decode = [row for row in decode if row.request.status is Status.RUNNING]  # drop preempted ones
        for row in decode:
            row.frozen = self.pages.frozen_tokens(row.request.slot)
        budget = self.token_budget - len(decode)
        prefill: list[Row] = []
        for request in [r for r in self.running if r.status is Status.RUNNING and r.prefilling]:
            if budget <= 0 or len(prefill) >= self.max_prefill_rows:
                break
            row = self._chunk(request, budget)
            if row is not None:
                prefill.append(row)
                budget -= len(row.tokens)
        while self.waiting and self.free_slots and budget > 0 and len(prefill) < self.max_prefill_rows:
            request = self.waiting.popleft()
            request.slot, request.status, request.fresh_slot = self.take_slot(request), Status.RUNNING, True
            if self.prefix is not None:
                self.prefix.admit(request)
            self.running.append(request)
            row = self._chunk(request, budget)
            if row is None:  # the pool could not give even this chunk's pages: back to the queue
                self._requeue(request, Status.WAITING)
                break
            if self.prefix is not None:
                self.prefix.confirm(request)
            prefill.append(row)
            budget -= len(row.tokens)
        return decode, prefill

    def competes(self, victim: Request, request: Request) -> bool:
        """Whether preempting `victim` can free pages for `request` (one pool: always; per-rank pools: same rank)."""
        return True

    def take_slot(self, request: Request) -> int:
        """A free slot for `request` (the data-parallel engine picks a rank by its cache and load)."""
        return self.free_slots.pop()

    def take_handoff(self, request: Request) -> list[int] | None:
        """A slot (`request.slot`) and pages for `request`, its first `request.computed` tokens computed by another
        engine (`Engine.import_slot`): the new pages, or None (nothing taken) when no slot or too few pages are
        free."""
        if not self.free_slots:
            return None
        slot = self.take_slot(request)
        new = self.pages.grow(slot, request.computed)
        if new is None:
            self.free_slots.append(slot)
            return None
        request.slot = slot
        return new

    def prefix_cache(self, build: Callable[[PageAllocator, int], PrefixAdmission]) -> PrefixAdmission:
        """The engine's prefix cache: `build(pages, shares)` makes one over `pages` holding a `shares`-th of the
        host tier and snapshots (here the whole pool, one share; a data-parallel engine one per rank)."""
        return build(self.pages, 1)

    ranks = 1  # attention ranks the slots are split over (`serving.core.engine_dp`); one device is a mesh of one rank

    def rank(self, request: Request) -> int:
        """The attention rank whose slots and pages `request` holds."""
        return 0

    def rows_per_rank(self, rows: list[Row]) -> int:
        """The most rows any one rank runs in a step of `rows`."""
        return int(np.bincount([self.rank(row.request) for row in rows], minlength=self.ranks).max())

    def _requeue(self, request: Request, status: Status) -> None:
        """Take the request's slot and pages (caching nothing) and queue it first, to compute from the start."""
        if self.prefix is not None:
            self.prefix.dropped(request)
        self.pages.release(request.slot)
        self.free_slots.append(request.slot)
        self.running.remove(request)
        request.slot, request.status, request.computed, request.counted_outputs = None, status, 0, 0
        request.restore = None  # a partial hand-off's pages are gone: it computes from the start
        self.waiting.appendleft(request)

    def _chunk(self, request: Request, budget: int) -> Row | None:
        """The next prefill chunk of `request` within `budget` tokens (None: no pages for it)."""
        sequence = request.sequence
        size = min(self.prefill_chunk, len(sequence) - request.computed)
        if request.prompt_logprobs is not None and self.scored_chunk:  # every position through the replay layers
            size = min(size, self.scored_chunk)
        if not self.fixed_chunks:
            size = min(size, budget)
        elif size > budget:
            return None
        start = request.computed
        if self.pages.grow(request.slot, start + size) is None:
            return None
        counted = len(request.prompt) + request.counted_outputs
        kinds = [PROMPT if i < len(request.prompt) else COUNTED if i < counted else RECOMPUTED
                 for i in range(start, start + size)]
        # a jump-forward row (outputs already counted) continues decoding: no replay bound (`serving.core.step`)
        row = Row(request, sequence[start:start + size], start, False, request.fresh_slot,
                  start + size == len(sequence), kinds, frozen=self.pages.frozen_tokens(request.slot),
                  prompt_end=0 if request.counted_outputs else len(sequence),
                  restore=self._restore(request))
        request.fresh_slot, request.restore = False, None
        if row.sample and self.prefix is not None:
            self.prefix.prefilled(request)
        return row

    def _restore(self, request: Request) -> list | None:
        """The window state the first chunk of `request` in its slot starts from: a partial hand-off's, a prefix
        hit's snapshot, or None."""
        if request.restore is not None or self.prefix is None or not request.fresh_slot:
            return request.restore
        return self.prefix.restore(request)

    def _ensure_pages(self, request: Request, tokens: int, in_flight: bool) -> bool:
        """Pages for `tokens` tokens of a running request, preempting later arrivals if the pool is short.
        False if `request` itself had to be preempted."""
        while self.pages.grow(request.slot, tokens) is None:
            victims = [r for r in self.running if r is not request and r.status is Status.RUNNING
                       and self.competes(r, request)]
            victim = max(victims, key=lambda r: r.arrival) if victims else request
            if in_flight:
                raise NeedsFlush
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free the request's slot and pages; it will recompute prompt + generated tokens."""
        self._requeue(request, Status.PREEMPTED)
        request.replay_outputs = len(request.output)
        request.in_flight.clear()
        request.preemptions += 1

    def block_table(self, request: Request) -> list[int]:
        return self.pages.table(request.slot)
