"""KV compressors (CSA: overlapping windows; HCA: disjoint windows) and the CSA lightning indexer.

A compressor pools every `ratio` consecutive tokens into one entry with a per-channel softmax gate. CSA
(ratio 4) pools 2*ratio slots: the `a` half of window w-1 and the `b` half of window w. State carried between
calls: the projected slots of the most recent tokens in a ring indexed by position (`recent_*`: the windows
still open or still needed as an `a` half, plus `backtrack` slots), and the emitted entries (written by the
caller, `model.paged.store_windows`, which keeps only the windows a chunk completes). Because slots are
addressed by position, a caller may roll back up to `backtrack` tokens (rejected speculative drafts) by simply
restarting at an earlier position. The same update serves a whole sequence (empty state) and chunked decoding.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from model.axes import param
from model.config import CSA_RATIO, ModelConfig
from model.linear import Linear
from model.norms import RMSNorm
from model.paged import Paged, row_pages
from model.rope import apply_rope
from model import registry


class Compressor(nnx.Module):
    """Gated pooling of `ratio` tokens into one `dim`-wide entry, roped at the window's first position."""

    def __init__(self, config: ModelConfig, ratio: int, dim: int, overlap: bool, dtype, rngs: nnx.Rngs):
        width = 2 * dim if overlap else dim
        self.wkv = Linear(config.hidden_size, width, dtype, rngs, compute_dtype=jnp.float32)
        self.wgate = Linear(config.hidden_size, width, dtype, rngs, compute_dtype=jnp.float32)
        self.ape = param(jnp.zeros((ratio, width), jnp.float32), "window", "out")
        self.norm = RMSNorm(dim, config.rms_norm_eps)
        self.ratio, self.dim, self.overlap = ratio, dim, overlap

    def init_state(self, batch: int, max_len: int, backtrack: int = 0) -> dict:
        """Empty state for sequences of at most `max_len` tokens that may roll back `backtrack` tokens."""
        r, d = self.ratio, self.dim
        width = 2 * d if self.overlap else d
        return {"entries": row_pages(jnp.zeros((batch, max_len // r, d), jnp.float32)),
                **recent_slots(batch, (2 if self.overlap else 1) * r + backtrack, width)}

    def __call__(
        self, x: Float[Array, "b c d"], start: Int[Array, "*start"], state: dict, freqs, count=None
    ) -> tuple[Float[Array, "b n e"], dict[str, jax.Array]]:
        """Feed the first `count` (default all) tokens at positions start..: (the entries of windows
        start // ratio + i, complete or not, the new ring of recent slots)."""
        r = self.ratio
        count = x.shape[1] if count is None else count
        positions = start + jnp.arange(x.shape[1])
        kv, gate = self.wkv(x), self.wgate(x) + self.ape[...][positions % r]
        pooled, recent = gated_pool(state, kv, gate, start, count, r, self.overlap)
        window_ids = start // r + jnp.arange(pooled.shape[1])
        return apply_rope(self.norm(pooled)[:, :, None], window_ids * r, freqs)[:, :, 0], recent


def recent_slots(batch: int, size: int, width: int) -> dict[str, jax.Array]:
    """An empty ring of `size` projected token slots (kv and gate) addressed by position mod size."""
    return {"recent_kv": jnp.zeros((batch, size, width), jnp.float32),
            "recent_gate": jnp.zeros((batch, size, width), jnp.float32)}


def gated_pool(
    state: dict, kv: Float[Array, "b c w"], gate: Float[Array, "b c w"], start, count, ratio: int,
    overlap: bool = False,
) -> tuple[Float[Array, "b n d"], dict[str, jax.Array]]:
    """(per-channel softmax-gated pooling of every window the chunk touches, complete or not; the ring of recent
    slots after the chunk's first `count` tokens). With `overlap` (CSA) window w pools the `a` half (first
    width / 2 channels) of window w-1's slots and its own `b` half."""
    back = 1 if overlap else 0  # CSA also stages the window before the first (its `a` half)
    kv_w = stage_windows(state["recent_kv"], kv, start, ratio, back)
    gate_w = stage_windows(state["recent_gate"], gate, start, ratio, back, -jnp.inf)
    if overlap:
        d = kv.shape[-1] // 2
        kv_w = jnp.concatenate([kv_w[:, :-1, :, :d], kv_w[:, 1:, :, d:]], axis=2)
        gate_w = jnp.concatenate([gate_w[:, :-1, :, :d], gate_w[:, 1:, :, d:]], axis=2)
    positions = start + jnp.arange(kv.shape[1])
    return jnp.sum(jax.nn.softmax(gate_w, axis=2) * kv_w, axis=2), {
        "recent_kv": push_recent(state["recent_kv"], kv, positions, count),
        "recent_gate": push_recent(state["recent_gate"], gate, positions, count)}


def stage_windows(
    recent: Float[Array, "b s w"], new: Float[Array, "b c w"], start, ratio: int, back: int = 0, empty: float = 0.0
):
    """[b, c//ratio + 2 + back, ratio, w]: the slots of windows start//ratio - back onwards, by window: positions
    before `start` from the ring of recent slots, the rest from the new tokens; slots before position 0 hold
    `empty` (-inf for gates: such a slot weighs nothing in the pooling softmax)."""
    c, size = new.shape[1], recent.shape[1]
    n_win = c // ratio + 2 + back  # windows a chunk can touch, plus the one left open after it
    pos = (start // ratio - back) * ratio + jnp.arange(n_win * ratio)
    staged = jnp.where((pos >= start)[None, :, None], jnp.take(new, jnp.clip(pos - start, 0, c - 1), axis=1),
                       jnp.take(recent.astype(new.dtype), pos % size, axis=1))
    staged = jnp.where((pos < 0)[None, :, None], jnp.asarray(empty, new.dtype), staged)
    return staged.reshape(new.shape[0], n_win, ratio, -1)


def push_recent(recent: Float[Array, "b s w"], new: Float[Array, "b c w"], positions: Int[Array, " c"], count):
    """The ring after the chunk's first `count` tokens: the last min(count, size) overwrite their slots."""
    size = recent.shape[1]
    i = jnp.arange(new.shape[1])
    slots = jnp.where((i < count) & (i >= count - size), positions % size, size)  # out of range: dropped
    return recent.at[:, slots].set(new.astype(recent.dtype), mode="drop")


class Indexer(nnx.Module):
    """Lightning indexer: picks, per query, the top-k visible compressed entries by a weighted ReLU score."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        n, d = config.index_n_heads, config.index_head_dim
        self.wq_b = Linear(config.q_lora_rank, n * d, dtype, rngs, compute_dtype=jnp.float32)
        self.weights_proj = Linear(config.hidden_size, n, dtype, rngs, compute_dtype=jnp.float32)
        self.compressor = Compressor(config, CSA_RATIO, d, True, dtype, rngs)
        self.n_heads, self.head_dim, self.topk = n, d, config.index_topk

    def select(
        self, x: Float[Array, "b c d"], q_lat: Float[Array, "b c r"], positions: Int[Array, " c"],
        keys: Paged, freqs,
    ) -> Int[Array, "b c topk"]:
        """Row-local indices of the selected entries of the rows' index `keys`; -1 where fewer than k are
        visible."""
        b, c, _ = x.shape
        q = apply_rope(self.wq_b(q_lat).reshape(b, c, self.n_heads, self.head_dim), positions, freqs)
        visible = (positions + 1) // self.compressor.ratio
        scores = registry.op("paged_index_scores")(q, keys.pages, keys.table, self.weights_proj(x), visible)
        return top_visible(scores, self.topk)


def top_visible(scores: Float[Array, "b c t"], k: int) -> Int[Array, "b c k"]:
    """Top-k entry indices of scores where invisible entries hold -inf; -1 for picks that are not visible.

    Ties break towards the lower entry index (`lax.top_k` is stable), so selection is deterministic.
    """
    values, ids = jax.lax.top_k(scores, min(k, scores.shape[-1]))
    return jnp.where(values > -jnp.inf, ids, -1)
