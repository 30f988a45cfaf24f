"""A V4 or V4.1 engine step's forward half as one compiled program per kind of layer, so a bucket's compile time is
set by how many kinds of layer the model has, not by its depth.

The whole step (`serving.core.step`) unrolls every layer into one program: compiling a bucket costs time in
proportion to the layer count. Here the forward half is a chain of programs the host launches:

1. `embed`: the rows' inputs (`serving.core.step.row_inputs`) and the streams they enter the first layer with;
2. per layer, the program of its kind, given that layer's weights and cache state: it gathers the rows' slot
   state, runs the block, writes the state back (the state is donated, so it updates in place);
3. `head`: the logits at the verify positions and the drafter's features.

Layers with the same structure (graph, parameter and cache shapes; on V4.1 also what they read of earlier layers
and whether they are replay layers) share one compiled program: V4-Flash's 43 layers are 5 kinds. Launches are
asynchronous, so the host runs ahead of the device as with one program; each layer costs a launch. The decide
half is the whole step's. Each piece runs the code the whole step traces, so tokens and logits equal it
(tests/test_layer_programs.py).

On the CPU backend, a bucket of fewer (token, expert) pairs than experts (decode of a token or two) passes each
layer's float expert stacks as per-expert views (`xla_cpu.expert_views`: aliases of the stack, made once),
so the chosen experts are multiplied where they lie instead of being copied out of the stack first.

V4.1 layers read other layers' state: a KV / index source's page pools (its own state, donated to its program and
returned updated) go to the later layers' programs as read-only inputs, so no pool is copied or returned twice;
the per-query picks and candidate pool pass from program to program, and so do the mHC `pre` weights with the
streams. Bounded replay (`model.replay`) adds `enter` before the replay layers (`mask`: the floor and the
positions updated; `compact`: each row's kept tail gathered) and, for `compact`, `leave` after them (scattered
back); each `compact` replay layer skips itself under a `lax.cond` when no row keeps a token, as the whole step
skips them all.

The engine runs them on one device and on a mesh, where `serving.core.engine_dp` lowers each program (and the decide
half) inside a `shard_map` of its own (`Lowering`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from model import registry
from model.paged import is_paged, unbound
from model.pytree import replace
from model.replay import Replay, kept_span, take_positions
from model.transformer import Block, input_streams, project_logits
from model.v41 import BlockV41, first_streams, kept_run, masked_rows, mixed_logits, put_kept, replays, run_layer, tap
from serving.base.kv_cache import EngineCache, layer_rows, put_rows
from serving.core.step import (CompiledHalves, Forwarded, RowInputs, StepBatch, StepHalves, abstract_shapes, compile_decide,
                          forwarded, prompt_logprobs, replay_prompt_end, row_inputs, split_cache)
from xla_cpu.expert_views import ExpertViews, expert_views
from xla_cpu.moe import viewed
from xla_cpu.transposed_weights import HELD_KEY


def layer_key(block) -> tuple:
    """What makes two blocks interchangeable in one compiled program: the same graph and parameter shapes and
    dtypes."""
    graphdef, state = nnx.split(block)
    return graphdef, jax.tree.structure(state), tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))


# the depth from which a V4.1 model, and any model on a mesh, runs as layer programs by default (`LayerPlan.unpaid`)
FROM_LAYERS = 16


class LayerBatch(NamedTuple):
    """What a layer program reads of the step's batch (an output of the embed program: on the device with it)."""

    slots: Int[Array, " r"]
    block_tables: Int[Array, "r p"]
    frozen: Int[Array, " r"]
    reset: Bool[Array, " r"]
    prompt_end: Int[Array, " r"]
    engram_rows: tuple  # V4.1: per Engram layer, the looked-up table rows


class LayerInput(NamedTuple):
    """What a layer runs on besides its weights and state: streams, the next site's `pre` weights (V4.1; None on
    V4), the tokens, their start and count per row, the layer's Engram rows, and in the replay layers the replay
    floor, the positions `mask` updates and whether `compact` runs them (None where unused)."""

    streams: Float[Array, "r t n d"]
    pre_mix: Float[Array, "r t n"] | None
    tokens: Int[Array, "r t"]
    starts: Int[Array, " r"]
    counts: Int[Array, " r"]
    engram: Float[Array, "r t k e"] | None = None
    floor: Int[Array, " r"] | None = None
    kept: Bool[Array, "r t"] | None = None
    go: Bool[Array, ""] | None = None


@dataclasses.dataclass(frozen=True)
class Piece:
    """A sub-module's place in the model's flat parameter leaves: its graph, the indices of its leaves and their
    tree structure."""

    graphdef: object
    leaves: tuple[int, ...]
    tree: object

    def take(self, leaves: list) -> list:
        return [leaves[i] for i in self.leaves]

    def module(self, leaves: list):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.tree, leaves))


def _key_paths(tree) -> list[tuple]:
    """Each leaf's key path as plain keys (`("layers", 3, "attn", "wq_a", "weight", "value")`), in leaf order."""
    return [tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _piece(module, paths: list[tuple], prefix: tuple) -> Piece:
    """The `Piece` of the sub-module at key path `prefix` of a model whose parameter leaves have `paths`."""
    sub = module
    for key in prefix:
        sub = sub[key] if isinstance(key, int) else getattr(sub, key)
    graphdef, state = nnx.split(sub)
    leaves = tuple(i for i, path in enumerate(paths) if path[:len(prefix)] == prefix)
    if [paths[i][len(prefix):] for i in leaves] != _key_paths(state):
        raise ValueError(f"the parameters under {prefix} do not flatten in the sub-module's order")
    return Piece(graphdef, leaves, jax.tree.structure(state))


def _shared_reads(module, empty_layers: list) -> list[tuple]:
    """Per V4.1 layer, what it finds of its predecessors' shared state (`BlockV41`): each published page pool's
    name and shape, and which per-query results (index picks, candidate pool) are published. Part of a layer's
    kind: a program is compiled for one structure of what it reads."""
    reads, published, flow = [], {}, set()
    for block, empty in zip(module.layers, empty_layers):
        reads.append((tuple(sorted(published.items())), tuple(sorted(flow))))
        attn = block.attn
        published |= {name: leaf.pages.shape for name, leaf in empty.items() if is_paged(leaf)}
        if attn.ratio and attn.is_index_source:
            flow |= {"picks", "candidates"} if attn.is_candidate_source else {"picks"}
    return reads


def _flow(shared: dict) -> dict:
    """What a V4.1 layer program hands on of the shared state: the per-query results, not the page pools (the
    sources' states are passed instead, so no pool is returned twice) nor the replay floor (an input)."""
    return {k: v for k, v in shared.items() if not is_paged(v) and k != "replay_floor"}


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How a model's forward half splits: the embedding, each layer (and the kind it shares a program with), the
    head, and the layers whose output streams the drafter reads. On V4.1 also the layers whose page pools later
    layers read and, with bounded replay, the first replay layer."""

    embed: Piece
    layers: tuple[Piece, ...]
    kinds: tuple[int, ...]  # per layer, the index of the first layer of its kind
    head: tuple[Piece, ...]  # hc_head, norm, head (V4); norm, head (V4.1)
    hc_mult: int
    empty_layers: tuple  # one-row empty state per layer (a reset row starts from it)
    collect: tuple[int, ...]
    experts: tuple[int, ...]  # the leaves that are float routed-expert stacks [E, ...]
    n_experts: int
    top_k: int
    v41: bool = False
    published: tuple[tuple[str, ...], ...] = ()  # V4.1: per layer, the page pools of its state later layers read
    engram: tuple[int, ...] = ()  # V4.1: the Engram layers, in `StepBatch.engram_rows` order
    replay: Replay | None = None  # V4.1 prefill's bounded replay (`model.replay`)
    split: int = 0  # the first replay layer (the depth without replay)

    @classmethod
    def supports(cls, model) -> str | None:
        """Why `model` cannot run as layer programs (None: it can)."""
        layers = model.module().layers
        if not (all(isinstance(entry, Block) for entry in layers) or all(isinstance(e, BlockV41) for e in layers)):
            return "its layers are neither all V4 nor all V4.1 blocks"
        return None

    @classmethod
    def unpaid(cls, model, ranks: int = 1) -> str | None:
        """Why `model`, which can run as layer programs on `ranks` attention ranks, runs as one program unless
        asked (None: layer programs pay): below `FROM_LAYERS` layers a V4.1 model on one device, and any model on
        a mesh, compiles about as fast and decodes faster as one program (docs/benchmarks.md)."""
        depth = len(model.module().layers)
        if depth >= FROM_LAYERS:
            return None
        if ranks > 1:
            return f"on a mesh, a model of {depth} layers (< {FROM_LAYERS}) compiles and decodes faster as one program"
        if isinstance(model.module().layers[0], BlockV41):
            return f"a V4.1 model of {depth} layers (< {FROM_LAYERS}) compiles and decodes faster as one program"
        return None

    @classmethod
    def for_model(cls, model, empty_layers: list, collect: tuple[int, ...], replay: Replay | None = None
                  ) -> LayerPlan:
        module, paths, config = model.module(), _key_paths(model.params), model.config
        v41 = isinstance(module.layers[0], BlockV41)
        split = config.n_prefill_layer if v41 and replay is not None else len(module.layers)
        reads = _shared_reads(module, empty_layers) if v41 else [()] * len(module.layers)
        keys = [(layer_key(block), jax.tree.structure(empty), tuple(leaf.shape for leaf in jax.tree.leaves(empty)),
                 read, i >= split, v41 and i in collect)
                for i, (block, empty, read) in enumerate(zip(module.layers, empty_layers, reads))]
        float_experts = {i for i, block in enumerate(module.layers)
                         if block.ffn.experts.stacked()[0] == "routed_experts"}
        stacks = {("ffn", "experts", name, "value") + held for name in ("w1", "w2", "w3") for held in ((), (HELD_KEY,))}
        experts = tuple(i for i, path in enumerate(paths) if path[0] == "layers" and path[1] in float_experts
                        and path[2:] in stacks)  # held as they are or transposed (`model.host_layout`)
        return cls(_piece(module, paths, ("embed",)),
                   tuple(_piece(module, paths, ("layers", i)) for i in range(len(module.layers))),
                   tuple(keys.index(key) for key in keys),
                   tuple(_piece(module, paths, (name,)) for name in (("norm", "head") if v41 else
                                                                     ("hc_head", "norm", "head"))),
                   config.hc_mult, tuple(empty_layers), tuple(collect), experts,
                   config.n_routed_experts, config.num_experts_per_tok, v41,
                   tuple(tuple(name for name, leaf in empty.items() if is_paged(leaf)) for empty in empty_layers) if v41
                   else (), tuple(getattr(config, "engram_layer_ids", ())), replay if v41 else None, split)

    @property
    def extra(self) -> tuple[str, ...]:
        """The programs around the replay layers: `enter` (mask and compact) and `leave` (compact)."""
        return () if self.replay is None else ("enter", "leave") if self.replay.mode == "compact" else ("enter",)

    def viewed(self, rows: int, width: int) -> bool:
        """Whether a bucket of `rows` x `width` tokens passes the float expert stacks as per-expert views: on the
        CPU backend with its XLA:CPU forms, when the step's pairs are few enough to run one by one and their
        switches over the experts stay few (`xla_cpu.moe.viewed`)."""
        return bool(self.experts) and registry.runs_host_forms() and viewed(rows * width * self.top_k,
                                                                             self.n_experts)

    def with_views(self, leaves: list, views) -> list:
        """`leaves` with each float expert stack replaced by `views(stack)`, a tuple with one entry per expert."""
        out = list(leaves)
        for i in self.experts:
            out[i] = views(leaves[i])
        return out

    def program(self, name, verify_len: int, num_top: int) -> tuple[Callable, tuple[int, ...]]:
        """(the program `name`: "embed", a layer kind (int), "enter", "leave" or "head"; its donated arguments)."""
        if isinstance(name, int):
            return self.layer_program(name), (1,)
        if name == "embed":
            return functools.partial(self.embed_program, verify_len=verify_len), ()
        if name == "head":
            return functools.partial(self.head_program, num_top=num_top), ()
        return getattr(self, f"{name}_program"), ()

    def embed_program(self, leaves: list, cache: EngineCache, batch: StepBatch, verify_len: int):
        """(the rows' inputs, what the first layer runs on, what the layer programs read of the batch) of the step
        (`cache`: without its layer state); the layer batch comes out on the device with them, so the host places
        nothing more per step."""
        rows = row_inputs(cache, batch, verify_len)
        layer_batch = LayerBatch(batch.slots, batch.block_tables, batch.frozen, batch.reset, batch.prompt_end,
                                 batch.engram_rows)
        embed = self.embed.module(leaves)
        streams, pre_mix = (first_streams(embed, rows.tokens, self.hc_mult) if self.v41 else
                            (input_streams(embed, rows.tokens, self.hc_mult), None))
        return rows, LayerInput(streams, pre_mix, rows.tokens, rows.starts, rows.counts), layer_batch

    def layer_program(self, layer: int):
        """The program of layer `layer`'s kind: (weights, its cache state, `LayerInput`, what it reads of the
        earlier layers' shared state (V4.1), layer batch) -> (streams, pre_mix, its new cache state, the shared
        per-query results it hands on, its drafter tap (V4.1: taken inside, as `model.v41` does; else None))."""
        piece, empty = self.layers[layer], self.empty_layers[layer]
        tapped = self.v41 and layer in self.collect

        def run(leaves: list, state: dict, x: LayerInput, shared: dict, batch: LayerBatch):
            block = piece.module([ExpertViews(leaf) if isinstance(leaf, tuple) else leaf for leaf in leaves])
            row_state = layer_rows([state], batch.slots, batch.block_tables, batch.frozen, [empty], batch.reset)[0]
            if not self.v41:
                streams, new = block(x.streams, x.tokens, x.starts, row_state, x.counts)
                return streams, None, put_rows([state], batch.slots, [new])[0], {}, None
            if x.floor is not None:
                shared = {**shared, "replay_floor": x.floor}

            def forward():
                streams, pre_mix, new, out = run_layer(block, x.streams, x.pre_mix, x.tokens, x.starts, row_state,
                                                       shared, x.engram, x.counts, x.kept)
                return streams, pre_mix, unbound(new), _flow(out)

            streams, pre_mix, new, flow = forward() if x.go is None else jax.lax.cond(
                x.go, forward, lambda: (x.streams, x.pre_mix, unbound(row_state), _flow(shared)))
            new = put_rows([state], batch.slots, [new])[0]
            return streams, pre_mix, new, flow, tap(streams) if tapped else None

        return run

    def enter_program(self, x: LayerInput, flow: dict, rows: RowInputs, batch: LayerBatch):
        """What the replay layers run on (`model.replay`): (their `LayerInput`, shared per-query results, Engram
        rows by layer, the kept span). `mask`: every position, with the floor and the positions it updates;
        `compact`: each row's kept tail, gathered (`model.v41.kept_run`), and whether any row keeps a token."""
        replay, (r, width) = self.replay, x.tokens.shape
        span = kept_span(rows.starts, rows.counts, replay_prompt_end(replay, batch.prompt_end, rows), replay.keep, r)
        engram = dict(zip(self.engram, batch.engram_rows))
        if replay.mode == "mask":
            return x._replace(floor=span[2], kept=masked_rows(span, width)), flow, engram, span
        layer_ids = range(self.split, len(self.layers))
        streams, pre_mix, tokens, engram, shared = kept_run((x.streams, x.pre_mix, x.tokens, engram, flow), span,
                                                            min(width, replay.keep), layer_ids)
        return (LayerInput(streams, pre_mix, tokens, rows.starts + span[0], span[1], floor=shared["replay_floor"],
                           go=replays(span)), _flow(shared), engram, span)

    def leave_program(self, before: LayerInput, after: LayerInput, taps: dict, span: tuple):
        """`compact` replay's exit: the replay layers' kept rows of (streams, pre_mix, taps) scattered back into
        what entered them (`model.v41.put_kept`)."""
        unchanged = tap(before.streams)
        return (put_kept(span, before.streams, after.streams), put_kept(span, before.pre_mix, after.pre_mix),
                {i: put_kept(span, unchanged, t) for i, t in taps.items()})

    def head_program(self, leaves: list[list], x: LayerInput, taps: list, rows: RowInputs, num_top: int
                     ) -> Forwarded:
        """The verify positions' logits, the drafter's features (the taps, flattened, in order) and the scored
        rows' prompt logprobs with `num_top` alternatives; `leaves`: the head pieces' leaves (`head_leaves`)."""
        parts = [piece.module(piece_leaves) for piece, piece_leaves in zip(self.head, leaves)]
        if self.v41:
            logits = lambda at: mixed_logits(*parts, take_positions(x.streams, at),  # noqa: E731
                                             take_positions(x.pre_mix, at))
        else:
            logits = lambda at: project_logits(*parts, take_positions(x.streams, at))  # noqa: E731
        features = jnp.concatenate([t.reshape(*t.shape[:2], -1) for t in taps], axis=-1) if taps else None
        return forwarded(logits(rows.at), features, rows, prompt_logprobs(lambda: logits(None), rows, num_top))

    def head_leaves(self, leaves: list) -> list[list]:
        """The leaves of the head pieces, one list each."""
        return [piece.take(leaves) for piece in self.head]

    def chain(self, call: Callable, leaves: list, cache: EngineCache, batch: StepBatch) -> tuple[Forwarded, list]:
        """The forward half as the chain of programs the host launches, `call(name, *args)` running (or compiling)
        each (`program`): embed, the layers in order (V4.1: each given the page pools of the latest sources as
        read-only inputs, the sources' own donated-then-returned states), the replay programs around the replay
        layers, the head. Returns (the head's `Forwarded`, the new layer states)."""
        rest, _ = split_cache(cache)
        rows, x, batch = call("embed", self.embed.take(leaves), rest, batch)
        states, taps, sources, flow = list(cache.layers), {}, {}, {}
        engram, before, span = dict(zip(self.engram, batch.engram_rows)), None, None
        for i, (kind, piece) in enumerate(zip(self.kinds, self.layers)):
            if i == self.split:
                before = x
                x, flow, engram, span = call("enter", x, flow, rows, batch)
            shared = {name: replace(states[j][name], table=batch.block_tables, frozen=batch.frozen)  # shapes too
                      for name, j in sources.items()}
            x = x._replace(engram=engram.get(i))
            streams, pre_mix, states[i], flow, tapped = call(kind, piece.take(leaves), states[i], x,
                                                             {**shared, **flow}, batch)
            x = x._replace(streams=streams, pre_mix=pre_mix)
            sources |= {name: i for name in (self.published[i] if self.v41 else ())}
            if i in self.collect:
                taps[i] = streams if tapped is None else tapped
        if "leave" in self.extra:
            streams, pre_mix, replayed = call("leave", before, x, {i: taps[i] for i in taps if i >= self.split}, span)
            x, taps = x._replace(streams=streams, pre_mix=pre_mix), {**taps, **replayed}
        return call("head", self.head_leaves(leaves), x, [taps[i] for i in self.collect], rows), states


class LayeredForward:
    """The forward half as launched programs: `(target leaves, cache, batch) -> (Forwarded, cache)`; `viewed`: the
    layer programs take per-expert views of the float expert stacks (`LayerPlan.viewed`)."""

    def __init__(self, plan: LayerPlan, programs: dict, viewed: bool):
        self.plan, self.programs, self.viewed = plan, programs, viewed
        self.views: tuple[list, list] | None = None  # (target leaves, the same with expert views), made once

    def __call__(self, target_leaves: list, cache: EngineCache, batch: StepBatch
                 ) -> tuple[Forwarded, EngineCache]:
        plan = self.plan
        if self.viewed:
            if self.views is None or self.views[0] is not target_leaves:
                self.views = (target_leaves, plan.with_views(target_leaves, expert_views))
            target_leaves = self.views[1]
        fwd, states = plan.chain(lambda name, *args: self.programs[name](*args), target_leaves, cache, batch)
        return fwd, cache.replace(layers=states)


def layer_program_names(plan: LayerPlan) -> list:
    """The programs of a plan in `LayeredHalves.executables` order: embed, the layer kinds, the replay programs,
    head."""
    return ["embed", *sorted(set(plan.kinds)), *plan.extra, "head"]


class LayeredHalves(CompiledHalves):
    """A bucket's step compiled as layer programs and the decide half (`executables`: embed, one program per
    kind of layer in kind order, the replay programs (`LayerPlan.extra`), head, decide)."""

    def __init__(self, executables: list, plan: LayerPlan, head_leaves: tuple[int, ...], viewed: bool):
        *programs, decide = executables
        names = layer_program_names(plan)
        if len(programs) != len(names):
            raise ValueError(f"{len(executables)} executables do not fit a plan of {len(names) + 1} programs")
        super().__init__([LayeredForward(plan, dict(zip(names, programs)), viewed), decide], head_leaves)
        self._executables = list(executables)

    @property
    def executables(self) -> list:
        return self._executables

    @property
    def layered(self) -> LayeredForward:
        """The forward half's programs."""
        return self._forward


class Lowering:
    """How `compile_layered` compiles a plan's programs: here, for the default device. A placement over a mesh
    lowers each inside a `shard_map` (`serving.core.engine_dp`)."""

    def abstract(self, tree):
        """The shapes the programs are compiled for, of a tree of arrays."""
        return abstract_shapes(tree)

    def compile(self, name, fn: Callable, donated: tuple[int, ...], args: tuple):
        """Program `name` (`LayerPlan.program`) compiled for the abstract `args`."""
        return jax.jit(fn, donate_argnums=donated).lower(*args).compile()

    def out_info(self, name, compiled):
        """What the chain hands on of program `name`'s outputs (their shapes)."""
        return compiled.out_info

    def decide(self, halves: StepHalves, weights: tuple, cache: EngineCache, batch: StepBatch, fwd_info,
               verify_len: int):
        """The decide half compiled for a head whose `Forwarded` has the shapes `fwd_info`."""
        return compile_decide(halves, weights, cache, batch, fwd_info, verify_len)


def compile_layered(halves: StepHalves, plan: LayerPlan, weights: tuple, cache: EngineCache, batch: StepBatch,
                    verify_len: int, lowering: Lowering | None = None, viewed: bool | None = None) -> list:
    """Ahead-of-time compile one bucket as layer programs plus the decide half (each layer program donating its
    state, the decide half its cache): the chain (`LayerPlan.chain`) walked on shapes, each program compiled
    where it is first called (by `lowering`: default, for the default device). Returns the executables in
    `LayeredHalves` order; `viewed`: whether the layers take expert views (default `LayerPlan.viewed`)."""
    lowering = lowering or Lowering()
    leaves = weights[0]
    viewed = plan.viewed(*batch.tokens.shape) if viewed is None else viewed
    programs = {}

    def compiling(name, *args):
        if name not in programs:
            fn, donated = plan.program(name, verify_len, halves.num_top)
            programs[name] = lowering.compile(name, fn, donated, args)
        return lowering.out_info(name, programs[name])

    fwd, _ = plan.chain(compiling, lowering.abstract(plan.with_views(leaves, _abstract_views) if viewed else leaves),
                        lowering.abstract(cache), lowering.abstract(batch))
    decide = lowering.decide(halves, weights, cache, batch, fwd, verify_len)
    return [programs[name] for name in layer_program_names(plan)] + [decide]


def _abstract_views(stack) -> tuple:
    """The shapes of `expert_views(stack)`."""
    return tuple(jax.ShapeDtypeStruct(stack.shape[1:], stack.dtype) for _ in range(stack.shape[0]))
