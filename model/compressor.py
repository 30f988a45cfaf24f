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
        self, x: Float[Array, "b c d"], start: Int[Array, ""], state: dict, freqs
    ) -> dict[str, jax.Array]:
        """Feed tokens at positions start..start+c-1; every window they complete is written to `entries`."""
        r, d = self.ratio, self.dim
        b, c, _ = x.shape
        positions = start + jnp.arange(c)
        kv = self.wkv(x)
        gate = self.wgate(x) + self.ape[...][positions % r]
        n_win = c // r + 2  # windows this chunk can touch, plus the one left open after it
        w0, offset = start // r, start % r

        def stage(buffer, new):
            staged = jnp.zeros((b, n_win * r, new.shape[-1]), jnp.float32).at[:, :r].set(buffer)
            staged = jax.lax.dynamic_update_slice(staged, new, (0, offset, 0))
            return staged.reshape(b, n_win, r, -1)

        kv_w, gate_w = stage(state["buf_kv"], kv), stage(state["buf_gate"], gate)
        new_state = {}
        if self.overlap:
            # a-halves of windows w0-1 .. w0+n_win-1; slot i+1 belongs to staged window i
            a_kv = jnp.concatenate([state["prev_kv"][:, None], kv_w[..., :d]], axis=1)
            a_gate = jnp.concatenate([state["prev_gate"][:, None], gate_w[..., :d]], axis=1)
            slots_kv = jnp.concatenate([a_kv[:, :n_win], kv_w[..., d:]], axis=2)
            slots_gate = jnp.concatenate([a_gate[:, :n_win], gate_w[..., d:]], axis=2)
        else:
            slots_kv, slots_gate = kv_w, gate_w
        pooled = jnp.sum(jax.nn.softmax(slots_gate, axis=2) * slots_kv, axis=2)  # [b, n_win, d]
        window_ids = w0 + jnp.arange(n_win)
        pooled = apply_rope(self.norm(pooled)[:, :, None], window_ids * r, freqs)[:, :, 0]
        entries = state["entries"]
        complete = (window_ids + 1) * r <= start + c
        rows = jnp.where(complete, window_ids, entries.shape[1])  # incomplete windows are dropped
        new_state["entries"] = entries.at[:, rows].set(pooled, mode="drop")
        open_window = (start + c) // r - w0
        new_state["buf_kv"] = jax.lax.dynamic_index_in_dim(kv_w, open_window, axis=1, keepdims=False)
        new_state["buf_gate"] = jax.lax.dynamic_index_in_dim(gate_w, open_window, axis=1, keepdims=False)
        if self.overlap:
            new_state["prev_kv"] = jax.lax.dynamic_index_in_dim(a_kv, open_window, axis=1, keepdims=False)
            new_state["prev_gate"] = jax.lax.dynamic_index_in_dim(a_gate, open_window, axis=1, keepdims=False)
        return new_state


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
        """Indices of the selected entries (ascending score order not guaranteed); -1 where none is visible.

        Ties are broken towards the lower entry index (`lax.top_k` is stable), so selection is deterministic.
        """
        b, c, _ = x.shape
        q = self.wq_b(q_lat).reshape(b, c, self.n_heads, self.head_dim)
        q = apply_rope(q, positions, freqs)
        per_head = jax.nn.relu(jnp.einsum("bchd,btd->bcht", q, keys)) * self.head_dim ** -0.5
        weights = self.weights_proj(x) * self.n_heads ** -0.5
        scores = jnp.einsum("bcht,bch->bct", per_head, weights)
        visible = jnp.arange(keys.shape[1]) < ((positions + 1) // self.compressor.ratio)[:, None]
        scores = jnp.where(visible, scores, -jnp.inf)
        _, ids = jax.lax.top_k(scores, min(self.topk, keys.shape[1]))
        return jnp.where(jnp.take_along_axis(jnp.broadcast_to(visible, scores.shape), ids, axis=-1), ids, -1)
