"""Every setting of a serving `Engine`, in one frozen dataclass: built once (by the CLI, the server, a script) and
passed as `Engine(model, config)`; `Engine(model, max_slots=..., ...)` builds one from keywords. Settings are
checked here where that needs no model; what depends on the model (the drafter's block size, the window ring)
is checked when the engine is built.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Sequence

from jax.sharding import Mesh

from model.replay import ENGINE_DEFAULT, Replay
from serving.grammar_budget import ClosePolicy
from sharding.mesh import MeshSpec

MAX_TOP_LOGPROBS = 20
SPECULATION = ("none", "fixed", "dspark")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """An engine's settings (see `serving.engine` for what each mechanism does). Raises ValueError naming the
    setting when one is out of range or two do not go together."""

    # ---- capacity and batching
    max_slots: int = 8  # concurrent requests
    max_len: int = 1024  # tokens per request (prompt + output)
    num_pages: int | None = None  # pages in the shared compressed-KV pool (None: kv_cache_memory, else every slot at max_len)
    kv_cache_memory: int | None = None  # bytes of the shared page pools, instead of num_pages
    page_tokens: int | None = None  # tokens per page (None: the cache layout's default)
    prefill_chunk: int = 64  # prompt tokens per prefill row
    max_prefill_rows: int = 2  # prefill rows per step
    token_budget: int | None = None  # tokens per iteration (None: max_slots + max_prefill_rows x prefill_chunk)
    batch_invariant: bool = False  # one bucket per step kind, budget-independent chunks: outputs never see the batch
    zero_overhead: bool = True  # read step N after dispatching step N+1 (always off for Engram models)
    context_tokens: int = 1024  # the smallest context bucket: a step reads the power-of-two multiple covering its longest row
    layer_programs: bool | None = None  # V4: the forward as one program per kind of layer (None: where supported)
    host_layout: bool = False  # CPU: hold the model's fp32 matrices transposed, in place (`model.host_layout`)
    # ---- outputs
    num_top_logprobs: int = 5  # top alternatives computed per token (a request's logprobs may ask up to this)
    return_logits: bool = False  # keep every row's last-position logits on its request (tests)
    seed: int = 0  # draws the seeds of requests that come without one
    detokenize: Callable[[list[int]], str] | None = None  # token ids to text (stop strings, results' text)
    # ---- speculative decoding (the model's DSpark drafter, else a V4 checkpoint's MTP block: `model.mtp_drafter`)
    speculation: str = "none"  # "none"; "fixed": verify every draft; "dspark": drafts per row by confidence and cost
    num_drafts: int | None = None  # drafts verified per step at most (None: the drafter's block size)
    verify_widths: Sequence[int] | None = None  # DSpark verify buckets, 1 + drafts (None: 2 .. num_drafts + 1)
    backtrack: int = 0  # extra window-ring slots (speculation takes at least num_drafts + 1)
    draft_fallback: bool = True  # DSpark: when no verify budget pays, decode without drafting, probing now and then
    probe_every: int = 8  # DSpark fallback: plain steps before a drafting probe (doubled per futile probe, to 8x)
    # ---- prefix cache and replay
    prefix_cache: bool | None = None  # share cached prompt prefixes' pages (None: on unless batch_invariant)
    prefix_replay: int | None = None  # tokens replayed before a hit's end (None: the exact replay; fewer: approximate)
    host_pages: int = 0  # evicted prefix pages kept in host memory
    prefix_snapshots: int | None = None  # window-state snapshots kept for prefix hits (None: 8 per slot; 0: replay)
    replay: Replay | None = ENGINE_DEFAULT  # V4.1 prefill's replay layers bounded to the last `keep` tokens (None: off)
    # ---- structured outputs
    constraint_close: ClosePolicy | None = ClosePolicy()  # closes constrained outputs by max_tokens (None: may cut)
    jump_forward: bool = False  # a constrained request takes the tokens its grammar forces in one prefill row
    # ---- data parallelism (`serving.engine_dp`): no speculation or prefix cache there
    mesh: Mesh | MeshSpec | str | None = None  # e.g. "dp=4,ep=2": slots and steps over attention ranks, experts over ep
    redundant_experts: int = 0  # EPLB: extra expert slots per MoE layer (needs a mesh with ep > 1)
    eplb_every: int = 0  # EPLB: steps between rebalances (0: never)
    eplb_window: int = 100  # EPLB: steps of expert load a rebalance weighs

    def __post_init__(self):
        for name in ("max_slots", "max_len", "prefill_chunk", "max_prefill_rows", "probe_every", "eplb_window",
                     "context_tokens"):
            _check_int(name, getattr(self, name), 1)
        for name in ("num_pages", "kv_cache_memory", "page_tokens", "token_budget", "num_drafts", "prefix_replay"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        for name in ("backtrack", "host_pages"):
            _check_int(name, getattr(self, name), 0)
        if self.prefix_snapshots is not None:
            _check_int("prefix_snapshots", self.prefix_snapshots, 0)
        if self.kv_cache_memory is not None and self.num_pages is not None:
            raise ValueError("give kv_cache_memory or num_pages, not both")
        if not 0 <= self.num_top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"num_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.num_top_logprobs!r}")
        if self.speculation not in SPECULATION:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION)}, got {self.speculation!r}")
        if self.verify_widths is not None:
            widths = tuple(sorted(set(self.verify_widths)))
            if not widths or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 2 for w in widths):
                raise ValueError(f"verify_widths must be integers >= 2 (1 + drafts), got {self.verify_widths!r}")
            object.__setattr__(self, "verify_widths", widths)
        if self.constraint_close is not None and not isinstance(self.constraint_close, ClosePolicy):
            raise ValueError(f"constraint_close must be a ClosePolicy or None, got {self.constraint_close!r}")
        if self.layer_programs is not None and not isinstance(self.layer_programs, bool):
            raise ValueError(f"layer_programs must be True, False or None, got {self.layer_programs!r}")
        if self.mesh is not None and self.layer_programs:
            raise ValueError("a data-parallel engine (mesh=...) runs its step as one program: layer_programs=True "
                             "is single-device")
        if not isinstance(self.host_layout, bool):
            raise ValueError(f"host_layout must be True or False, got {self.host_layout!r}")
        if self.mesh is not None and self.host_layout:
            raise ValueError("host_layout=True is for a single-device CPU engine: a data-parallel engine (mesh=...) "
                             "places the weights in the checkpoint layout")
        if self.mesh is None and (self.redundant_experts or self.eplb_every):
            raise ValueError("EPLB (redundant_experts, eplb_every) needs a mesh with ep > 1 (mesh=...)")
        if not self.uses_prefix_cache and (self.prefix_replay is not None or self.host_pages or self.prefix_snapshots):
            raise ValueError("prefix_replay, host_pages and prefix_snapshots need prefix_cache=True")

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether the engine keeps a prefix cache: `prefix_cache`, by default on unless batch-invariant (a hit
        changes how a prompt is chunked)."""
        return not self.batch_invariant if self.prefix_cache is None else self.prefix_cache

    def __reduce__(self):
        """Pickled (to a prefill process, `serving.disagg`) as the settings that differ from the defaults, so a
        default keeps its identity (`model.replay.ENGINE_DEFAULT` is recognised by identity)."""
        changed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) is not f.default}
        return functools.partial(EngineConfig, **changed), ()


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        kind = "a non-negative integer" if low == 0 else f"an integer >= {low}"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
