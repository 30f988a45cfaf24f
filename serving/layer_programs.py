"""A V4 engine step's forward half as one compiled program per kind of layer, so a bucket's compile time is set by
how many kinds of layer the model has, not by its depth.

The whole step (`serving.step`) unrolls every layer into one program: compiling a bucket costs time in
proportion to the layer count. Here the forward half is a chain of programs the host launches:

1. `embed`: the rows' inputs (`serving.step.row_inputs`) and the streams they enter the first layer with;
2. per layer, the program of its kind, given that layer's weights and cache state: it gathers the rows' slot
   state, runs the block, writes the state back (the state is donated, so it updates in place);
3. `head`: the logits at the verify positions and the drafter's features.

Layers with the same structure (graph, parameter and cache shapes) share one compiled program: V4-Flash's 43
layers are 5 kinds. Launches are asynchronous, so the host runs ahead of the device as with one program; each
layer costs a launch. The decide half is the whole step's. Each piece runs the code the whole step traces, so
tokens and logits equal it (tests/test_layer_programs.py).

On the CPU backend, a bucket of fewer (token, expert) pairs than experts (decode of a token or two) passes each
layer's float expert stacks as per-expert views (`pallas_kernels.expert_views`: aliases of the stack, made once),
so the chosen experts are multiplied where they lie instead of being copied out of the stack first.

Used by a single-device engine on a V4 model.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Int

from model.paged import pools
from model.replay import take_positions
from model.transformer import Block, input_streams, project_logits
from pallas_kernels import registry
from pallas_kernels.expert_views import ExpertViews, expert_views
from pallas_kernels.moe import VIEWED_BRANCHES, few_pairs
from pallas_kernels.transposed_weights import HELD_KEY
from serving.kv_cache import layer_rows, put_rows
from serving.step import (CompiledHalves, Forwarded, RowInputs, StepBatch, StepHalves, abstract_shapes, compile_decide,
                          forwarded, prompt_logprobs, row_inputs, split_cache)


def layer_key(block) -> tuple:
    """What makes two blocks interchangeable in one compiled program: the same graph and parameter shapes and
    dtypes."""
    graphdef, state = nnx.split(block)
    return graphdef, jax.tree.structure(state), tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))


class LayerBatch(NamedTuple):
    """What a layer program reads of the step's batch (an output of the embed program: on the device with it)."""

    slots: Int[Array, " r"]
    block_tables: Int[Array, "r p"]
    frozen: Int[Array, " r"]
    reset: Bool[Array, " r"]


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


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How a model's forward half splits: the embedding, each layer (and the kind it shares a program with), the
    head, and the layers whose output streams the drafter reads."""

    embed: Piece
    layers: tuple[Piece, ...]
    kinds: tuple[int, ...]  # per layer, the index of the first layer of its kind
    head: tuple[Piece, Piece, Piece]  # hc_head, norm, head
    hc_mult: int
    empty_layers: tuple  # one-row empty state per layer (a reset row starts from it)
    collect: tuple[int, ...]
    experts: tuple[int, ...]  # the leaves that are float routed-expert stacks [E, ...]
    n_experts: int
    top_k: int

    @classmethod
    def supports(cls, model) -> str | None:
        """Why `model` cannot run as layer programs (None: it can)."""
        module = model.module()
        if not all(isinstance(entry, Block) for entry in module.layers):
            return "its layers are not all plain V4 blocks (a V4.1 model)"
        if model.engram is not None:
            return "it has Engram memory"
        return None

    @classmethod
    def for_model(cls, model, empty_layers: list, collect: tuple[int, ...]) -> LayerPlan:
        module, paths = model.module(), _key_paths(model.params)
        keys = [(layer_key(block), jax.tree.structure(empty), tuple(leaf.shape for leaf in jax.tree.leaves(empty)))
                for block, empty in zip(module.layers, empty_layers)]
        float_experts = {i for i, block in enumerate(module.layers)
                         if block.ffn.experts.stacked()[0] == "routed_experts"}
        stacks = {("ffn", "experts", name, "value") + held for name in ("w1", "w2", "w3") for held in ((), (HELD_KEY,))}
        experts = tuple(i for i, path in enumerate(paths) if path[0] == "layers" and path[1] in float_experts
                        and path[2:] in stacks)  # held as they are or transposed (`model.host_layout`)
        return cls(_piece(module, paths, ("embed",)),
                   tuple(_piece(module, paths, ("layers", i)) for i in range(len(module.layers))),
                   tuple(keys.index(key) for key in keys),
                   tuple(_piece(module, paths, (name,)) for name in ("hc_head", "norm", "head")),
                   model.config.hc_mult, tuple(empty_layers), tuple(collect), experts,
                   model.config.n_routed_experts, model.config.num_experts_per_tok)

    def viewed(self, rows: int, width: int) -> bool:
        """Whether a bucket of `rows` x `width` tokens passes the float expert stacks as per-expert views: on the
        CPU backend with the reference kernels, when the step's pairs are few enough to run one by one and their
        switches over the experts stay within `VIEWED_BRANCHES`."""
        pairs = rows * width * self.top_k
        return (bool(self.experts) and jax.default_backend() == "cpu" and registry.implementation() == "reference"
                and few_pairs(pairs, self.n_experts) and pairs * self.n_experts <= VIEWED_BRANCHES)

    def with_views(self, leaves: list, views) -> list:
        """`leaves` with each float expert stack replaced by `views(stack)`, a tuple with one entry per expert."""
        out = list(leaves)
        for i in self.experts:
            out[i] = views(leaves[i])
        return out

    def embed_program(self, leaves: list, cache: dict, batch: StepBatch, verify_len: int):
        """(the rows' inputs, their first streams, what the layer programs read of the batch) of the step
        (`cache`: without its layer state); the layer batch comes out on the device with them, so the host
        places nothing more per step."""
        rows = row_inputs(cache, batch, verify_len)
        layer_batch = LayerBatch(batch.slots, batch.block_tables, batch.frozen, batch.reset)
        return rows, input_streams(self.embed.module(leaves), rows.tokens, self.hc_mult), layer_batch

    def layer_program(self, layer: int):
        """The program of layer `layer`'s kind: (weights, its cache state, streams, rows, layer batch) -> (streams,
        its new cache state)."""
        piece, empty = self.layers[layer], self.empty_layers[layer]

        def run(leaves: list, state: dict, streams, rows: RowInputs, batch: LayerBatch):
            block = piece.module([ExpertViews(leaf) if isinstance(leaf, tuple) else leaf for leaf in leaves])
            row_state = layer_rows({"layers": [state]}, batch.slots, batch.block_tables, batch.frozen, [empty],
                                   batch.reset)[0]
            streams, new = block(streams, rows.tokens, rows.starts, row_state, rows.counts)
            return streams, put_rows({"layers": [state]}, batch.slots, [pools(new)])["layers"][0]

        return run

    def head_program(self, leaves: list[list], streams, taps: list, rows: RowInputs, num_top: int) -> Forwarded:
        """The verify positions' logits, the drafter's features (the tapped streams, flattened, in order) and the
        scored rows' prompt logprobs with `num_top` alternatives; `leaves`: the head pieces' leaves
        (`head_leaves`)."""
        parts = [piece.module(piece_leaves) for piece, piece_leaves in zip(self.head, leaves)]
        picked = project_logits(*parts, take_positions(streams, rows.at))
        features = jnp.concatenate([t.reshape(*t.shape[:2], -1) for t in taps], axis=-1) if taps else None
        return forwarded(picked, features, rows, prompt_logprobs(lambda: project_logits(*parts, streams), rows,
                                                                 num_top))

    def head_leaves(self, leaves: list) -> list[list]:
        """The leaves of `hc_head`, `norm` and `head`, one list each."""
        return [piece.take(leaves) for piece in self.head]


class LayeredForward:
    """The forward half as launched programs: `(target leaves, cache, batch) -> (Forwarded, cache)`; `viewed`: the
    layer programs take per-expert views of the float expert stacks (`LayerPlan.viewed`)."""

    def __init__(self, plan: LayerPlan, embed, kinds: dict[int, object], head, viewed: bool):
        self.plan, self.embed, self.head, self.viewed = plan, embed, head, viewed
        self.layers = [kinds[kind] for kind in plan.kinds]
        self.views: tuple[list, list] | None = None  # (target leaves, the same with expert views), made once

    def __call__(self, target_leaves: list, cache: dict, batch: StepBatch) -> tuple[Forwarded, dict]:
        plan = self.plan
        if self.viewed:
            if self.views is None or self.views[0] is not target_leaves:
                self.views = (target_leaves, plan.with_views(target_leaves, expert_views))
            target_leaves = self.views[1]
        rest, _ = split_cache(cache)
        rows, streams, layer_batch = self.embed(plan.embed.take(target_leaves), rest, batch)
        states, taps = list(cache["layers"]), {}
        for i, (program, piece) in enumerate(zip(self.layers, plan.layers)):
            streams, states[i] = program(piece.take(target_leaves), states[i], streams, rows, layer_batch)
            if i in plan.collect:
                taps[i] = streams
        fwd = self.head(plan.head_leaves(target_leaves), streams, [taps[i] for i in plan.collect], rows)
        return fwd, {**cache, "layers": states}


class LayeredHalves(CompiledHalves):
    """A bucket's step compiled as layer programs and the decide half (`executables`: embed, one program per
    kind of layer in kind order, head, decide)."""

    def __init__(self, executables: list, plan: LayerPlan, head_leaves: tuple[int, ...], viewed: bool):
        kinds = sorted(set(plan.kinds))
        embed, *programs, head, decide = executables
        if len(programs) != len(kinds):
            raise ValueError(f"{len(executables)} executables do not fit a plan of {len(kinds)} layer kinds")
        super().__init__([LayeredForward(plan, embed, dict(zip(kinds, programs)), head, viewed), decide],
                         head_leaves)
        self._executables = list(executables)

    @property
    def executables(self) -> list:
        return self._executables

    @property
    def layered(self) -> LayeredForward:
        """The forward half's programs."""
        return self._forward


def compile_layered(halves: StepHalves, plan: LayerPlan, weights: tuple, cache: dict, batch: StepBatch,
                    verify_len: int) -> LayeredHalves:
    """Ahead-of-time compile one bucket as layer programs plus the decide half (each layer program donating its
    state, the decide half its cache)."""
    leaves = weights[0]
    viewed = plan.viewed(*batch.tokens.shape)
    layer_leaves = plan.with_views(leaves, _abstract_views) if viewed else leaves
    rest = split_cache(cache)[0]
    embed = jax.jit(plan.embed_program, static_argnums=3).lower(
        abstract_shapes(plan.embed.take(leaves)), abstract_shapes(rest), abstract_shapes(batch), verify_len).compile()
    rows, streams, layer_batch = embed.out_info
    programs = []
    for kind in sorted(set(plan.kinds)):
        programs.append(jax.jit(plan.layer_program(kind), donate_argnums=1).lower(
            abstract_shapes(plan.layers[kind].take(layer_leaves)), abstract_shapes(cache["layers"][kind]), streams, rows,
            layer_batch).compile())
    head = jax.jit(plan.head_program, static_argnums=4).lower(
        abstract_shapes(plan.head_leaves(leaves)), streams, [streams] * len(plan.collect), rows,
        halves.num_top).compile()
    decide = compile_decide(halves, weights, cache, batch, head.out_info, verify_len)
    return LayeredHalves([embed, *programs, head, decide], plan, halves.head_leaves, viewed)


def _abstract_views(stack) -> tuple:
    """The shapes of `expert_views(stack)`."""
    return tuple(jax.ShapeDtypeStruct(stack.shape[1:], stack.dtype) for _ in range(stack.shape[0]))
