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

from model.host_layout import unsupported_here
from model.replay import DEFAULT_KEEP, ENGINE_DEFAULT, MODES, Replay
from sharding.mesh import MeshSpec

MAX_TOP_LOGPROBS = 20
SPECULATION = ("none", "fixed", "dspark")


@dataclasses.dataclass(frozen=True)
class ClosePolicy:
    """When close mode acts: in the last `window` tokens of a request's `max_tokens` the closing path is
    searched, and the mask is cut to it once the tokens left are at most its length + `margin`. The search runs
    every step once the tokens left come within `watch` of that point (as the last search saw it), and every
    `watch // 2` tokens before; `max_bytes` and `max_nodes` bound one search."""

    window: int = 64
    margin: int = 4
    watch: int = 16
    max_bytes: int = 256
    max_nodes: int = 512

    def __post_init__(self):
        if min(self.window, self.watch, self.max_bytes, self.max_nodes) < 1 or self.margin < 0:
            raise ValueError(f"close policy needs window, watch, max_bytes, max_nodes >= 1 and margin >= 0, "
                             f"got {self}")

    def search_due(self, left: int, last: tuple[int, int | None] | None) -> bool:
        """Whether to search the closing path with `left` tokens left, given (tokens left, closing tokens or
        None) at the last search."""
        if last is None:
            return True
        searched_left, tokens = last
        near = tokens is not None and left <= tokens + self.margin + self.watch
        return near or searched_left - left >= max(1, self.watch // 2)


@dataclasses.dataclass(frozen=True)
class Flag:
    """A setting's command-line flag: `jaxseek generate` and `jaxseek serve` build their engine flags and the
    config from these (`jaxseek.flags.add_engine_flags`, `engine_config`). `names`: the flag, then its aliases;
    how its text is read (`kind`): "int" (an integer >= `minimum`), "size" (bytes, or with a unit: 512M, 8GiB),
    "text", "choice" (one of `choices`), "switch" (given: True), "negated" (given: False), "toggle" (--x or
    --no-x for each name; unset: the field's default). A flag whose value is unset leaves the field's default."""

    names: tuple[str, ...]
    help: str
    kind: str = "int"
    minimum: int = 1
    choices: tuple[str, ...] = ()
    metavar: str | None = None


def _flag(default, *names: str, help: str, **how):
    """A field declared with its flag (`Flag`)."""
    return dataclasses.field(default=default, metadata={"flags": (Flag(names, help, **how),)})


def _replay(mode: str | None, keep: int | None) -> Replay | None:
    """The `replay` setting of its two flags (both unset: None, the engine's default)."""
    return None if mode is None and keep is None else Replay(mode or "compact", keep or DEFAULT_KEEP)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """An engine's settings (see `serving.core.engine` for what each mechanism does). Raises ValueError naming the
    setting when one is out of range or two do not go together. A field with a command-line flag declares it
    (`Flag`, in the field's metadata; a field read from several flags also names how they combine)."""

    # ---- capacity and batching
    max_slots: int = _flag(8, "--max-num-seqs", "--max-slots", help="concurrent requests (default 8)")
    max_len: int = _flag(1024, "--max-model-len", "--max-len",
                         help="tokens per request, prompt + output (default 1024)")
    num_pages: int | None = _flag(None, "--num-kv-pages", "--num-pages", "--num-gpu-blocks-override", metavar="N",
                                  help="KV-cache pages in the pool (default: enough for every slot at max-model-len)")
    kv_cache_memory: int | None = _flag(None, "--kv-cache-memory", kind="size", metavar="BYTES",
                                        help="size the KV pool by memory instead (bytes, or e.g. 512M, 8GiB)")
    page_tokens: int | None = None  # tokens per page (None: the cache layout's default)
    prefill_chunk: int = _flag(64, "--prefill-chunk", help="prompt tokens per prefill row (default 64)")
    max_prefill_rows: int = 2  # prefill rows per step
    token_budget: int | None = _flag(None, "--max-num-batched-tokens", "--token-budget", metavar="N",
                                     help="tokens one engine step processes at most, decode rows and prefill chunks "
                                          "together (default: max-num-seqs + 2 x prefill-chunk)")
    batch_invariant: bool = _flag(False, "--batch-invariant", kind="switch",
                                  help="a request's tokens never depend on what else runs (one bucket per step kind)")
    zero_overhead: bool = _flag(True, "--no-zero-overhead", kind="negated",
                                help="read each step's results before dispatching the next (always so for Engram "
                                     "models)")
    context_tokens: int = 1024  # the smallest context bucket: a step reads the power-of-two multiple covering its longest row
    layer_programs: bool | None = _flag(
        None, "--layer-programs", kind="toggle",
        help="run the step's layers as one compiled program per kind of layer, so compile time does not grow "
             "with depth (default: on one device V4 models, and V4.1 models of 16 layers or more; on a mesh models "
             "of 16 layers or more; shallower ones compile about as fast and decode faster as one program)")
    host_layout: bool | None = _flag(
        None, "--host-layout", kind="toggle",
        help="on the CPU backend: hold the fp32 linear maps and routed-expert weights transposed, in place, the "
             "layout XLA:CPU multiplies fastest (default: on a CPU without --mesh)")
    # ---- outputs
    num_top_logprobs: int = 5  # top alternatives computed per token (a request's logprobs may ask up to this)
    return_logits: bool = False  # keep every row's last-position logits on its request (tests)
    seed: int = 0  # draws the seeds of requests that come without one
    detokenize: Callable[[list[int]], str] | None = None  # token ids to text (stop strings, results' text)
    # ---- speculative decoding (the model's DSpark drafter, else a V4 checkpoint's MTP block: `model.mtp_drafter`)
    speculation: str = _flag("none", "--speculation", kind="choice", choices=SPECULATION,
                             help="speculative decoding with the model's DSpark drafter (else a V4 checkpoint's MTP "
                                  "block): verify every draft (fixed) or as many as its confidences and the verify "
                                  "buckets' cost make worthwhile (dspark); lossless")
    num_drafts: int | None = _flag(None, "--num-drafts", help="drafts per step at most (default: the drafter's "
                                   "block size)")
    verify_widths: Sequence[int] | None = None  # DSpark verify buckets, 1 + drafts (None: 2 .. num_drafts + 1)
    backtrack: int = 0  # extra window-ring slots (speculation takes at least num_drafts + 1)
    draft_fallback: bool = True  # DSpark: when no verify budget pays, decode without drafting, probing now and then
    probe_every: int = 8  # DSpark fallback: plain steps before a drafting probe (doubled per futile probe, to 8x)
    # ---- prefix cache and replay
    prefix_cache: bool | None = _flag(None, "--enable-prefix-caching", "--prefix-cache", kind="toggle",
                                      help="share the KV pages of cached prompt prefixes (default: on unless "
                                           "--batch-invariant)")
    prefix_replay: int | None = None  # tokens replayed before a hit's end (None: the exact replay; fewer: approximate)
    host_pages: int = _flag(0, "--host-pages", minimum=0, help="evicted prefix-cache pages kept in host memory and "
                            "restored instead of recomputed")
    prefix_snapshots: int | None = _flag(None, "--prefix-snapshots", minimum=0,
                                         help="window-state snapshots kept for prefix-cache hits (default 8 per "
                                              "slot; 0: replay instead)")
    replay: Replay | None = dataclasses.field(default=ENGINE_DEFAULT, metadata={"flags": (
        Flag(("--replay",), "V4.1 bounded decoder replay in prefill (default compact; off: every layer on every "
             "token)", kind="choice", choices=MODES),
        Flag(("--replay-keep",), "prompt tokens the replay layers see (default 140, at least window + "
             "backtracking)", metavar="N")), "combine": _replay})
    # ---- structured outputs
    constraint_close: ClosePolicy | None = ClosePolicy()  # closes constrained outputs by max_tokens (None: may cut)
    jump_forward: bool = _flag(False, "--jump-forward", kind="switch",
                               help="a constrained request takes the tokens its grammar forces without sampling them")
    # ---- data parallelism (`serving.core.engine_dp`)
    mesh: Mesh | MeshSpec | str | None = _flag(
        None, "--mesh", kind="text", metavar="SPEC",
        help="serve on a device mesh, e.g. dp=4,ep=2: requests and paged caches split over the dp attention ranks "
             "(a prefix cache per rank), routed experts over ep, prefill chunks over cp (balanced CP)")
    redundant_experts: int = _flag(0, "--redundant-experts", minimum=0,
                                   help="with --mesh and ep > 1: EPLB replica slots per MoE layer")
    eplb_every: int = _flag(0, "--eplb-every", minimum=0, help="with --mesh and ep > 1: steps between EPLB "
                            "rebalances (0: never)")
    eplb_window: int = _flag(100, "--eplb-window", help="with --eplb-every: steps of expert load a rebalance weighs "
                             "(default 100)")

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
        if self.host_layout is not None and not isinstance(self.host_layout, bool):
            raise ValueError(f"host_layout must be True, False or None, got {self.host_layout!r}")
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

    @property
    def uses_host_layout(self) -> bool:
        """Whether the engine holds the model in the host layout: `host_layout`, by default (None) where it
        applies, a one-device engine on the CPU backend with the reference kernels. Raises ValueError for
        host_layout=True where it cannot apply."""
        why = unsupported_here()
        if self.host_layout and why:
            raise ValueError(f"host_layout=True is the CPU backend's weight layout (with the reference kernels): {why}")
        return self.mesh is None and why is None if self.host_layout is None else self.host_layout

    def __reduce__(self):
        """Pickled (to a prefill process, `serving.api.disagg`) as the settings that differ from the defaults, so a
        default keeps its identity (`model.replay.ENGINE_DEFAULT` is recognised by identity)."""
        changed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) is not f.default}
        return functools.partial(EngineConfig, **changed), ()


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        kind = "a non-negative integer" if low == 0 else f"an integer >= {low}"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
