"""The serving engine: continuous batching over ahead-of-time compiled steps, with zero-overhead scheduling and
speculative decoding.

Each iteration dispatches a decode step (every running request: one token, or a verify block of drafts) and a
prefill step (chunks of prompts), then reads the results of the previous iteration: the host prepares step N+1
while the device still runs step N, and decode inputs come from the device (the slot's last token, position and
drafts). Steps are compiled once per static bucket at start-up; an iteration never compiles.

Speculation (`speculation`): "none"; "fixed" verifies every drafted token (up to `num_drafts`); "dspark" lets
the verification scheduler (`serving.verify_plan`) choose the drafts per row from the drafter's confidences and
the profiled cost of each verify bucket. Verification is lossless: greedy outputs are those of plain decoding
and sampled outputs are distributed as the target's.

Prefix caching (`prefix_cache`): a request adopts the cached pages of its prompt's longest cached prefix and
prefills from the deepest window-state snapshot in it (`serving.window_snapshots`) or, without one, from shortly
before the hit's end, replaying enough tokens to rebuild its window state exactly (`serving.prefix_admission`);
evicted pages may wait in a host-memory tier.

Structured outputs (`add_request(..., constraint=)`): a constrained request's rows carry packed token masks that
the compiled step applies before sampling and verification. A mask depends on every token before it, so decode
and verify buckets are compiled in two halves (`serving.step.StepHalves`): a step with constrained rows launches
its forward half, then the host reads the previous step, fills the masks while the device runs the forward, and
launches the decide half (sampling, verification, drafting); zero-overhead scheduling carries on. (With
`jump_forward`, whose forced tokens are scheduled, and on a mesh, which runs whole steps, the host reads a
constrained request's tokens in flight before scheduling.) A verify row gets one mask per position; the
matcher takes the drafts tentatively and settles on the number the device accepted. A draft the grammar refuses
has probability 0 under its mask, so verification rejects it and draws from the residual; its row is not cut
short before it, since whether a draft is verified must not depend on the draft (a sampled row would then lose
the target's distribution). A request ends ("stop") when its constraint is complete and admits no more tokens,
or with an EOS the constraint allows. In its last tokens a constrained request's masks close the output so it
ends complete within `max_tokens` (`constraint_close`, `serving.grammar_budget`). With `jump_forward` the
tokens a constraint forces are appended without sampling (`serving.jump_forward`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import llguidance as llg
import numpy as np

from model.api import Model
from model.mtp_drafter import mtp_drafter
from model.replay import ENGINE_DEFAULT, Replay, for_engine
from serving.constraints import ConstraintCompiler, ConstraintSpec, grammar_tokenizer
from serving.grammar_budget import ClosePolicy
from serving.grammar_mask import MaskFill, RequestGrammar, fill_masks, speculate_masks
from serving.jump_forward import jump_forward
from serving.kv_cache import CacheLayout, drafter_ring, init_engine_cache
from serving.prefix_admission import DevicePages, PrefixAdmission, exact_replay_tokens
from serving.request import Request, RequestOutput, Status, TokenLogprob
from serving.sampling import SamplingBatch, SamplingParams
from serving.scheduler import NeedsFlush, Row, Scheduler
from serving.step import CompiledHalves, DrafterSpec, Forwarded, StepBatch, build_step_halves, compile_step, empty_batch
from serving.verify_plan import CostTable, monotone_in_width, plan_verify, prefix_survival
from serving.engine_dp import DataParallel

MAX_TOP_LOGPROBS = 20
SPECULATION = ("none", "fixed", "dspark")


def powers_of_two(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `limit` (which is added if not a power of two)."""
    out = [1 << i for i in range(limit.bit_length()) if 1 << i < limit]
    return tuple(out + [limit])


class _Forwarding(NamedTuple):
    """A decode / verify step whose forward half runs on the device, its decide half waiting for token masks."""

    rows: list[Row]
    bucket: tuple[int, int, int]
    batch: StepBatch
    executable: CompiledHalves
    forwarded: Forwarded


class Engine:
    """Offline / online generation over one model.

    Args: `max_slots` concurrent requests; `max_len` tokens per request (prompt + output); `num_pages` of
    `page_tokens` tokens in the shared compressed-KV pool (default: enough for every slot at `max_len`);
    `prefill_chunk` tokens per prefill row, `max_prefill_rows` prefill rows per step, `token_budget`
    tokens per iteration; `batch_invariant`: one bucket per step kind and budget-independent chunking,
    so a request's numbers never depend on what else runs; `zero_overhead`: read step N after dispatching
    step N+1; `num_top_logprobs` top alternatives computed per token; `return_logits` keeps the last
    position's logits of every row (tests); `detokenize` turns token ids into text (stop strings);
    `speculation` "none" | "fixed" | "dspark" with the model's DSpark drafter (else a V4 checkpoint's MTP
    block as a one-token drafter, `model.mtp_drafter`), verifying up to `num_drafts`
    drafts per step (default: the drafter's block size) in buckets of `verify_widths` tokens (DSpark; default
    every width 2 .. num_drafts + 1, fewer widths compile faster); `backtrack` extra window-ring slots (speculation
    needs num_drafts + 1 and takes at least that); `draft_fallback` (DSpark): when no verify budget pays, decode
    without drafting (the drafter only absorbs features) and probe with a drafting step after `probe_every`
    such steps (then after twice as many per probe that did not pay); `prefix_cache` shares the pages of
    cached prompt prefixes (default: on unless `batch_invariant`, since a hit changes how a prompt is
    chunked), replaying `prefix_replay` tokens before a hit's end (default: the exact replay,
    `exact_replay_tokens`; fewer is approximate), with up to `host_pages` evicted pages kept in host memory;
    `replay` (a `model.replay.Replay`, or None: off) bounds a V4.1 prefill's replay layers to each prompt's last
    `keep` tokens (default: compact, keep 140 or what the window and drafter rings need; off for other models);
    `prefix_snapshots`: window-state snapshots kept at page-aligned prefill chunk ends, so a prefix hit
    starts from one instead of replaying (default 8 per slot; 0: always replay; `serving.window_snapshots`);
    `constraint_close`: how constrained outputs are closed before their `max_tokens` (None: the limit may cut
    them mid-structure); `jump_forward`: a constrained request takes the tokens its grammar forces in one
    prefill row instead of sampling them one per step. `mesh` (a spec like "dp=4,ep=2", a MeshSpec or a mesh of
    `sharding.mesh.make_mesh`) splits the slots, pages and steps over attention data-parallel ranks, with the
    experts over `ep` (`serving.engine_dp`; no speculation or prefix cache); there `redundant_experts` EPLB
    slots per MoE layer and `eplb_every` (steps between rebalances, 0: never) balance the expert shards over
    a window of `eplb_window` steps.
    """

    # told about each step bucket compiled, before (seconds None) and after (e.g. a progress bar)
    on_compile: Callable[[tuple[int, int, int], float | None], None] | None = None

    def __init__(self, model: Model, *, max_slots: int = 8, max_len: int = 1024, num_pages: int | None = None,
                 page_tokens: int | None = None, prefill_chunk: int = 64, max_prefill_rows: int = 2,
                 token_budget: int | None = None, batch_invariant: bool = False, zero_overhead: bool = True,
                 num_top_logprobs: int = 5, return_logits: bool = False, seed: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None, backtrack: int = 0,
                 speculation: str = "none", num_drafts: int | None = None,
                 verify_widths: Sequence[int] | None = None, draft_fallback: bool = True, probe_every: int = 8,
                 prefix_cache: bool | None = None, prefix_replay: int | None = None, host_pages: int = 0,
                 constraint_close: ClosePolicy | None = ClosePolicy(), jump_forward: bool = False,
                 mesh=None, redundant_experts: int = 0, eplb_every: int = 0, eplb_window: int = 100,
                 replay: Replay | None = ENGINE_DEFAULT, prefix_snapshots: int | None = None):
        if not 0 <= num_top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"num_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if speculation not in SPECULATION:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION)}, got {speculation!r}")
        drafter = None if speculation == "none" else model.drafter or mtp_drafter(model.module())
        if speculation != "none" and drafter is None:
            raise ValueError(f"speculation={speculation!r} needs a model with a DSpark drafter or an MTP block "
                             "(this one has neither)")
        block = drafter.config.block_size if drafter is not None else 0
        num_drafts = block if num_drafts is None else num_drafts
        if drafter is not None and not 1 <= num_drafts <= block:
            raise ValueError(f"num_drafts must be in [1, {block}] (the drafter's block size), got {num_drafts}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.speculation, self.num_drafts = speculation, num_drafts if drafter is not None else 0
        self.draft_fallback, self.probe_every = draft_fallback and speculation == "dspark", probe_every
        self._nodraft_streak = 0  # decode steps since the last one that drafted (the no-draft fallback)
        self._probe_interval = probe_every  # doubles after each probe, back to probe_every once verifying
        self._cost_key: tuple[int, int] | None = None  # the cost-table bucket of the last decode step
        if drafter is not None:
            backtrack = max(backtrack, num_drafts + 1)
        self.model, self.config = model, model.config
        self.layout = CacheLayout.for_model(self.config, max_slots, max_len, num_pages, page_tokens, backtrack)
        self.prefill_chunk = prefill_chunk
        self.data_parallel = None
        if mesh is not None:
            if speculation != "none" or prefix_cache:
                raise ValueError("a data-parallel engine (mesh=...) runs without speculation and prefix cache")
            prefix_cache = False
            self.data_parallel = DataParallel(mesh, model, self.layout, redundant_experts=redundant_experts,
                                              eplb_every=eplb_every, eplb_window=eplb_window)
            model = self.data_parallel.model  # placed on the mesh (with EPLB: its maps and slot-stacked experts)
        elif redundant_experts or eplb_every:
            raise ValueError("EPLB (redundant_experts, eplb_every) needs a mesh with ep > 1 (mesh=...)")
        # Engram hashes a decode row's input token on the host, so the host must have read the previous
        # step: zero-overhead scheduling is off for Engram models (device-side hashing would lift this).
        self.engram = model.engram
        self.batch_invariant, self.zero_overhead = batch_invariant, zero_overhead and self.engram is None
        self.num_top, self.return_logits, self.detokenize = num_top_logprobs, return_logits, detokenize
        budget = token_budget or max_slots + max_prefill_rows * prefill_chunk
        scheduler = Scheduler if self.data_parallel is None else self.data_parallel.scheduler
        self.scheduler = scheduler(self.layout, prefill_chunk, budget, max_prefill_rows, batch_invariant,
                                   self.num_drafts)
        rows, prefill_rows = max_slots, max_prefill_rows  # a data-parallel step's buckets count rows per rank
        if self.data_parallel is not None:
            rows = self.data_parallel.layout.max_slots
            prefill_rows = min(rows, max_prefill_rows)
        self.decode_rows = (rows,) if batch_invariant else powers_of_two(rows)
        self.prefill_rows = (prefill_rows,) if batch_invariant else powers_of_two(prefill_rows)
        self.prefill_tokens = (prefill_chunk,) if batch_invariant else tuple(
            t for t in (8, 32, 128, 512) if t < prefill_chunk) + (prefill_chunk,)
        # verify bucket widths (1 + drafts): every width for DSpark, the full block for fixed speculation
        widths = tuple(sorted(set(verify_widths or range(2, self.num_drafts + 2))))
        if speculation == "dspark" and not all(2 <= w <= self.num_drafts + 1 for w in widths):
            raise ValueError(f"verify_widths {list(widths)} must lie in [2, num_drafts + 1 = {self.num_drafts + 1}]")
        self.verify_widths = {"none": (), "fixed": (self.num_drafts + 1,), "dspark": widths}[speculation]
        module = model.module()
        draft_module = drafter.module() if drafter is not None else None
        self.cache = (init_engine_cache(module, self.layout, draft_module) if self.data_parallel is None
                      else self.data_parallel.init_cache(module))
        self.replay = for_engine(self.config, replay, self.layout.ring, drafter_ring(self.cache),
                                 drafter.config.target_layer_ids if drafter is not None else ())
        self.scheduler.prefix = self._prefix_cache(prefix_cache, prefix_replay, host_pages, prefix_snapshots)
        # what the compiled steps take (flattened once)
        self.weights = (jax.tree.leaves(model.params), jax.tree.leaves(drafter.params) if drafter else [])
        empty = module.init_cache(1, self.layout.pages_per_slot * self.layout.page_tokens, self.layout.ring)
        spec = None if drafter is None else DrafterSpec(drafter.graphdef, jax.tree.structure(drafter.params),
                                                         draft_module.init_state(1), drafter.config.target_layer_ids)
        self._halves = build_step_halves(model.graphdef, jax.tree.structure(model.params), empty["layers"],
                                         self.layout.page_tokens, num_top_logprobs, return_logits, spec, self.replay)
        self.compiled: dict[tuple[int, int, int], Callable] = {}
        self.costs: CostTable | None = None  # DSpark: seconds per decode / verify bucket (`profile`)
        self._steady_since: float | None = None  # end of the last iteration that ran no prefill step
        self.requests: dict[str, Request] = {}
        self._compiler: ConstraintCompiler | None = None  # built with the first constrained request
        self.constraint_close, self.jump_forward = constraint_close, jump_forward
        self._executor: MaskFill | None = None  # computes constrained rows' masks (llguidance's pool or serial)
        self._all_allowed: dict[tuple[int, ...], jax.Array] = {}  # bitmask of unconstrained batches, on device
        self.pending: list[tuple[list[Row], object]] = []
        self._cancelled: list[RequestOutput] = []
        self._seeds = np.random.default_rng(seed)
        self._ids = itertools.count()
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "decode_rows": 0, "verified": 0,
                      "accepted": 0, "verified_at": np.zeros(self.num_drafts, np.int64),
                      "accepted_at": np.zeros(self.num_drafts, np.int64), "calibration_abs": 0.0,
                      "calibration_n": 0, "nodraft_steps": 0, "grammar_seconds": 0.0,  # filling masks
                      "grammar_commit_seconds": 0.0, "grammar_exposed_seconds": 0.0,  # the device may wait for
                      "masked_during_forward": 0}  # decode steps whose masks were filled while the forward ran
        self._forward_in_flight = False  # a forward half runs while the host reads the previous step
        self._overlapped = 0.0  # commit seconds spent while a forward half ran

    # ---- compilation --------------------------------------------------------------------------------------
    def buckets(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens, verify length) shape the engine may run."""
        return sorted({(r, 1, 1) for r in self.decode_rows}
                      | {(r, w, w) for r in self.decode_rows for w in self.verify_widths}
                      | {(r, t, 1) for r in self.prefill_rows for t in self.prefill_tokens})

    def warmup(self) -> None:
        """Compile every bucket ahead of time (afterwards no step ever compiles); DSpark also profiles the
        decode and verify buckets for its cost table. On an accelerator the buckets compile in parallel
        threads, one per host core (XLA releases the GIL while it compiles); XLA:CPU already spreads one
        compilation over the cores."""
        missing = [bucket for bucket in self.buckets() if bucket not in self.compiled]
        workers = 1 if jax.default_backend() == "cpu" else min(len(missing), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(self._executable, missing))
        if self.scheduler.prefix is not None:
            self.device_pages.warmup()
        if self.speculation == "dspark" and self.costs is None:
            self.costs = self.profile()

    def profile(self, repeats: int = 5) -> CostTable:
        """Seconds of each decode / verify bucket on padding rows that sample at temperature 1 (the costlier
        path: drafts and verification draw noise) and write only the scratch slot; with the no-draft fallback
        also of decode steps that do not draft (width 0). Each is the fastest of `repeats` runs after two
        warm-up runs: interference only ever adds time, and the observed periods add the host's work later
        (`CostTable`); the table is then made non-decreasing in the width (`monotone_in_width`)."""
        seconds = {}
        for rows, width, verify_len in self.buckets():
            if width != verify_len and width != 1:
                continue  # a prefill bucket
            batch = empty_batch(self.layout, rows, width, self._engram_shapes(), verify_len)
            batch = batch._replace(sampling=SamplingBatch.from_params([SamplingParams(seed=0)] * rows, rows))
            for draft in (True, False) if self.draft_fallback and width == 1 else (True,):
                times = []
                for _ in range(repeats + 2):
                    start = time.perf_counter()
                    outputs, self.cache = self._executable((rows, width, verify_len))(
                        self.weights, self.cache, batch._replace(draft=np.asarray(draft)))
                    jax.block_until_ready(outputs)
                    times.append(time.perf_counter() - start)
                seconds[rows, width if draft else 0] = min(times[2:])
        return CostTable(monotone_in_width(seconds))

    def _executable(self, bucket: tuple[int, int, int]):
        if bucket not in self.compiled:
            if self.on_compile is not None:
                self.on_compile(bucket, None)
            start = time.perf_counter()
            self._compile(bucket)
            if self.on_compile is not None:
                self.on_compile(bucket, time.perf_counter() - start)
        return self.compiled[bucket]

    def _compile(self, bucket: tuple[int, int, int]) -> None:
        rows, width, verify_len = bucket
        if self.data_parallel is not None:
            self.compiled[bucket] = self.data_parallel.compile(self._halves.step, self.weights, self.cache,
                                                               rows, width, verify_len, self._engram_shapes())
            return
        batch = empty_batch(self.layout, rows, width, self._engram_shapes(), verify_len)
        if width == verify_len:  # a decode / verify bucket: in halves, for masks filled during the forward
            self.compiled[bucket] = CompiledHalves(self._halves, self.weights, self.cache, batch, verify_len)
        else:
            self.compiled[bucket] = compile_step(self._halves.step, self.weights, self.cache, batch, verify_len)

    def _prefix_cache(self, enabled: bool | None, replay: int | None, host_pages: int,
                      snapshots: int | None) -> PrefixAdmission | None:
        """The engine's prefix cache (None when off), with its device ops on `self.cache`."""
        if enabled is None:
            enabled = not self.batch_invariant
        if not enabled:
            if replay is not None or host_pages or snapshots:
                raise ValueError("prefix_replay, host_pages and prefix_snapshots need prefix_cache=True")
            return None
        exact = exact_replay_tokens(self.config, self.cache)
        replay = exact if replay is None else replay
        if isinstance(replay, bool) or not isinstance(replay, int) or not self.layout.ring <= replay:
            raise ValueError(f"prefix_replay must be an integer >= the window ring ({self.layout.ring} tokens) so "
                             f"decode finds its window filled (exact replay: {exact}), got {replay!r}")
        self.device_pages = DevicePages(self, self.layout.max_len)
        return PrefixAdmission(self.scheduler.pages, replay, host_pages, self.device_pages.read,
                               self.device_pages.write, self.replay.keep if self.replay is not None else 0,
                               8 * self.layout.max_slots if snapshots is None else snapshots, self.device_pages.take,
                               exact)

    def prefix_cache_metrics(self) -> dict[str, float]:
        """Prefix-cache counters (`PrefixAdmission.metrics`: `hit_rate` = prompt tokens served from the cache
        over prompt tokens admitted); empty when the cache is off."""
        prefix = self.scheduler.prefix
        return {} if prefix is None else prefix.metrics()

    def _engram_shapes(self) -> tuple:
        if self.engram is None:
            return ()
        return tuple((self.engram.hasher.n_lookups, table.head_dim) for table in self.engram.tables)

    # ---- requests -----------------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, constraint: ConstraintSpec | None = None,
                    constraint_trigger: int | None = None) -> str:
        """Queue a request; raises ValueError (and keeps nothing) if the prompt, parameters or constraint cannot
        run. `constraint` restricts the output (`serving.constraints.constraint_from_body` reads one from a
        request body), from the start or, with `constraint_trigger`, after that token (e.g. `</think>`)."""
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
        grammar = self.request_grammar(constraint, constraint_trigger, params.max_tokens)
        if params.seed is None:
            params = dataclasses.replace(params, seed=int(self._seeds.integers(0, 2**63 - 1)))
        request = Request(request_id, prompt, params, grammar=grammar, constraint=constraint)
        if self.engram is not None:
            request.engram_history = self.engram.empty_history(1)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def request_grammar(self, constraint: ConstraintSpec | None, trigger: int | None,
                        max_tokens: int) -> RequestGrammar | None:
        """A new request's grammar state for `constraint` (compiled once per distinct spec), starting after the
        token `trigger` if given and closed within `max_tokens` by the engine's `constraint_close`; None
        without a constraint. Raises ValueError for an invalid constraint."""
        if constraint is None:
            if trigger is not None:
                raise ValueError("constraint_trigger needs a constraint")
            return None
        return RequestGrammar(self._constraints().compile(constraint), trigger, max_tokens, self.constraint_close)

    def _constraints(self) -> ConstraintCompiler:
        """The engine's constraint compiler over the model's tokenizer (built on first use)."""
        if self._compiler is None:
            if not isinstance(self.config.eos_token_id, int):
                raise ValueError("structured outputs need a model with an eos_token_id (a constrained output ends "
                                 "with it)")
            tokenizer = getattr(self.model, "tokenizer", None)
            if tokenizer is None:
                raise ValueError("structured outputs need the model's own tokenizer (tokenizer.json); this model "
                                 "has none")
            self._compiler = ConstraintCompiler(grammar_tokenizer(tokenizer, self.config.vocab_size,
                                                                  [self.config.eos_token_id]))
            self._executor = MaskFill(llg.LLExecutor())
        return self._compiler

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
        finished = []
        if (self.jump_forward or self.data_parallel is not None) and any(
                r.grammar is not None and r.in_flight for r in self.scheduler.running):
            finished, self.pending = self._read(self.pending), []  # forced tokens / masks need the tokens in flight
        try:
            decode, prefill = self.scheduler.schedule(in_flight=bool(self.pending))
        except NeedsFlush:
            finished += self._read(self.pending)
            self.pending = []
            decode, prefill = self.scheduler.schedule(in_flight=False)
        finished, self._cancelled = finished + self._cancelled, []
        decoding = self._dispatch_decode(decode) if decode else None
        dispatched = []
        if prefill:
            width = next(t for t in self.prefill_tokens if t >= max(len(r.tokens) for r in prefill))
            dispatched.append(self._dispatch(prefill, self.prefill_rows, width, 1))
        if self.data_parallel is not None:  # expert loads and EPLB between iterations
            self.weights = self.data_parallel.after_step(self.weights, self.stats)
        if self.zero_overhead:
            self._forward_in_flight = isinstance(decoding, _Forwarding)
            finished += self._read(self.pending)  # the constrained rows' previous tokens, for their masks
            self._forward_in_flight = False
        if decoding is not None:
            dispatched.insert(0, self._decide(decoding) if isinstance(decoding, _Forwarding) else decoding)
        if self.zero_overhead:
            self.pending = dispatched
        else:
            finished += self._read(dispatched)
        self._observe_period(dispatched, finished)
        return finished

    def _observe_period(self, dispatched, finished: list) -> None:
        """Correct the DSpark cost table with the period of steady decode iterations (no prefill step and no
        request finishing in this or the previous iteration: a finishing request's bookkeeping is no cost of
        the bucket, and the narrower buckets often run only in a request's last step): what a decode / verify
        step really costs, host work included."""
        now = time.perf_counter()
        steady = len(dispatched) == 1 and dispatched[0][2][1] == dispatched[0][2][2] and not finished
        if self.costs is not None and steady and self._steady_since is not None:
            self.costs.observe(*self._cost_key, now - self._steady_since)
        self._steady_since = now if steady else None

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

    def _dispatch_decode(self, rows: list[Row]):
        """The decode step: plain decoding, or a verify bucket whose drafts per row speculation chooses."""
        if self.speculation == "none" or not any(row.caps for row in rows):
            return self._dispatch_plain(rows)
        caps = np.array([row.caps for row in rows])
        budget = None
        if self.speculation == "fixed":
            width = self.verify_widths[0]
        else:
            bucket_rows = next(r for r in self.decode_rows if r >= len(rows))
            if self.costs is None:
                self.costs = self.profile()
            plan = plan_verify(prefix_survival(np.array([self._planning_confidence(row.request) for row in rows])),
                               caps, bucket_rows, (1,) + self.verify_widths, self.costs)
            if plan.width == 1:
                return self._dispatch_plain(rows)
            # a block drafted before a step that did not draft is stale: its row verifies nothing
            stale = np.array([not row.request.drafts_fresh for row in rows])
            if stale.all():  # verification pays by the last confidences: draft now, verify next step
                return self._dispatch_plain(rows, draft=True)
            width, budget = plan.width, plan.budget  # the device splits the budget by the newest confidences
            caps = np.where(stale, 0, caps)
        for row, cap in zip(rows, caps):
            row.caps = int(min(cap, width - 1))
        self._nodraft_streak, self._probe_interval = 0, self.probe_every
        return self._dispatch(rows, self.decode_rows, width, width, budget, decoding=True)

    def _planning_confidence(self, request: Request) -> list[float]:
        """The confidences DSpark plans a row's budget with: those of a block older than the one it verifies (a
        draft's confidence depends on the drafts before it, so planning with the verified block's own would let
        a draft decide whether it is verified, which biases sampling). With zero-overhead scheduling that is the
        newest block the host has read (the next one is still in flight), otherwise the block before the
        slot's current one; 1.0 where the request has no such block yet (its first verification)."""
        known = request.confidence if self.zero_overhead else request.prior_confidence
        return (known or [1.0] * self.num_drafts)[:self.num_drafts]

    def _dispatch_plain(self, rows: list[Row], draft: bool | None = None):
        """A decode step of one token per row. With the no-draft fallback its drafter only absorbs features,
        except for probes, which draft again so that fresh confidences let the planner resume verification:
        after `probe_every` such steps, then after twice as many each time a probe did not resume it (at most
        8 x `probe_every`). `draft` True: draft now."""
        for row in rows:
            row.caps = 0
        self._nodraft_streak += 1
        if draft is None:
            draft = not self.draft_fallback or self._nodraft_streak > self._probe_interval
            if draft and self.draft_fallback:
                self._probe_interval = min(2 * self._probe_interval, 8 * self.probe_every)
        if draft:
            self._nodraft_streak = 0
        return self._dispatch(rows, self.decode_rows, 1, 1, draft=draft, decoding=True)

    def _dispatch(self, rows: list[Row], row_buckets: tuple[int, ...], width: int, verify_len: int,
                  budget: int | None = None, draft: bool = True, decoding: bool = False):
        """Build the batch of a bucket, launch its compiled step (async) and do the host bookkeeping; a verify
        bucket's rows split `budget` drafts (default: every row verifies its cap); `draft` False: a decode
        step whose drafter does not draft (the no-draft fallback). A decode / verify step (`decoding`) with
        constrained rows launches only its forward half: `_decide` fills the masks and launches the rest."""
        dp = self.data_parallel
        per_rank = len(rows) if dp is None else dp.rows_per_rank(rows)
        bucket = (next(r for r in row_buckets if r >= per_rank), width, verify_len)
        executable = self._executable(bucket)
        later = decoding and isinstance(executable, CompiledHalves) and any(
            row.sample and row.request.grammar is not None for row in rows)
        batch = self._batch(rows, bucket[0] if dp is None else len(rows), width, verify_len, budget,
                            masks=not later)._replace(draft=np.asarray(draft))
        if dp is not None:
            batch = dp.place(batch, rows, bucket[0], width, verify_len, self._engram_shapes())
        for row in rows:
            if row.reset and row.start:  # a prefix hit starts at `start`: its snapshot, the prompt before it
                if row.restore is not None:
                    self.device_pages.restore(row.request.slot, row.restore)
                self.device_pages.start_prompt(row.request.slot, row.request.prompt[:row.start])
        if later:
            forwarded, self.cache = executable.forward(self.weights, self.cache, batch)
        else:
            outputs, self.cache = executable(self.weights, self.cache, batch)
        if width == verify_len:
            self._cost_key = (bucket[0], width if draft else 0)
        self.stats["nodraft_steps"] += not draft
        for row in rows:
            request = row.request
            if row.sample:
                request.drafts_fresh = draft
            if row.from_prev:  # a decode / verify row
                request.in_flight.append(row.caps + 1)
                self.stats["decode_rows"] += 1
            else:
                request.computed += len(row.tokens)
                if self.scheduler.prefix is not None:
                    self.scheduler.prefix.chunk_done(request)
                if row.sample:
                    request.in_flight.append(1)
                self.stats["prefill_tokens"] += len(row.tokens)
        self.stats["steps"] += 1
        if later:
            return _Forwarding(rows, bucket, batch, executable, forwarded)
        jax.tree.map(lambda x: x.copy_to_host_async(), outputs)
        return rows, outputs, bucket

    def _decide(self, step: _Forwarding):
        """Fill the token masks of a step whose forward half runs (its rows' previous tokens are read by now)
        and launch its decide half. Mask work the device may have waited for counts as exposed
        (`stats["grammar_exposed_seconds"]`): all of it if the forward had finished when the masks were ready."""
        filled = self.stats["grammar_seconds"]
        bitmask = self._bitmask(step.rows, step.batch.bitmask)
        self.stats["masked_during_forward"] += 1
        if step.forwarded.picked.is_ready():
            self.stats["grammar_exposed_seconds"] += self.stats["grammar_seconds"] - filled + self._overlapped
        self._overlapped = 0.0
        outputs, self.cache = step.executable.decide(self.weights, self.cache, step.batch._replace(bitmask=bitmask),
                                                     step.forwarded)
        jax.tree.map(lambda x: x.copy_to_host_async(), outputs)
        return step.rows, outputs, step.bucket

    def _batch(self, rows: list[Row], num_rows: int, width: int, verify_len: int, budget: int | None,
               masks: bool = True) -> StepBatch:
        """The step's host inputs; `masks` False: the token masks are left all allowed (`_decide` fills them)."""
        b = empty_batch(self.layout, num_rows, width, self._engram_shapes(), verify_len)
        if masks:
            b = b._replace(bitmask=self._bitmask(rows, b.bitmask))
        if self.engram is not None:
            self._engram_rows(b, rows)
        for i, row in enumerate(rows):
            n = len(row.tokens)
            b.tokens[i, :n], b.kinds[i, :n] = row.tokens, row.kinds
            b.slots[i], b.starts[i], b.counts[i], b.caps[i] = row.request.slot, row.start, n, row.caps
            b.from_prev[i], b.reset[i], b.sample[i] = row.from_prev, row.reset and row.restore is None, row.sample
            b.block_tables[i] = self.scheduler.block_table(row.request)
            b.frozen[i], b.prompt_end[i] = row.frozen, row.prompt_end
        b.budget[...] = b.caps.sum() if budget is None else budget
        sampling = SamplingBatch.from_params([r.request.params for r in rows], num_rows)
        return b._replace(sampling=sampling)

    def _bitmask(self, rows: list[Row], masks: np.ndarray):
        """The step's token masks [rows, v, W]: constrained rows from their grammars (a verify row's drafts are
        taken tentatively, up to the first the grammar refuses, which the verifier will reject), the rest all
        allowed. A batch without constrained rows passes an all-allowed array kept on the device."""
        grammars = [row.request.grammar if row.sample else None for row in rows]
        if all(g is None for g in grammars):
            shape = masks.shape
            if shape not in self._all_allowed:
                self._all_allowed[shape] = jax.device_put(masks)
            return self._all_allowed[shape]
        start = time.perf_counter()
        num_rows, verify_len, words = masks.shape
        if verify_len == 1:
            fill_masks(grammars, masks.reshape(num_rows, words), self._executor)
        else:
            speculate_masks(grammars, [row.request.drafts[:row.caps] for row in rows], masks, self._executor)
        self.stats["grammar_seconds"] += time.perf_counter() - start
        return masks

    def _engram_rows(self, batch: StepBatch, rows: list[Row]) -> None:
        """Hash the rows' tokens with their requests' n-gram histories (host) and gather their table rows: each
        prefill row on its own (its history advances by the chunk), the decode / verify rows in one lookup. A
        decode / verify row's tokens are the last token and the drafts the host read (zero-overhead is off for
        Engram models); its history advances only when the host reads which of them were committed."""
        continuing = [(i, row) for i, row in enumerate(rows) if row.from_prev]
        for i, row in enumerate(rows):
            if not row.from_prev:
                self._engram_prefill_row(batch, i, row)
        if not continuing:
            return
        tokens = [[row.request.output[-1]] + row.request.drafts[:row.caps] for _, row in continuing]
        width = max(map(len, tokens))
        padded = np.array([t + t[-1:] * (width - len(t)) for t in tokens])  # padding positions are dropped
        histories = np.concatenate([row.request.engram_history for _, row in continuing])
        looked_up, _ = self.engram.lookup(padded, histories, on_host=True)
        for layer_rows, layer in zip(batch.engram_rows, looked_up):
            for k, (i, _) in enumerate(continuing):
                layer_rows[i, :len(tokens[k])] = layer[k, :len(tokens[k])]

    def _engram_prefill_row(self, batch: StepBatch, i: int, row: Row) -> None:
        """`_engram_rows` for one prefill row: its history first (a prefix hit replays from a later start), then
        the chunk's lookup, which advances it."""
        request = row.request
        if row.reset:
            before = request.sequence[max(0, row.start - request.engram_history.shape[1]):row.start]
            request.engram_history = self.engram.advance(np.array([before], np.int64),
                                                         self.engram.empty_history(1))
        rows, request.engram_history = self.engram.lookup(np.array([row.tokens]), request.engram_history, on_host=True)
        for layer_rows, looked_up in zip(batch.engram_rows, rows):
            layer_rows[i, :len(row.tokens)] = looked_up[0]

    def _read(self, dispatched) -> list[RequestOutput]:
        """Apply the results of dispatched steps to their requests; returns those that finished."""
        finished = []
        for rows, outputs, bucket in dispatched:
            out = jax.tree.map(np.asarray, outputs)
            for i, row in enumerate(rows):
                request = row.request
                if not row.sample or request.status is Status.FINISHED:
                    continue  # a prefill chunk, or a row dispatched before its request stopped
                request.in_flight.popleft()
                accepted = int(out.accepted[i])
                if row.from_prev:
                    self._speculation_stats(row, out, i, accepted)
                if self.engram is not None and row.from_prev:
                    inputs = [request.output[-1]] + request.drafts[:accepted]
                    request.engram_history = self.engram.advance(np.array([inputs]), request.engram_history)
                if out.next_drafts.shape[1] and out.drafted:
                    request.prior_confidence = request.confidence
                    request.drafts, request.confidence = out.next_drafts[i].tolist(), out.next_confidence[i].tolist()
                complete = request.grammar is not None and self._commit(request.grammar, out, i, accepted)
                for j in range(accepted + 1):
                    self._emit(request, out, i, j)
                    if complete and j == accepted and request.status is not Status.FINISHED:
                        request.finish("stop")
                    if request.status is Status.FINISHED:
                        break
                if self.jump_forward and request.status is Status.RUNNING:
                    jump_forward(request, self.config.eos_token_id, self.detokenize)
                if request.status is Status.FINISHED:
                    self.scheduler.release(request)
                    finished.append(request.result(self.detokenize))
        return finished

    def _commit(self, grammar: RequestGrammar, out, i: int, accepted: int) -> bool:
        """Move a constrained request's matcher over row i's emitted tokens (settling a verify row's drafts);
        whether the output is complete (the constraint admits no further token, or it took an EOS). Its time
        is exposed unless a forward half runs meanwhile (then `_decide` judges it)."""
        start = time.perf_counter()
        tokens = out.tokens[i, :accepted + 1].tolist()
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
        return grammar.finished

    def _emit(self, request: Request, out, i: int, j: int) -> None:
        """Give `request` the token of row i, verify position j. Alternatives a constraint refuses (logprob -inf)
        are left out of the top logprobs."""
        n = request.params.logprobs
        token = int(out.tokens[i, j])
        lp = None if n is None else TokenLogprob(
            token, float(out.logprob[i, j]), [(int(t), float(v)) for t, v in zip(out.top_ids[i, j, :n],
                                                                               out.top_logprobs[i, j, :n])
                                              if v > -np.inf])
        if self.return_logits:
            request.logits = (request.logits or []) + [out.logits[i, j]]
        self.stats["decode_tokens"] += 1
        request.accept(token, lp, self.config.eos_token_id, self.detokenize)

    def _speculation_stats(self, row: Row, out, i: int, accepted: int) -> None:
        """Drafts verified and accepted (per block position) and |acceptance probability - confidence| of every
        verified draft whose prefix survived."""
        verified = int(out.verified[i])
        self.stats["verified"] += verified
        self.stats["accepted"] += accepted
        self.stats["verified_at"][:verified] += 1
        self.stats["accepted_at"][:accepted] += 1
        seen = min(verified, accepted + 1)
        self.stats["calibration_abs"] += float(np.abs(out.accept_prob[i, :seen] - out.confidence[i, :seen]).sum())
        self.stats["calibration_n"] += seen

    def speculation_metrics(self) -> dict:
        """Per decode / verify row: drafts accepted and verified, tokens emitted; acceptance rate per block
        position; mean |acceptance probability - confidence| (calibration error)."""
        s, rows = self.stats, max(self.stats["decode_rows"], 1)
        return {"accepted_per_step": s["accepted"] / rows, "verified_per_step": s["verified"] / rows,
                "tokens_per_step": (s["accepted"] + s["decode_rows"]) / rows,
                "acceptance_by_position": (s["accepted_at"] / np.maximum(s["verified_at"], 1)).round(4).tolist(),
                "calibration_error": s["calibration_abs"] / max(s["calibration_n"], 1)}
