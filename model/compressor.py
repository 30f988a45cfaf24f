"""KV compressors (CSA: overlapping windows; HCA: disjoint windows) and the CSA lightning indexer.

A compressor pools every `ratio` consecutive tokens into one entry with a per-channel softmax gate. CSA
(ratio 4) pools 2*ratio slots: the `a` half of window w-1 and the `b` half of window w. State carried between
calls: the open window's projected slots (`buf_*`), for CSA the last complete window's `a` half (`prev_*`),
and the emitted entries. The same update serves a whole sequence (empty state) and chunked decoding.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from model.config import CSA_RATIO, ModelConfig
from model.linear import Linear
from model.norms import RMSNorm
from model.rope import apply_rope
from pallas_kernels import registry


class Compressor(nnx.Module):
    """Gated pooling of `ratio` tokens into one `dim`-wide entry, roped at the window's first position."""

    def __init__(self, config: ModelConfig, ratio: int, dim: int, overlap: bool, dtype, rngs: nnx.Rngs):
        width = 2 * dim if overlap else dim
        self.wkv = Linear(config.hidden_size, width, dtype, rngs, compute_dtype=jnp.float32)
        self.wgate = Linear(config.hidden_size, width, dtype, rngs, compute_dtype=jnp.float32)
        self.ape = nnx.Param(jnp.zeros((ratio, width), jnp.float32))
        self.norm = RMSNorm(dim, config.rms_norm_eps)
        self.ratio, self.dim, self.overlap = ratio, dim, overlap

    def init_state(self, batch: int, max_len: int) -> dict[str, jax.Array]:
        """Empty state for sequences of at most `max_len` tokens."""
        r, d = self.ratio, self.dim
        width = 2 * d if self.overlap else d
        state = {"entries": jnp.zeros((batch, max_len // r, d), jnp.float32),
                 "buf_kv": jnp.zeros((batch, r, width), jnp.float32),
                 "buf_gate": jnp.zeros((batch, r, width), jnp.float32)}
        if self.overlap:
            state["prev_kv"] = jnp.zeros((batch, r, d), jnp.float32)
            state["prev_gate"] = jnp.full((batch, r, d), -jnp.inf, jnp.float32)
        return state

    def __call__(
        self, x: Float[Array, "b c d"], start: Int[Array, ""], state: dict, freqs, count=None
    ) -> dict[str, jax.Array]:
        """Feed the first `count` (default all) tokens at positions start..; every window they complete is
        written to `entries`."""
        r, d = self.ratio, self.dim
        count = x.shape[1] if count is None else count
        positions = start + jnp.arange(x.shape[1])
        kv_w = stage_windows(state["buf_kv"], self.wkv(x), start, r)
        gate_w = stage_windows(state["buf_gate"], self.wgate(x) + self.ape[...][positions % r], start, r)
        new_state = {"buf_kv": open_slot(kv_w, start, count, r),
                     "buf_gate": open_slot(gate_w, start, count, r)}
        if self.overlap:
            # a-halves of windows w0-1 .. w0+n_win-1; slot i+1 belongs to staged window i
            a_kv = jnp.concatenate([state["prev_kv"][:, None], kv_w[..., :d]], axis=1)
            a_gate = jnp.concatenate([state["prev_gate"][:, None], gate_w[..., :d]], axis=1)
            n_win = kv_w.shape[1]
            kv_w = jnp.concatenate([a_kv[:, :n_win], kv_w[..., d:]], axis=2)
            gate_w = jnp.concatenate([a_gate[:, :n_win], gate_w[..., d:]], axis=2)
            new_state["prev_kv"] = open_slot(a_kv, start, count, r)
            new_state["prev_gate"] = open_slot(a_gate, start, count, r)
        pooled = jnp.sum(jax.nn.softmax(gate_w, axis=2) * kv_w, axis=2)  # [b, n_win, d]
        window_ids = start // r + jnp.arange(pooled.shape[1])
        pooled = apply_rope(self.norm(pooled)[:, :, None], window_ids * r, freqs)[:, :, 0]
        new_state["entries"] = store_complete(state["entries"], pooled, start, count, r)
        return new_state


def stage_windows(buffer: Float[Array, "b r w"], new: Float[Array, "b c w"], start, ratio: int):
    """[b, c//ratio + 2, ratio, w]: the open window's buffered slots followed by the new tokens, by window."""
    b, c, w = new.shape
    n_win = c // ratio + 2  # windows a chunk can touch, plus the one left open after it
    staged = jnp.zeros((b, n_win * ratio, w), new.dtype).at[:, :ratio].set(buffer.astype(new.dtype))
    staged = jax.lax.dynamic_update_slice(staged, new, (0, start % ratio, 0))
    return staged.reshape(b, n_win, ratio, w)


def open_slot(staged: Float[Array, "b n ..."], start, count, ratio: int) -> Float[Array, "b ..."]:
    """The staged window left open after `count` tokens from `start` (the next call's buffer)."""
    return jax.lax.dynamic_index_in_dim(staged, (start + count) // ratio - start // ratio, axis=1, keepdims=False)


def store_complete(
    entries: Float[Array, "b t d"], values: Float[Array, "b n d"], start, count, ratio: int
) -> Float[Array, "b t d"]:
    """Write values of windows start//ratio + i that the chunk completed; incomplete ones are dropped."""
    window_ids = start // ratio + jnp.arange(values.shape[1])
    complete = (window_ids + 1) * ratio <= start + count
    rows = jnp.where(complete, window_ids, entries.shape[1])
    return entries.at[:, rows].set(values.astype(entries.dtype), mode="drop")


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
        keys: Float[Array, "b t k"], freqs,
    ) -> Int[Array, "b c topk"]:
        """Indices of the selected entries; -1 where fewer than k are visible."""
        b, c, _ = x.shape
        q = apply_rope(self.wq_b(q_lat).reshape(b, c, self.n_heads, self.head_dim), positions, freqs)
        visible = (positions + 1) // self.compressor.ratio
        return top_visible(registry.op("index_scores")(q, keys, self.weights_proj(x), visible), self.topk)


def index_scores(
    q: Float[Array, "b c h d"], keys: Float[Array, "b t d"], head_weights: Float[Array, "b c h"]
) -> Float[Array, "b c t"]:
    """Lightning-indexer score: sum over heads of w_h * h^-1/2 * d^-1/2 * ReLU(q_h . k)."""
    per_head = jax.nn.relu(jnp.einsum("bchd,btd->bcht", q, keys)) * q.shape[-1] ** -0.5
    return jnp.einsum("bcht,bch->bct", per_head, head_weights * q.shape[-2] ** -0.5)


def visible_index_scores(
    q: Float[Array, "b c h d"], keys: Float[Array, "b t d"], head_weights: Float[Array, "b c h"],
    visible: Int[Array, " c"],
) -> Float[Array, "b c t"]:
    """`index_scores` where each query sees its first `visible` keys; -inf for the rest."""
    scores = index_scores(q, keys, head_weights)
    return jnp.where(jnp.arange(keys.shape[1]) < visible[:, None], scores, -jnp.inf)


def top_visible(scores: Float[Array, "b c t"], k: int) -> Int[Array, "b c k"]:
    """Top-k entry indices of scores where invisible entries hold -inf; -1 for picks that are not visible.

    Ties break towards the lower entry index (`lax.top_k` is stable), so selection is deterministic.
    """
    values, ids = jax.lax.top_k(scores, min(k, scores.shape[-1]))
    return jnp.where(values > -jnp.inf, ids, -1)
