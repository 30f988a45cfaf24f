"""The serving engine: continuous batching over ahead-of-time compiled steps, with zero-overhead scheduling,
speculative decoding, prefix caching and structured outputs.

Each iteration dispatches a decode step and a prefill step, then reads the previous iteration's results, so the
host prepares step N+1 while the device runs step N. Steps are compiled once per static bucket at start-up.
See docs/engine.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model.api import Model
from model.host_layout import has_host_layout, host_layout
from model.mtp_drafter import mtp_drafter
from model.replay import for_engine
from serving.structured.constraints import ConstraintSpec
from serving.base.engine_config import EngineConfig
from serving.base.host_choices import HostChoices
from serving.core.executable_cache import ExecutableCache, describe, directory
from serving.structured.jump_forward import jump_forward
from serving.base.kv_cache import CacheLayout, drafter_ring, page_bytes
from serving.core.layer_programs import LayerPlan
from serving.core.placement import placement_for
from serving.prefix.prefix_admission import DevicePages, PrefixAdmission, exact_replay_tokens
from serving.prefix.prefix_ranks import RankedPrefix
from serving.prefix.prompt_logprobs import PromptLogprobStore, record, scores
from serving.base.request import Request, RequestOutput, Status, TokenLogprob
from serving.base.sampling import SamplingBatch, SamplingParams
from serving.core import slot_state
from serving.base.request import Row
from serving.core.scheduler import NeedsFlush
from serving.core.slot_state import SlotState
from serving.core.step import CompiledHalves, DrafterSpec, Forwarded, StepBatch, build_step_halves, empty_batch

PROMPT_FIELDS = ("prompt_logprob", "prompt_top_ids", "prompt_top_logprobs")  # `StepOutput`'s prompt logprobs
from serving.speculation.speculation_policy import SpeculationPolicy
from serving.structured.structured_outputs import StructuredOutputs
from serving.speculation.verify_plan import CostTable, interpolated, monotone_in_width

LOG = logging.getLogger(__name__)


def powers_of_two(limit: int, least: int = 1) -> tuple[int, ...]:
    """least, 2 least, 4 least, ... up to and including `limit` (which is added if not of that form)."""
    out = [least << i for i in range(limit.bit_length()) if least << i < limit]
    return tuple(out + [limit])


def context_buckets(layout: CacheLayout, least_tokens: int) -> tuple[int, ...]:
    """The context-pages buckets of `layout`: the pages of `least_tokens` times powers of two, up to a slot's
    whole table (at most log2(max_len / least_tokens) + 1 of them). A step reads, of each row's table, the
    first bucket that covers its longest row, so its cost follows the live context, not `max_len`."""
    least = max(1, min(layout.pages_per_slot, -(-least_tokens // layout.page_tokens)))
    return powers_of_two(layout.pages_per_slot, least)


class _Forwarding(NamedTuple):
    """A decode / verify step whose forward half runs on the device, its decide half waiting for token masks."""

    rows: list[Row]
    bucket: tuple[int, int, int, int]
    batch: StepBatch
    executable: CompiledHalves
    forwarded: Forwarded


class Engine:
    """Offline / online generation over one model, with the settings of an `EngineConfig`: `Engine(model, config)`,
    or `Engine(model, max_slots=..., max_len=...)` with keywords naming its fields; keywords given with a config
    replace those fields of it. `config` holds the settings, `model_config` the model's. Where the host layout
    applies (`EngineConfig.uses_host_layout`: by default a one-device CPU engine) the engine first converts the
    model's weights to the CPU's layout, in place (`model.host_layout`)."""

    # told about each step bucket compiled, before (seconds None) and after (e.g. a progress bar)
    on_compile: Callable[[tuple[int, int, int, int], float | None], None] | None = None

    def __init__(self, model: Model, config: EngineConfig | None = None, **settings):
        config = EngineConfig(**settings) if config is None else dataclasses.replace(config, **settings)
        if config.uses_host_layout:
            host_layout(model)  # before the drafter is made from the model: it shares the MTP blocks' weights
        drafter = None if config.speculation == "none" else model.drafter or mtp_drafter(model.module())
        if config.speculation != "none" and drafter is None:
            raise ValueError(f"speculation={config.speculation!r} needs a model with a DSpark drafter or an MTP "
                             "block (this one has neither)")
        self.config, self.model, self.model_config = config, model, model.config
        # the clock and the background-dependent choices: one for every process of a multi-process engine
        self.choices = HostChoices()
        self.speculation = SpeculationPolicy(config, drafter.config.block_size if drafter is not None else 0,
                                             self.choices.now)
        num_drafts = self.speculation.num_drafts
        backtrack = config.backtrack if drafter is None else max(config.backtrack, num_drafts + 1)
        num_pages, page_tokens = config.num_pages, config.page_tokens
        if config.kv_cache_memory is not None:
            page_tokens = CacheLayout.for_model(model.config, config.max_slots, config.max_len, None,
                                                page_tokens).page_tokens
            num_pages = config.kv_cache_memory // page_bytes(model.module(), page_tokens)
        self.layout = CacheLayout.for_model(model.config, config.max_slots, config.max_len, num_pages, page_tokens,
                                            backtrack)
        self.placement = placement_for(config, model, self.layout)
        model = self.placement.model  # as placed (on a mesh: its experts over ep, with EPLB's maps)
        drafter = None if drafter is None else model.drafter or mtp_drafter(model.module())  # placed too
        # Engram hashes a decode row's input token on the host, so the host must have read the previous
        # step: zero-overhead scheduling is off for Engram models (device-side hashing would lift this).
        self.engram = model.engram
        self.zero_overhead = config.zero_overhead and self.engram is None
        chunk, invariant = config.prefill_chunk, config.batch_invariant
        budget = config.token_budget or config.max_slots + config.max_prefill_rows * chunk
        self.scheduler = self.placement.scheduler(self.layout, chunk, budget, config.max_prefill_rows, invariant,
                                                  num_drafts)
        rows = self.placement.layout.max_slots  # a bucket's rows are per rank (`placement.layout`: one rank's)
        prefill_rows = min(rows, config.max_prefill_rows)
        self.decode_rows = (rows,) if invariant else powers_of_two(rows)
        self.prefill_rows = (prefill_rows,) if invariant else powers_of_two(prefill_rows)
        self.prefill_tokens = (chunk,) if invariant else tuple(t for t in (8, 32, 128, 512) if t < chunk) + (chunk,)
        # context buckets: one (the whole table) where a row's numbers must not depend on the other rows
        # (batch-invariant)
        self.context_pages = ((self.layout.pages_per_slot,) if invariant
                              else context_buckets(self.layout, config.context_tokens))
        module = model.module()
        draft_module = drafter.module() if drafter is not None else None
        self.cache = self.placement.init_cache(module, draft_module)
        self.replay = for_engine(model.config, config.replay, self.layout.ring, drafter_ring(self.cache),
                                 drafter.config.target_layer_ids if drafter is not None else ())
        self.device_pages = DevicePages(self, self.layout.max_len)  # a prefix hit's or partial hand-off's slot ops
        self.scheduler.prefix = self._prefix_cache()
        self.scheduler.scored_chunk = self.replay.keep if self.replay is not None else None
        # what the compiled steps take (flattened once)
        self.weights = (jax.tree.leaves(model.params), jax.tree.leaves(drafter.params) if drafter else [])
        # a reset row's per-slot leaves (their shapes do not depend on the length; its paged ones go unused)
        empty = module.init_cache(1, self.layout.page_tokens, self.layout.ring)
        self.empty_layers = empty["layers"]
        self.empty_drafter = None if draft_module is None else draft_module.init_state(1)
        spec = None if drafter is None else DrafterSpec(drafter.graphdef, jax.tree.structure(drafter.params),
                                                         draft_module.init_state(1), drafter.config.target_layer_ids)
        self._halves = build_step_halves(model.graphdef, jax.tree.structure(model.params), empty["layers"],
                                         config.num_top_logprobs, config.return_logits,
                                         spec, self.replay)
        self.layer_plan = self._layer_plan(model, config, empty["layers"], spec)
        self.compiled: dict[tuple[int, int, int, int], Callable] = {}
        self._compiling: dict[tuple[int, int, int, int], threading.Lock] = {}  # a lock per bucket compiling
        self._compiling_lock = threading.Lock()
        self._background: threading.Thread | None = None  # compiling the buckets not compiled yet, while serving
        self._stop_compiling = threading.Event()
        self._unproven: set[tuple[int, int, int, int]] = set()  # buckets loaded from disk, not yet run
        # compiled buckets kept on disk beside JAX's compile cache (not in a multi-process job: a deserialized
        # executable would not know the job's other processes)
        stored = directory() if jax.process_count() == 1 else None
        self.executables = None if stored is None else ExecutableCache(
            stored, model.config, drafter.config if drafter else None, self.layout, self.replay,
            self.layer_plan is None, config.num_top_logprobs, config.return_logits, self._engram_shapes(),
            describe(self.weights), describe(self.cache), has_host_layout(model))  # flat leaves: layout said apart
        self.requests: dict[str, Request] = {}
        self.pending: list[tuple[list[Row], object]] = []
        self._cancelled: list[RequestOutput] = []
        self._seeds = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "decode_rows": 0, "verified": 0,
                      "accepted": 0, "verified_at": np.zeros(num_drafts, np.int64),
                      "accepted_at": np.zeros(num_drafts, np.int64), "calibration_abs": 0.0,
                      "calibration_n": 0, "nodraft_steps": 0, "grammar_seconds": 0.0,  # filling masks
                      "grammar_commit_seconds": 0.0, "grammar_exposed_seconds": 0.0,  # the device may wait for
                      "masked_during_forward": 0}  # decode steps whose masks were filled while the forward ran
        self.structured = StructuredOutputs(self.model, config.constraint_close, config.jump_forward, self.stats)
        LOG.info(self.startup_summary())

    def startup_summary(self) -> str:
        """The KV pool (pages, page size, the most tokens it holds at once: vLLM's "maximum concurrency") and
        what the engine compiles (its step buckets, the context buckets among them)."""
        layout, pt = self.layout, self.layout.page_tokens
        held = layout.num_pages * pt
        return (f"KV cache: {layout.num_pages} pages of {pt} tokens ({page_bytes(self.model.module(), pt)} bytes "
                f"each), {held} tokens at most; maximum concurrency for {layout.max_len}-token requests: "
                f"{held / layout.max_len:.2f}x. {len(self.buckets())} step buckets: "
                f"{len(self.buckets()) // len(self.context_pages)} shapes x {len(self.context_pages)} context "
                f"buckets of {list(self.context_pages)} pages ({[p * pt for p in self.context_pages]} tokens)")

    # ---- compilation --------------------------------------------------------------------------------------
    def buckets(self) -> list[tuple[int, int, int, int]]:
        """Every (rows, tokens, verify length, context pages) shape the engine may run."""
        shapes = sorted({(r, 1, 1) for r in self.decode_rows}
                        | {(r, w, w) for r in self.decode_rows for w in self.speculation.verify_widths}
                        | {(r, t, 1) for r in self.prefill_rows for t in self.prefill_tokens})
        return [(*shape, pages) for shape in shapes for pages in self.context_pages]

    def first_buckets(self) -> list[tuple[int, int, int, int]]:
        """What a server compiles before it answers: the widest one-row prefill bucket at the shortest context,
        which runs any first request's prefill chunks and, until its own buckets are compiled in the background,
        its decode steps (`_ready`); with speculation also the one-row verify buckets."""
        rows, pages = self.prefill_rows[0], self.context_pages[0]
        shapes = {(self.prefill_tokens[-1], 1)} | {(w, w) for w in self.speculation.verify_widths}
        return [bucket for bucket in self.buckets() if bucket[0] == rows and bucket[3] == pages
                and bucket[1:3] in shapes]

    def warmup(self, buckets: Sequence[tuple[int, int, int, int]] | None = None) -> None:
        """Compile `buckets` (default: every bucket, after which no step ever compiles) ahead of time, except that
        a DSpark engine compiles only the decode / verify buckets it profiles for its cost table (`profile`): its
        other buckets, up to every rows x width x context, compile when first used. On an accelerator the
        buckets compile in parallel threads, one per host core (XLA releases the GIL while it compiles); XLA:CPU
        already spreads one compilation over the cores."""
        dspark = self.speculation.mode == "dspark"
        todo = self.buckets() if buckets is None else buckets
        missing = [] if dspark else [bucket for bucket in todo if bucket not in self.compiled]
        workers = 1 if jax.default_backend() == "cpu" else min(len(missing), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(self._executable, missing))
        if self.scheduler.prefix is not None:
            self.device_pages.warmup()
        if dspark and self.speculation.costs is None:
            self.speculation.costs = self.profile()

    def profile(self, repeats: int = 5) -> CostTable:
        """Seconds of the decode / verify buckets at the extremes of the rows and the widths (the fewest and
        the most rows, plain decoding and the widest verify bucket, at the shortest context), on padding rows
        that sample at temperature 1 (the costlier path: drafts and verification draw noise) and write only the
        scratch slot; with the no-draft fallback also of decode steps that do not draft (width 0). Each is the
        fastest of `repeats` runs after two warm-up runs: interference only ever adds time, and the observed
        periods add the host's work later (`CostTable`). The table is made non-decreasing in the width
        (`monotone_in_width`) and the other buckets interpolated (`interpolated`)."""
        pages, widest = self.context_pages[0], self.speculation.verify_widths[-1]
        seconds = {}
        for rows, width in itertools.product(sorted({self.decode_rows[0], self.decode_rows[-1]}), (1, widest)):
            batch = empty_batch(self.layout, rows, width, self._engram_shapes(), width, pages)
            batch = batch._replace(sampling=SamplingBatch.from_params([SamplingParams(seed=0)] * rows, rows))
            for draft in (True, False) if self.speculation.draft_fallback and width == 1 else (True,):
                times = []
                for _ in range(repeats + 2):
                    start = self.choices.now()
                    bucket = (rows, width, width, pages)
                    outputs, self.cache = self._launch(bucket, self._executable(bucket),
                                                       batch._replace(draft=np.asarray(draft)))
                    jax.block_until_ready(outputs)
                    times.append(self.choices.now() - start)
                seconds[rows, width if draft else 0] = min(times[2:])
        widths = (1,) + self.speculation.verify_widths
        return CostTable(interpolated(monotone_in_width(seconds), self.decode_rows, widths))

    def compile_in_background(self) -> threading.Thread:
        """Compile every bucket not compiled yet in a daemon thread, the fewest rows and shortest context first,
        while the engine serves; a step that needs a bucket compiling there waits for it, one that needs a
        bucket not reached yet compiles it itself (`jaxseek serve` answers once `first_buckets` are compiled)."""
        order = sorted(self.buckets(), key=lambda b: (b[3], b[0], b[1], b[2]))

        def compile_all():
            for bucket in order:
                if self._stop_compiling.is_set():
                    return
                self._executable(bucket)

        self._background = threading.Thread(target=compile_all, name="compile", daemon=True)
        self._background.start()
        return self._background

    def close(self) -> None:
        """Stop the background compilation after the bucket it compiles now, and wait for it (a process that
        exits while XLA compiles may crash)."""
        if self._background is not None:
            self._stop_compiling.set()
            self._background.join()

    @property
    def _compiling_in_background(self) -> bool:
        return self._background is not None and self._background.is_alive()

    def _executable(self, bucket: tuple[int, int, int, int], load: bool = True):
        if bucket in self.compiled:
            return self.compiled[bucket]
        with self._compiling_lock:
            lock = self._compiling.setdefault(bucket, threading.Lock())
        with lock:  # one compilation per bucket, whichever thread asks first
            if bucket not in self.compiled:
                if self.on_compile is not None:
                    self.on_compile(bucket, None)
                start = time.perf_counter()
                self._compile(bucket, load)
                if self.on_compile is not None:
                    self.on_compile(bucket, time.perf_counter() - start)
        return self.compiled[bucket]

    def _compile(self, bucket: tuple[int, int, int, int], load: bool = True) -> None:
        """Compile a bucket's step (`load`: or load it from the executable cache)."""
        plan = self.layer_plan

        def compile_bucket() -> list:
            return self.placement.compile(self._halves, plan, self.weights, self.cache, bucket, self._engram_shapes())

        stored = self.executables
        loaded = None if stored is None else stored.loaded
        executables = compile_bucket() if stored is None else stored.load_or_compile(bucket, compile_bucket, load)
        if stored is not None and stored.loaded != loaded:  # from disk: its first call proves it runs
            self._unproven.add(bucket)
        self.compiled[bucket] = self.placement.wrap(executables, self._halves, plan, bucket)

    def _layer_plan(self, model: Model, config: EngineConfig, empty_layers: list, spec) -> LayerPlan | None:
        """How the step's forward splits into layer programs (`serving.core.layer_programs`), or None: one program."""
        if config.layer_programs is False or not self.placement.layer_programs:
            return None
        why = LayerPlan.supports(model)
        if why is not None and config.layer_programs:
            raise ValueError(f"layer_programs=True: this model cannot run as layer programs: {why}")
        if why is None and config.layer_programs is None:
            why = LayerPlan.unpaid(model, self.placement.ranks)
        return None if why else LayerPlan.for_model(model, empty_layers, spec.target_layers if spec else (),
                                                    self.replay)

    def _prefix_cache(self) -> PrefixAdmission | RankedPrefix | None:
        """The engine's prefix cache (None when off), with its device ops on `self.cache`."""
        config = self.config
        if not config.uses_prefix_cache:
            return None
        exact = exact_replay_tokens(self.model_config, self.cache)
        replay = exact if config.prefix_replay is None else config.prefix_replay
        if not self.layout.ring <= replay:
            raise ValueError(f"prefix_replay must be an integer >= the window ring ({self.layout.ring} tokens) so "
                             f"decode finds its window filled (exact replay: {exact}), got {replay!r}")
        snapshots = 8 * self.layout.max_slots if config.prefix_snapshots is None else config.prefix_snapshots
        keep = self.replay.keep if self.replay is not None else 0
        self.prompt_store = PromptLogprobStore(self.layout.page_tokens, self.layout.num_pages)  # shared by ranks
        return self.scheduler.prefix_cache(lambda pages, shares: PrefixAdmission(
            pages, replay, -(-config.host_pages // shares), self.device_pages.read, self.device_pages.write, keep,
            -(-snapshots // shares), self.device_pages.take, exact, self.prompt_store))

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
        run. `constraint` restricts the output (`serving.structured.constraints.constraint_from_body` reads one from a
        request body), from the start or, with `constraint_trigger`, after that token (e.g. `</think>`)."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        self.validate(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        grammar = self.structured.grammar(constraint, constraint_trigger, params.max_tokens)
        if params.seed is None:
            params = dataclasses.replace(params, seed=int(self._seeds.integers(0, 2**63 - 1)))
        request = Request(request_id, prompt, params, grammar=grammar, constraint=constraint)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(prompt)
        if self.engram is not None:
            request.engram_history = self.engram.empty_history(1)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what of a prompt and its parameters this engine cannot run."""
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt) + params.max_tokens > self.layout.max_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"engine's max_len={self.layout.max_len}")
        num_top = self.config.num_top_logprobs
        if params.logprobs is not None and params.logprobs > num_top:
            raise ValueError(f"logprobs={params.logprobs} exceeds the engine's num_top_logprobs={num_top}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > num_top:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds the engine's "
                             f"num_top_logprobs={num_top}")

    def export_slot(self, request_id: str) -> SlotState:
        """The state of a running request whose prompt is in the cache, to continue it in another engine
        (`import_slot`; read between engine steps)."""
        request = self.requests[request_id]
        if request.status is not Status.RUNNING or request.prefilling or request.in_flight:
            raise ValueError(f"request {request_id} is not between steps with its prompt prefilled")
        pages = self.placement.cache_pages(np.asarray(self.scheduler.pages.owned.get(request.slot, []), np.int32))
        layers, per_slot = slot_state.take(self.cache, self.placement.cache_slot(request.slot), pages)
        return SlotState(
            request_id=request_id, prompt=list(request.prompt), params=request.params, output=list(request.output),
            logprobs=list(request.logprobs), computed=request.computed, page_tokens=self.layout.page_tokens,
            layers=layers, slot=per_slot,
            engram_history=None if request.engram_history is None else np.array(request.engram_history),
            drafts=list(request.drafts), confidence=list(request.confidence),
            elapsed=time.perf_counter() - request.arrival, constraint=request.constraint,
            constraint_trigger=None if request.grammar is None else request.grammar.trigger,
            prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs))

    def import_slot(self, state: SlotState) -> bool:
        """Install a request `export_slot` gave (another engine's) as running here: its next step decodes it;
        False when no slot or not enough pages are free now (try again after a step). On a mesh it goes to the
        rank the scheduler picks (`take_handoff`). Raises ValueError for a state of another layout or a request
        id in use.

        A state whose prompt is only partly computed (`SlotState.partial`: the prefix state of an asymmetric P/D
        split, the first layers' alone) is installed as a prefix-cache hit restoring a window-state snapshot: its next
        steps prefill the rest of the prompt through every layer, from the penalty statistics of a fresh slot and
        the empty state in the layers the hand-off lacks."""
        if state.request_id in self.requests:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        if state.partial:
            return self._import_prefix(state)
        slot_state.check(self.cache, state, self.layout.page_tokens)
        grammar = self.structured.grammar(state.constraint, state.constraint_trigger, state.params.max_tokens)
        if grammar is not None and not grammar.accept(state.output):
            raise ValueError(f"the hand-off's output breaks its constraint: {grammar.error}")
        now = time.perf_counter()
        request = Request(state.request_id, list(state.prompt), state.params, arrival=now - state.elapsed,
                          status=Status.RUNNING, output=list(state.output), logprobs=list(state.logprobs),
                          computed=state.computed, first_token_time=now, engram_history=state.engram_history,
                          drafts=list(state.drafts), confidence=list(state.confidence), grammar=grammar,
                          constraint=state.constraint, prompt_logprobs=state.prompt_logprobs)
        new = self.scheduler.take_handoff(request)
        if new is None:
            return False
        self.cache = slot_state.put(self.cache, state, self.placement.cache_slot(request.slot),
                                    self.placement.cache_pages(np.asarray(new, np.int32)))
        self.requests[request.request_id] = request
        self.scheduler.running.append(request)
        return True

    def _import_prefix(self, state: SlotState) -> bool:
        slot_state.check_prefix(self.cache, state, self.layout.page_tokens)
        grammar = self.structured.grammar(state.constraint, state.constraint_trigger, state.params.max_tokens)
        request = Request(state.request_id, list(state.prompt), state.params,
                          arrival=time.perf_counter() - state.elapsed, status=Status.RUNNING, computed=state.computed,
                          fresh_slot=True, grammar=grammar, constraint=state.constraint,
                          engram_history=None if self.engram is None else self.engram.empty_history(1))
        new = self.scheduler.take_handoff(request)
        if new is None:
            return False
        self.cache = slot_state.put_pages(self.cache, state, self.placement.cache_pages(np.asarray(new, np.int32)))
        request.restore = slot_state.window_state(state, self.empty_layers, self.empty_drafter)
        self.requests[request.request_id] = request
        self.scheduler.running.append(request)
        return True

    def cancel(self, request_id: str) -> None:
        """Stop a request; its result has finish_reason 'cancelled'."""
        request = self.requests[request_id]
        if request.status is not Status.FINISHED:
            request.finish("cancelled")
            self.scheduler.release(request)
            self._cancelled.append(request.result(self.config.detokenize))

    def abort(self) -> list[RequestOutput]:
        """After a failed step: finish every request not finished yet (finish_reason 'error'), free its slot and
        pages and forget the steps in flight; their results."""
        self.pending, self._cancelled, aborted = [], [], []
        for request in self.requests.values():
            if request.status is not Status.FINISHED:
                request.finish("error")
                self.scheduler.release(request)
                aborted.append(request.result(self.config.detokenize))
        return aborted

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.pending or self._cancelled)

    # ---- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: dispatch the next steps, then read the previous ones; returns requests finished."""
        finished = []
        # forced tokens, and masks not filled during a forward (a placement's steps not in halves, or a decode
        # step run in a compiled prefill bucket until the background compilation reaches its own), need the
        # tokens in flight
        masks_later = self.placement.masks_during_forward and not self._compiling_in_background
        if (self.structured.jump_forward or not masks_later) and any(
                r.grammar is not None and r.in_flight for r in self.scheduler.running):
            finished, self.pending = self._read(self.pending), []
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
        self.weights = self.placement.after_step(self.weights, self.stats)  # a mesh's expert loads and EPLB
        if self.zero_overhead:
            with self.structured.overlapping(isinstance(decoding, _Forwarding)):
                finished += self._read(self.pending)  # the constrained rows' previous tokens, for their masks
        if decoding is not None:
            dispatched.insert(0, self._decide(decoding) if isinstance(decoding, _Forwarding) else decoding)
        if self.zero_overhead:
            self.pending = dispatched
        else:
            finished += self._read(dispatched)
        # a steady decode iteration (no prefill, nothing finished) times its step for the DSpark cost table
        steady = len(dispatched) == 1 and dispatched[0][2][1] == dispatched[0][2][2] and not finished
        self.speculation.observe_period(steady)
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

    def _dispatch_decode(self, rows: list[Row]):
        """The decode step: plain decoding, or a verify bucket whose drafts per row speculation chooses."""
        ranks = [self.scheduler.rank(row.request) for row in rows]
        width, budget, draft = self.speculation.decide(rows, ranks, self.scheduler.ranks, self.decode_rows,
                                                       self.zero_overhead, self.profile)
        return self._dispatch(rows, self.decode_rows, width, width, budget, draft=draft, decoding=True)

    def _dispatch(self, rows: list[Row], row_buckets: tuple[int, ...], width: int, verify_len: int,
                  budget: list[int] | None = None, draft: bool = True, decoding: bool = False):
        """Build the batch of a bucket, launch its compiled step (async) and do the host bookkeeping; a verify
        bucket's rows on each rank split its `budget` drafts (default: every row verifies its cap); `draft` False:
        a decode step whose drafter does not draft (the no-draft fallback). A decode / verify step (`decoding`) with
        constrained rows launches only its forward half: `_decide` fills the masks and launches the rest."""
        per_rank = self.scheduler.rows_per_rank(rows)
        held = max(self.scheduler.pages.held(row.request.slot) for row in rows) if len(self.context_pages) > 1 else 0
        bucket = self._ready((next(r for r in row_buckets if r >= per_rank), width, verify_len,
                              next(p for p in self.context_pages if p >= held)))
        executable = self._executable(bucket)
        later = decoding and isinstance(executable, CompiledHalves) and any(
            row.sample and row.request.grammar is not None for row in rows)
        # a mesh step lays the batch out over its ranks (`serving.core.engine_dp`): the bucket's rows are per rank
        batch = self._batch(rows, max(bucket[0], len(rows)), bucket[1], verify_len, bucket[3], budget,
                            masks=not later)._replace(draft=np.asarray(draft))
        for row in rows:
            if row.reset and row.start:  # a prefix hit starts at `start`: its snapshot, the prompt before it
                if row.restore is not None:
                    self.device_pages.restore(row.request.slot, row.restore)
                self.device_pages.start_prompt(row.request.slot, row.request.prompt[:row.start])
        if later:
            forwarded, self.cache = self._launch(bucket, executable, batch, half="forward")
            executable = self.compiled[bucket]  # compiled again if the loaded one failed
        else:
            outputs, self.cache = self._launch(bucket, executable, batch)
        if width == verify_len:
            self.speculation.dispatched(bucket[0], width, draft)
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

    def _ready(self, bucket: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        """`bucket`, or while the background compilation has not reached it (`compile_in_background`) the
        cheapest compiled bucket that holds its step: as many rows or more, as many tokens or more (a decode row
        runs in a prefill bucket as its chunk's first token), as much context or more, the same verify length
        (a verify bucket's width is its verify length). Without one, the step compiles its own."""
        return self.choices.choose(lambda: self._compiled_holding(bucket))

    def _compiled_holding(self, bucket: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        if bucket in self.compiled or not self._compiling_in_background:
            return bucket
        rows, width, verify_len, pages = bucket
        holding = [b for b in list(self.compiled) if b[0] >= rows and b[2] == verify_len and b[3] >= pages
                   and (b[1] >= width if verify_len == 1 else b[1] == width)]
        return min(holding, key=lambda b: (b[0] * b[1], b[3]), default=bucket)

    def _launch(self, bucket: tuple[int, int, int, int], executable, batch: StepBatch, half: str | None = None
                ) -> tuple:
        """Run a bucket's step (`half` "forward": only its forward half, `_decide` launches the rest) on the
        engine's cache. The first call of a bucket loaded from the executable cache keeps a copy of the cache
        (the step donates it) and is waited for: if the executable fails (an entry that loads but cannot run),
        its entry is dropped, the bucket compiled again and the step run on the copy."""
        def run(step):
            return (step if half is None else getattr(step, half))(self.weights, self.cache, batch)

        if bucket not in self._unproven:
            return run(executable)
        self._unproven.discard(bucket)
        kept = jax.tree.map(jnp.copy, self.cache)
        try:
            return jax.block_until_ready(run(executable))
        except jax.errors.JaxRuntimeError as e:
            LOG.warning("compiled step %s from the executable cache failed when run (%s); compiling it again",
                        bucket, e)
        self.cache = kept
        self.executables.drop(bucket)
        del self.compiled[bucket]
        return run(self._executable(bucket, load=False))

    def _decide(self, step: _Forwarding):
        """Fill the token masks of a step whose forward half runs (its rows' previous tokens are read by now)
        and launch its decide half."""
        done = step.forwarded.picked.is_ready
        bitmask = self.structured.bitmask_during_forward(step.rows, step.batch.bitmask, done)
        outputs, self.cache = step.executable.decide(self.weights, self.cache, step.batch._replace(bitmask=bitmask),
                                                     step.forwarded)
        jax.tree.map(lambda x: x.copy_to_host_async(), outputs)
        return step.rows, outputs, step.bucket

    def _batch(self, rows: list[Row], num_rows: int, width: int, verify_len: int, pages: int,
               budget: list[int] | None, masks: bool = True) -> StepBatch:
        """The step's host inputs (`pages`: its context bucket; `budget`: each rank's verify budget, None: the
        rows' caps); `masks` False: the token masks are left all allowed (`_decide` fills them)."""
        b = empty_batch(self.layout, num_rows, width, self._engram_shapes(), verify_len, pages)
        if masks:
            b = b._replace(bitmask=self.structured.bitmask(rows, b.bitmask))
        if self.engram is not None:
            self._engram_rows(b, rows)
        for i, row in enumerate(rows):
            n = len(row.tokens)
            b.tokens[i, :n], b.kinds[i, :n] = row.tokens, row.kinds
            b.slots[i], b.starts[i], b.counts[i], b.caps[i] = row.request.slot, row.start, n, row.caps
            b.from_prev[i], b.reset[i], b.sample[i] = row.from_prev, row.reset and row.restore is None, row.sample
            b.block_tables[i] = self.scheduler.block_table(row.request)[:pages]
            b.frozen[i], b.prompt_end[i] = row.frozen, row.prompt_end
            if not row.from_prev and scores(row.request, row.start, n):  # runs every position: no replay bound
                following = row.request.sequence[row.start + 1:row.start + n + 1]
                b.targets[i, :len(following)], b.scored[i], b.prompt_end[i] = following, True, 0
        if budget is None:
            b.budget[...] = b.caps.sum()
        else:  # one rank's step reads a scalar; a mesh step each rank's own (`DataParallel.place`)
            b = b._replace(budget=np.asarray(budget[0] if len(budget) == 1 else budget, np.int32))
        sampling = SamplingBatch.from_params([r.request.params for r in rows], num_rows)
        return b._replace(sampling=sampling)

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
            out = jax.tree.map(np.asarray, outputs._replace(**dict.fromkeys(PROMPT_FIELDS)))
            prompt = None  # the prompt-logprob fields, read only in a step with a scored row
            for i, row in enumerate(rows):
                request = row.request
                if not row.from_prev and request.status is not Status.FINISHED and scores(request, row.start,
                                                                                          len(row.tokens)):
                    prompt = prompt or [np.asarray(getattr(outputs, name)) for name in PROMPT_FIELDS]
                    done = record(request, row.start, *(x[i, :len(row.tokens)] for x in prompt))
                    if done and self.scheduler.prefix is not None:
                        self.prompt_store.put(request)
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
                kept = None if request.grammar is None else self.structured.commit(
                    request.grammar, out.tokens[i, :accepted + 1].tolist(), accepted)
                for j in range(accepted + 1 if kept is None else kept):
                    self._emit(request, out, i, j)
                    if request.status is Status.FINISHED:
                        break
                if kept is not None and request.status is not Status.FINISHED:
                    request.finish("stop")
                if self.structured.jump_forward and request.status is Status.RUNNING:
                    jump_forward(request, self.model_config.eos_token_id, self.config.detokenize)
                if request.status is Status.FINISHED:
                    self.scheduler.release(request)
                    finished.append(request.result(self.config.detokenize))
        return finished

    def _emit(self, request: Request, out, i: int, j: int) -> None:
        """Give `request` the token of row i, verify position j. Alternatives a constraint refuses (logprob -inf)
        are left out of the top logprobs."""
        n = request.params.logprobs
        token = int(out.tokens[i, j])
        lp = None if n is None else TokenLogprob(
            token, float(out.logprob[i, j]), [(int(t), float(v)) for t, v in zip(out.top_ids[i, j, :n],
                                                                               out.top_logprobs[i, j, :n])
                                              if v > -np.inf])
        if self.config.return_logits:
            request.logits = (request.logits or []) + [out.logits[i, j]]
        self.stats["decode_tokens"] += 1
        request.accept(token, lp, self.model_config.eos_token_id, self.config.detokenize)

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
