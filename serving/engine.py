"""The serving engine: continuous batching over ahead-of-time compiled steps, with zero-overhead scheduling.

Each iteration dispatches a decode step (every running request, one token) and a prefill step (chunks of
prompts), then reads the results of the previous iteration: the host prepares step N+1 while the device
still runs step N, and decode inputs come from the device (the slot's last sampled token). Steps are
compiled once per static bucket at start-up; an iteration never compiles.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Callable, Sequence

import jax
import numpy as np

from model.api import Model
from serving.kv_cache import CacheLayout, init_engine_cache
from serving.request import Request, RequestOutput, Status, TokenLogprob
from serving.sampling import SamplingBatch, SamplingParams
from serving.scheduler import NeedsFlush, Row, Scheduler
from serving.step import COUNTED, StepBatch, build_step, compile_step, empty_batch

MAX_TOP_LOGPROBS = 20


def powers_of_two(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `limit` (which is added if not a power of two)."""
    out = [1 << i for i in range(limit.bit_length()) if 1 << i < limit]
    return tuple(out + [limit])


class Engine:
    """Offline / online generation over one model.

    Args: `max_slots` concurrent requests; `max_len` tokens per request (prompt + output); `num_pages` of
    `page_tokens` tokens in the shared compressed-KV pool (default: enough for every slot at `max_len`);
    `prefill_chunk` tokens per prefill row, `max_prefill_rows` prefill rows per step, `token_budget`
    tokens per iteration; `batch_invariant`: one bucket per step kind and budget-independent chunking,
    so a request's numbers never depend on what else runs; `zero_overhead`: read step N after dispatching
    step N+1; `num_top_logprobs` top alternatives computed per token; `return_logits` keeps the last
    position's logits of every row (tests); `detokenize` turns token ids into text (stop strings).
    """

    def __init__(self, model: Model, *, max_slots: int = 8, max_len: int = 1024, num_pages: int | None = None,
                 page_tokens: int | None = None, prefill_chunk: int = 64, max_prefill_rows: int = 2,
                 token_budget: int | None = None, batch_invariant: bool = False, zero_overhead: bool = True,
                 num_top_logprobs: int = 5, return_logits: bool = False, seed: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None, backtrack: int = 0):
        if not 0 <= num_top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"num_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        self.model, self.config = model, model.config
        self.layout = CacheLayout.for_model(self.config, max_slots, max_len, num_pages, page_tokens, backtrack)
        self.prefill_chunk = prefill_chunk
        # Engram hashes a decode row's input token on the host, so the host must have read the previous
        # step: zero-overhead scheduling is off for Engram models (device-side hashing would lift this).
        self.engram = model.engram
        self.batch_invariant, self.zero_overhead = batch_invariant, zero_overhead and self.engram is None
        self.num_top, self.return_logits, self.detokenize = num_top_logprobs, return_logits, detokenize
        budget = token_budget or max_slots + max_prefill_rows * prefill_chunk
        self.scheduler = Scheduler(self.layout, prefill_chunk, budget, max_prefill_rows, batch_invariant)
        self.decode_rows = (max_slots,) if batch_invariant else powers_of_two(max_slots)
        self.prefill_rows = (max_prefill_rows,) if batch_invariant else powers_of_two(max_prefill_rows)
        self.prefill_tokens = (prefill_chunk,) if batch_invariant else tuple(
            t for t in (8, 32, 128, 512) if t < prefill_chunk) + (prefill_chunk,)
        module = model.module()
        self.cache = init_engine_cache(module, self.layout)
        self.weights = jax.tree.leaves(model.params)  # what the compiled steps take (flattened once)
        empty = module.init_cache(1, self.layout.pages_per_slot * self.layout.page_tokens, self.layout.ring)
        self._step_fn = build_step(model.graphdef, jax.tree.structure(model.params), empty["layers"],
                                   self.layout.page_tokens, num_top_logprobs, return_logits)
        self.compiled: dict[tuple[int, int, int], Callable] = {}
        self.requests: dict[str, Request] = {}
        self.pending: list[tuple[list[Row], object]] = []
        self._cancelled: list[RequestOutput] = []
        self._seeds = np.random.default_rng(seed)
        self._ids = itertools.count()
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0}

    # ---- compilation --------------------------------------------------------------------------------------
    def buckets(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens, verify length) shape the engine may run."""
        return sorted({(r, 1, 1) for r in self.decode_rows}
                      | {(r, t, 1) for r in self.prefill_rows for t in self.prefill_tokens})

    def warmup(self) -> None:
        """Compile every bucket ahead of time (afterwards no step ever compiles)."""
        for bucket in self.buckets():
            self._executable(bucket)

    def _executable(self, bucket: tuple[int, int, int]):
        if bucket not in self.compiled:
            self.compiled[bucket] = compile_step(self._step_fn, self.weights, self.cache,
                                                 empty_batch(self.layout, *bucket, self._engram_shapes()))
        return self.compiled[bucket]

    def _engram_shapes(self) -> tuple:
        if self.engram is None:
            return ()
        return tuple((self.engram.hasher.n_lookups, table.head_dim) for table in self.engram.tables)

    # ---- requests -----------------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; raises ValueError (and keeps nothing) if the prompt or parameters cannot run."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        if len(prompt) + params.max_tokens > self.layout.max_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"engine's max_len={self.layout.max_len}")
        if params.logprobs is not None and params.logprobs > self.num_top:
            raise ValueError(f"logprobs={params.logprobs} exceeds the engine's num_top_logprobs={self.num_top}")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.seed is None:
            params = dataclasses.replace(params, seed=int(self._seeds.integers(0, 2**63 - 1)))
        request = Request(request_id, prompt, params)
        if self.engram is not None:
            request.engram_history = self.engram.empty_history(1)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def cancel(self, request_id: str) -> None:
        """Stop a request; its result has finish_reason 'cancelled'."""
        request = self.requests[request_id]
        if request.status is not Status.FINISHED:
            request.finish("cancelled")
            self.scheduler.release(request)
            self._cancelled.append(request.result(self.detokenize))

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.pending or self._cancelled)

    # ---- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: dispatch the next steps, then read the previous ones; returns requests finished."""
        try:
            decode, prefill = self.scheduler.schedule(in_flight=bool(self.pending))
        except NeedsFlush:
            finished = self._read(self.pending)
            self.pending = []
            decode, prefill = self.scheduler.schedule(in_flight=False)
        else:
            finished = []
        finished, self._cancelled = finished + self._cancelled, []
        dispatched = [self._dispatch(decode, self.decode_rows, 1)] if decode else []
        if prefill:
            width = next(t for t in self.prefill_tokens if t >= max(len(r.tokens) for r in prefill))
            dispatched.append(self._dispatch(prefill, self.prefill_rows, width))
        if self.zero_overhead:
            finished += self._read(self.pending)
            self.pending = dispatched
        else:
            finished += self._read(dispatched)
        return finished

    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; results by request id."""
        results = {}
        while self.has_work:
            for output in self.step():
                results[output.request_id] = output
        return results

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None
                 = None) -> list[RequestOutput]:
        """Run a batch of prompts to completion; results in prompt order."""
        params = params if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, q) for p, q in zip(prompts, params)]
        results = self.run()
        return [results[i] for i in ids]

    def _dispatch(self, rows: list[Row], row_buckets: tuple[int, ...], width: int):
        """Build the batch of a bucket, launch its compiled step (async) and do the host bookkeeping."""
        bucket_rows = next(r for r in row_buckets if r >= len(rows))
        batch = self._batch(rows, bucket_rows, width)
        outputs, self.cache = self._executable((bucket_rows, width, 1))(self.weights, self.cache, batch)
        for row in rows:
            request = row.request
            if row.kinds == [COUNTED]:  # a decode row
                request.dispatched += 1
                self.stats["decode_tokens"] += 1
            else:
                request.computed += len(row.tokens)
                request.dispatched += row.sample
                self.stats["prefill_tokens"] += len(row.tokens)
        self.stats["steps"] += 1
        jax.tree.map(lambda x: x.copy_to_host_async(), outputs)
        return rows, outputs

    def _batch(self, rows: list[Row], num_rows: int, width: int) -> StepBatch:
        b = empty_batch(self.layout, num_rows, width, 1, self._engram_shapes())
        for i, row in enumerate(rows):
            n = len(row.tokens)
            if self.engram is not None:
                self._engram_row(b, i, row)
            b.tokens[i, :n], b.kinds[i, :n] = row.tokens, row.kinds
            b.slots[i], b.starts[i], b.counts[i] = row.request.slot, row.start, n
            b.from_prev[i], b.reset[i], b.sample[i, -1] = row.from_prev, row.reset, row.sample
            b.block_tables[i] = self.scheduler.block_table(row.request)
        sampling = SamplingBatch.from_params([r.request.params for r in rows], num_rows)
        return b._replace(sampling=sampling)

    def _engram_row(self, batch: StepBatch, i: int, row: Row) -> None:
        """Hash the row's tokens with its request's n-gram history (host) and gather its table rows."""
        request = row.request
        if row.from_prev:  # the host has read the previous step (zero-overhead is off): use the token
            row.tokens, row.from_prev = [request.output[-1]], False
        if row.reset:
            request.engram_history = self.engram.empty_history(1)
        rows, request.engram_history = self.engram.lookup(np.array([row.tokens]), request.engram_history)
        for layer_rows, looked_up in zip(batch.engram_rows, rows):
            layer_rows[i, :len(row.tokens)] = np.asarray(looked_up)[0]

    def _read(self, dispatched) -> list[RequestOutput]:
        """Apply the results of dispatched steps to their requests; returns those that finished."""
        finished = []
        for rows, outputs in dispatched:
            last = jax.tree.map(lambda x: np.asarray(x)[:, -1], outputs)  # v = 1: the one sampled position
            tokens, logprob, top_ids, top_lp, logits = (last.tokens, last.logprob, last.top_ids, last.top_logprobs,
                                                        last.logits)
            for i, row in enumerate(rows):
                request = row.request
                if not row.sample or request.status is Status.FINISHED:
                    continue  # a prefill chunk, or a row dispatched before its request stopped
                n = request.params.logprobs
                lp = None if n is None else TokenLogprob(
                    int(tokens[i]), float(logprob[i]), [(int(t), float(v)) for t, v in zip(top_ids[i, :n], top_lp[i, :n])])
                if self.return_logits:
                    request.logits = (request.logits or []) + [logits[i]]
                request.accept(int(tokens[i]), lp, self.config.eos_token_id, self.detokenize)
                if request.status is Status.FINISHED:
                    self.scheduler.release(request)
                    finished.append(request.result(self.detokenize))
        return finished
