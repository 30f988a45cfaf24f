"""A request's engine state on the host, for handing a request from one engine to another (`serving.api.disagg`).

`SlotState` is everything the engine keeps for one request: its compressed-KV pages and indexer keys (the paged
leaves, in block-table order), its slot leaves (the sliding-window ring, the compressors' open windows, ...),
every other per-slot cache entry (last sampled token, penalty statistics, ...), the host-side Engram n-gram
history, and the request itself (prompt, output, seeded sampling parameters, output constraint).
`Engine.export_slot` / `Engine.import_slot` make and install one; `take` / `put` here move the cache part.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jaxtyping import Int

from serving.structured.constraints import ConstraintSpec
from model.paged import Paged, is_paged, map_state, slot_leaves
from serving.base.kv_cache import EngineCache
from serving.base.request import TokenLogprob
from serving.base.sampling import SamplingParams



@dataclasses.dataclass
class SlotState:
    """One request's engine state, on the host (numpy), ready to cross a process boundary."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int]
    logprobs: list[TokenLogprob]
    computed: int
    page_tokens: int
    layers: list[dict]  # one dict per layer: page pools (`Paged`, [pages, entries per page, d]), slot leaves
    slot: dict  # every other per-slot cache entry at this slot: last token, penalty statistics, ...
    engram_history: np.ndarray | None
    drafts: list[int]  # speculative decoding: the drafted block the host last read, and its confidences
    confidence: list[float]
    elapsed: float  # seconds since the request arrived at the prefill engine
    constraint: ConstraintSpec | None = None  # the output constraint, and the token it starts after
    constraint_trigger: int | None = None
    prompt_logprobs: list | None = None  # `Request.prompt_logprobs` (asked for: one entry per prompt token)

    @property
    def partial(self) -> bool:
        """Whether the prompt is only partly computed: the prefix state of an asymmetric P/D split, holding the
        layers of the prefill part alone (`model.config_v41.V41Config.prefill_part`) and no other slot entry."""
        return self.computed < len(self.prompt)

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves((self.layers, self.slot)))


def take(cache: EngineCache, slot: int, pages: Int[np.ndarray, " p"]) -> tuple[list[dict], dict]:
    """(the layers' state, every other per-slot entry) of `slot` holding `pages`, on the host."""
    layers = map_state(lambda node: jax.tree.map(lambda pool: np.asarray(pool[pages]), node),
                       lambda leaf: np.asarray(leaf[slot]), cache.layers)
    return layers, jax.tree.map(lambda leaf: np.asarray(leaf[slot]), cache.per_slot())


def check(cache: EngineCache, state: SlotState, page_tokens: int) -> None:
    """Raise ValueError if `state` came from an engine laid out unlike the one holding `cache`."""
    if state.page_tokens != page_tokens:
        raise ValueError(f"the prefill engine's pages hold {state.page_tokens} tokens, this engine's "
                         f"{page_tokens}: run both with the same page size")
    if set(state.slot) != set(cache.per_slot()):
        raise ValueError(f"the hand-off's per-slot state ({', '.join(sorted(state.slot))}) is not this engine's "
                         f"({', '.join(sorted(cache.per_slot()))}): run both engines alike")


def check_prefix(cache: EngineCache, state: SlotState, page_tokens: int) -> None:
    """Raise ValueError unless `state`, a partial hand-off, holds this engine's first layers as it lays them
    out."""
    if state.page_tokens != page_tokens:
        raise ValueError(f"the prefill engine's pages hold {state.page_tokens} tokens, this engine's "
                         f"{page_tokens}: run both with the same page size")
    n = len(state.layers)
    if (n > len(cache.layers) or jax.tree.structure(cache.layers[:n]) != jax.tree.structure(state.layers)
            or _shapes(cache.layers[:n], 1) != _shapes(state.layers, 0)):
        raise ValueError(f"the hand-off's {n} layers are not laid out as this engine's first {n}: run the prefill "
                         "part of this engine's model")


def _shapes(layers: list, slot_axes: int) -> list[tuple[int, ...]]:
    """Each leaf's shape past its page axis (page pools) or its first `slot_axes` axes (the other leaves)."""
    return [tuple(node.pages.shape[1:]) if is_paged(node) else tuple(np.shape(node)[slot_axes:])
            for node in jax.tree.leaves(layers, is_leaf=is_paged)]


def _install(state: SlotState, pages: Int[np.ndarray, " p"]):
    def install(node: Paged, held: Paged) -> Paged:
        if held.pages.shape[0] != len(pages):
            raise ValueError(f"the hand-off holds {held.pages.shape[0]} pages for {state.computed} tokens, "
                             f"this engine needs {len(pages)}")
        return jax.tree.map(lambda pool: pool.at[pages].set(held.pages), node)

    return install


def put(cache: EngineCache, state: SlotState, slot: int, pages: Int[np.ndarray, " p"]) -> EngineCache:
    """`cache` with `state`'s cache part installed at `slot` and `pages` (as many as the state holds)."""
    layers = map_state(_install(state, pages), lambda leaf, value: leaf.at[slot].set(value), cache.layers,
                       state.layers)
    return cache.replace(layers=layers, **{k: jax.tree.map(lambda leaf, value: leaf.at[slot].set(value),
                                                            getattr(cache, k), v) for k, v in state.slot.items()})


def put_pages(cache: EngineCache, state: SlotState, pages: Int[np.ndarray, " p"]) -> EngineCache:
    """`cache` with the paged leaves of `state`'s layers (its first ones) installed at `pages`."""
    n = len(state.layers)
    head = map_state(_install(state, pages), lambda leaf, value: leaf, cache.layers[:n], state.layers)
    return cache.replace(layers=head + cache.layers[n:])


def window_state(state: SlotState, empty_layers: list, empty_drafter) -> list[np.ndarray]:
    """The window-state snapshot (`EngineCache.window_state` order, one slot) a partial hand-off's first chunk
    starts from: its layers' per-slot leaves, then the empty state (`empty_layers`, `empty_drafter`: one
    sequence's) of the layers it lacks and of the DSpark drafter's rings."""
    empty = slot_leaves(empty_layers[len(state.layers):]) + jax.tree.leaves(empty_drafter)
    return [np.asarray(x) for x in slot_leaves(state.layers)] + [np.asarray(x[0]) for x in empty]
