"""Repeated layers stored stacked and run as one `lax.scan`, so a step's compile time stops growing with depth.

V4's layers repeat: after the sliding-window and hash-routed layers come (CSA, HCA) pairs to the last layer.
`stack_layers(model)` stores each run of repeats as one `LayerStack`: `period` blocks whose parameters carry a
leading `layers` axis of `repeats`, run as a `lax.scan` over the repeats (one compiled body, any depth).

A stack's cache states keep their first axis (the page pool's pages, or a per-row leaf's rows) and take the
repeats as their second: pools [P, L, E, d], per-row leaves [b, L, ...]. So every cache operation that moves
pages or rows (the engine's slots, the prefix cache, disaggregated hand-off) is the same for a stacked model.
Inside the scan a layer reads its pool in place: [P, L, E, d] is viewed as P·L pages, and the layer's block table
is the rows' tables times L plus its repeat.

Glossary: p blocks in the period, L repeats, P pages (or rows of a dense reference cache), E entries a page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from model.paged import is_paged


def layer_runs(keys: list) -> list[tuple[int, int, int]]:
    """Consecutive runs of repeated layers: (first layer, period, repeats) covering every layer in order, from
    each layer's structure key (equal keys: interchangeable layers). A run repeats its period at least twice;
    a layer in no run is its own run of period 1 and 1 repeat. Each run takes the period (up to 4) that covers
    the most layers from where it starts."""
    runs, first = [], 0
    while first < len(keys):
        best = (1, 1)
        for period in range(1, 5):
            repeats = 1
            while (first + (repeats + 1) * period <= len(keys)
                   and keys[first + repeats * period:first + (repeats + 1) * period] == keys[first:first + period]):
                repeats += 1
            if repeats > 1 and period * repeats > best[0] * best[1]:
                best = (period, repeats)
        runs.append((first, *best))
        first += best[0] * best[1]
    return runs


def layer_key(block) -> tuple:
    """What makes two blocks interchangeable (in a scan, or one compiled program): the same graph and parameter
    shapes and dtypes."""
    graphdef, state = nnx.split(block)
    return graphdef, jax.tree.structure(state), tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))


class LayerStack(nnx.Module):
    """`repeats` repeats of a period of blocks, each parameter stacked on a leading `layers` axis; called like
    one block over the whole run (`states`: one stacked state per block of the period)."""

    def __init__(self, blocks: list, repeats: int):
        self.blocks = nnx.List(blocks)
        self.repeats = repeats

    @property
    def depth(self) -> int:
        """Layers the stack stands for."""
        return len(self.blocks) * self.repeats

    def init_state(self, batch: int, max_len: int, ring: int | None = None) -> list[dict]:
        """Each period block's empty state, the repeats on axis 1."""
        return [jax.tree.map(lambda leaf: jnp.repeat(leaf[:, None], self.repeats, axis=1),
                             blk.attn.init_state(batch, max_len, ring)) for blk in self.blocks]

    def __call__(self, streams: Float[Array, "b c n d"], tokens: Int[Array, "b c"], start: Int[Array, "*start"],
                 states: list, count=None, taps: tuple[int, ...] = ()):
        """(streams after the stack's last layer, new stacked states, the streams after each layer of `taps`
        (stack-local layer numbers) in that order)."""
        graphdef, params = nnx.split(self.blocks)
        repeats = self.repeats
        flat = [jax.tree.map(lambda node: node._replace(pages=_fold(node.pages)) if is_paged(node) else node,
                             state, is_leaf=is_paged) for state in states]

        def body(carry, xs):
            streams, states = carry
            layer, layer_params = xs
            new_states, outs = [], []
            for blk, state in zip(nnx.merge(graphdef, layer_params), states):
                streams, new = blk(streams, tokens, start, _layer_view(state, layer, repeats), count)
                new_states.append(_layer_update(state, new, layer))
                outs.append(streams)
            return (streams, new_states), (jnp.stack(outs) if taps else None)

        (streams, flat), out = jax.lax.scan(body, (streams, flat), (jnp.arange(repeats), params))
        states = [jax.tree.map(lambda node: node._replace(pages=_unfold(node.pages, repeats)) if is_paged(node)
                               else node, state, is_leaf=is_paged) for state in flat]
        period = len(self.blocks)
        return streams, states, [out[i // period, i % period] for i in taps]


def _fold(pages: Float[Array, "P L E d"]) -> Float[Array, "PL E d"]:
    """A stacked pool as P·L pages (page q, repeat l at page q·L + l)."""
    return pages.reshape(-1, *pages.shape[2:])


def _unfold(pages: Float[Array, "PL E d"], repeats: int) -> Float[Array, "P L E d"]:
    return pages.reshape(-1, repeats, *pages.shape[1:])


def _layer_view(state: dict, layer: Int[Array, ""], repeats: int) -> dict:
    """One repeat's state: its rows of the per-row leaves, and its pages of each folded pool."""
    return jax.tree.map(
        lambda node: node._replace(table=node.table * repeats + layer) if is_paged(node)
        else jax.lax.dynamic_index_in_dim(node, layer, axis=1, keepdims=False), state, is_leaf=is_paged)


def _layer_update(state: dict, new: dict, layer: Int[Array, ""]) -> dict:
    """The stacked `state` with one repeat's `new` state written back (its pool writes went in place)."""
    return jax.tree.map(
        lambda node, out: node._replace(pages=out.pages) if is_paged(node)
        else jax.lax.dynamic_update_index_in_dim(node, out.astype(node.dtype), layer, axis=1),
        state, new, is_leaf=is_paged)


def stack_blocks(blocks: list) -> list:
    """`blocks` (one per layer) with every run of repeats (`layer_runs`) replaced by one `LayerStack`."""
    out = []
    for first, period, repeats in layer_runs([layer_key(blk) for blk in blocks]):
        if repeats == 1:
            out.append(blocks[first])
            continue
        period_blocks = []
        for j in range(period):
            graphdefs, states = zip(*[nnx.split(blocks[first + r * period + j]) for r in range(repeats)])
            stacked = jax.tree.map(
                lambda *variables: variables[0].replace(
                    jnp.stack([v.get_value() for v in variables]),
                    out_sharding=("layers", *variables[0].get_metadata()["out_sharding"])),
                *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
            period_blocks.append(nnx.merge(graphdefs[0], stacked))
        out.append(LayerStack(period_blocks, repeats))
    return out


def unstack_blocks(segments: list) -> list:
    """The inverse of `stack_blocks`: one block per layer."""
    out = []
    for segment in segments:
        if not isinstance(segment, LayerStack):
            out.append(segment)
            continue
        split = [nnx.split(blk) for blk in segment.blocks]
        for r in range(segment.repeats):
            out += [nnx.merge(graphdef, _repeat(state, r)) for graphdef, state in split]
    return out


def _repeat(state, r: int):
    """Repeat `r` of a stacked parameter state: each Variable's slice r, without the `layers` axis name."""
    return jax.tree.map(lambda v: v.replace(v.get_value()[r], out_sharding=v.get_metadata()["out_sharding"][1:]),
                        state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def layer_spans(segments) -> list[tuple[int, int]]:
    """(first layer, layers) of each entry of a (possibly stacked) layer list."""
    spans, first = [], 0
    for segment in segments:
        depth = segment.depth if isinstance(segment, LayerStack) else 1
        spans.append((first, depth))
        first += depth
    return spans


def stack_layers(model):
    """The same `model.api.Model` with every run of repeated main layers stored as one `LayerStack` (MTP blocks
    stay as they are). V4 models; a V4.1 model's encoder / decoder groups share KV across layers and are not
    stacked (refused)."""
    return _restacked(model, stack_blocks)


def unstack_layers(model):
    """The inverse of `stack_layers`: one block per main layer (a model that is not stacked is returned as is)."""
    return _restacked(model, unstack_blocks)


def is_stacked(model) -> bool:
    """Whether a model stores any run of layers stacked."""
    return any(isinstance(entry, LayerStack) for entry in model.module().layers)


def _restacked(model, transform):
    if hasattr(model.config, "n_prefill_layer"):  # a V4.1 config
        raise ValueError("stacked layers are supported for V4 models; V4.1's layers share KV across groups")
    module = model.module()
    module.layers = nnx.List(transform(list(module.layers)))
    return type(model)(module, tokenizer=model.tokenizer, engram=model.engram, drafter=model.drafter)
