"""Bounded decoder replay in prefill for causal encoder-decoder (CED) models (DeepSeek-V4.1, "YOCO").

The layers after the last KV source keep nothing but a window ring, so a prefill may run them on each request's
last `keep` prompt tokens only. Modes `off`, `mask` (the reference) and `compact`; `exact_keep` gives the keep at
which replay is exact, and `for_engine` picks and validates the engine's setting.
See docs/prefix-cache-and-replay.md.
"""

from __future__ import annotations

import dataclasses
from typing import no_type_check

import jax.numpy as jnp
from jaxtyping import Array, Int

MODES = ("off", "mask", "compact")
DEFAULT_KEEP = 140  # DeepInfer's default: window 128 + max backtracking 6, plus a margin


@no_type_check  # a user's setting: `__post_init__` checks it with a message naming the field
@dataclasses.dataclass(frozen=True)
class Replay:
    """How a prefill runs the replay layers: `mode` (off / mask / compact) and `keep` (tokens per request)."""

    mode: str = "off"
    keep: int = DEFAULT_KEEP

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"replay mode {self.mode!r} is not one of {MODES}")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep <= 0:
            raise ValueError(f"replay keep must be a positive integer, got {self.keep!r}")

    @property
    def active(self) -> bool:
        """Whether the replay layers are bounded (mode mask or compact)."""
        return self.mode != "off"

    def check(self, ring: int, window: int) -> None:
        """Raise ValueError unless `keep` covers a replay layer's ring (window + backtracking slots)."""
        if self.keep < ring:
            raise ValueError(f"replay keep={self.keep} must be >= window + backtracking = {window} + "
                             f"{ring - window} = {ring} (the replay layers' ring slots), or decode would read "
                             "ring slots prefill never wrote")


ENGINE_DEFAULT = Replay("compact")  # `serving.core.engine.Engine`'s default (`for_engine` adapts its keep)


def for_engine(config, replay: Replay | None, ring: int, drafter_ring: int = 0, tapped: tuple[int, ...] = ()
               ) -> Replay | None:
    """The bounded replay an engine's prefill runs (None: off). `replay` is what the caller asked for: a Replay,
    None (off), or `ENGINE_DEFAULT` (compact on a CED model with keep = max(DEFAULT_KEEP, what the rings need),
    off on any other model). `ring` is the engine's window ring (window + backtracking), `drafter_ring` the
    DSpark drafter's context ring and `tapped` the target layers it reads: when one of them is a replay layer,
    keep must also cover the drafter's ring, since features of tokens below the floor never pass the replay
    layers. Raises ValueError for an active replay on a model without replay layers or a keep too small."""
    split = getattr(config, "n_prefill_layer", config.num_hidden_layers)  # the first replay layer, if any
    ced = split < config.num_hidden_layers
    needs_drafter = any(i >= split for i in tapped)
    need = max(ring, drafter_ring if needs_drafter else 0)
    if replay is ENGINE_DEFAULT:
        return Replay("compact", max(DEFAULT_KEEP, need)) if ced else None
    if replay is None:
        return None
    if not isinstance(replay, Replay):
        raise ValueError(f"replay must be a model.replay.Replay or None, got {replay!r}")
    if not replay.active:
        return None
    if not ced:
        raise ValueError("bounded replay needs a causal encoder-decoder (V4.1) model with layers after its last "
                         "KV source; pass replay=None (--replay off) for this one")
    replay.check(ring, config.sliding_window)
    if replay.keep < need:
        raise ValueError(f"replay keep={replay.keep} must cover the DSpark drafter's context ring ({need} "
                         f"positions): it reads layers {list(tapped)}, whose features below the floor never pass "
                         "the replay layers")
    return replay


def exact_keep(config, ring: int) -> int:
    """The smallest keep for which replay leaves every replay layer's ring, and the last token, exact."""
    depth = config.num_hidden_layers - config.n_prefill_layer
    return ring + max(depth - 1, 0) * (config.sliding_window - 1)


def kept_span(start, count, prompt_end, keep: int, batch: int):
    """(offset of the first kept token in the chunk, kept tokens, floor F [batch]): the first two are scalars
    when `start` and `count` are and `prompt_end` is None, else per row."""
    if prompt_end is not None:
        start, count = jnp.broadcast_to(start, (batch,)), jnp.broadcast_to(count, (batch,))
    floor = (start + count if prompt_end is None else jnp.broadcast_to(prompt_end, (batch,))) - keep
    offset = jnp.clip(floor - start, 0, count).astype(jnp.int32)
    return offset, (count - offset).astype(jnp.int32), jnp.broadcast_to(floor, (batch,)).astype(jnp.int32)


def key_positions(ring_pos: Int[Array, "b w"], positions: Int[Array, " c"], window: int) -> Int[Array, "b c k"]:
    """The position of every key `model.attention.window_ids` lists: W ring slots, then W in-chunk tokens."""
    (b, w), c = ring_pos.shape, positions.shape[0]
    in_chunk = positions[:, None] - jnp.arange(window)[None, :]
    return jnp.concatenate([jnp.broadcast_to(ring_pos[:, None, :], (b, c, w)),
                            jnp.broadcast_to(in_chunk, (b, c, window))], axis=2)


def take_positions(x: Array, idx: Int[Array, "b v"] | None) -> Array:
    """x[b, idx[b, i]] along the chunk axis ([b, v, ...]); x itself when `idx` is None."""
    if idx is None:
        return x
    return jnp.take_along_axis(x, idx.reshape(*idx.shape, *(1,) * (x.ndim - 2)), axis=1)


def take_rows(x: Array, offset: Int[Array, " b"], width: int) -> Array:
    """x[b, offset_b + i] for i < width ([b, width, ...]); rows past the chunk repeat its last row (padding)."""
    return take_positions(x, jnp.minimum(offset[:, None] + jnp.arange(width), x.shape[1] - 1))


def put_rows(x: Array, rows: Array, offset: Int[Array, " b"], length: Int[Array, " b"]) -> Array:
    """x with x[b, offset_b + i] = rows[b, i] for i < length_b (the inverse of `take_rows` on kept rows)."""
    i = jnp.arange(rows.shape[1])
    idx = jnp.where(i[None, :] < length[:, None], offset[:, None] + i, x.shape[1])  # past the end: dropped
    return x.at[jnp.arange(x.shape[0])[:, None], idx].set(rows.astype(x.dtype), mode="drop")
