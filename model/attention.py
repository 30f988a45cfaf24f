"""Shared-KV multi-query attention over a sliding window plus compressed entries, with per-head sinks.

Every query attends to the keys of its sliding window (ring slots and in-chunk tokens, a per-row pool
[window ring | this chunk]), then the CSA top-k picks or every visible HCA entry, read from the layer's page
pool through the row's block table (`model.paged`). Keys are gathered, never masked out of a dense score
matrix. K = V (one 512-d latent per token).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from model.axes import param
from model.compressor import Compressor, Indexer
from model.config import CSA, HCA, ModelConfig
from model.linear import GroupedLinear, Linear
from model.norms import RMSNorm, rms_normalize
from model.paged import per_row, store_windows
from model.rope import apply_rope, layer_frequencies
from model import registry


def window_ids(
    ring_pos: Int[Array, "b w"], positions: Int[Array, " c"], window: int
) -> tuple[Int[Array, "b c k"], Bool[Array, "b c k"]]:
    """Pool indices and validity of each query's sliding window: W ring slots, then W in-chunk tokens. Ring
    slots at or past the chunk's first position are stale (rolled-back speculative tokens) and never valid."""
    (b, w), c = ring_pos.shape, positions.shape[0]
    ring_ok = (ring_pos[:, None, :] >= 0) & (ring_pos[:, None, :] > positions[None, :, None] - window)
    ring_ok &= ring_pos[:, None, :] < positions[0]
    back = jnp.arange(c)[:, None] - jnp.arange(window)[None, :]  # chunk offsets i, i-1, ..., i-W+1
    ids = jnp.concatenate([jnp.broadcast_to(jnp.arange(w), (c, w)), w + back], axis=1)
    valid = jnp.concatenate([ring_ok, jnp.broadcast_to(back >= 0, (b, c, window))], axis=2)
    return jnp.broadcast_to(ids, (b, c, w + window)), valid


def push_window(state: dict, kv: Float[Array, "b c d"], positions: Int[Array, " c"], count):
    """Ring update with the chunk's first `count` tokens: the last min(count, ring) of them overwrite their
    slots (position mod ring size); returns (ring_kv, ring_pos). Tokens past `count` are padding."""
    ring = state["ring_kv"].shape[1]
    i = jnp.arange(kv.shape[1])
    slots = jnp.where((i < count) & (i >= count - ring), positions % ring, ring)  # out of range: dropped
    ring_kv = state["ring_kv"].at[:, slots].set(kv.astype(jnp.float32), mode="drop")
    return ring_kv, state["ring_pos"].at[:, slots].set(positions, mode="drop")


def ring_state(config, batch: int, ring: int | None) -> dict:
    """An empty window ring of `ring` slots (default: the window) for `batch` sequences."""
    ring = ring or config.sliding_window
    if ring < config.sliding_window:
        raise ValueError(f"a ring of {ring} slots cannot hold the {config.sliding_window}-token window")
    return {"ring_kv": jnp.zeros((batch, ring, config.head_dim), jnp.float32),
            "ring_pos": jnp.full((batch, ring), -1, jnp.int32)}


def attend_rows(attn, x: Float[Array, "b c d"], start, count, *states):
    """One attention layer over every row: `attn.compress` (per row, `model.paged.per_row`) pools the chunk's
    windows, `attn.store` writes the completed ones into the page pools (all rows at once), then `attn.attend`
    (per row) reads them; returns `attend`'s (output, *new states)."""
    count = x.shape[1] if count is None else count
    windows, *states = per_row(attn.compress, x, start, count, states)
    return per_row(attn.attend, x, start, count, attn.store(windows, start, count, *states))


class LatentAttention(nnx.Module):
    """The projections every V4 / V4.1 attention layer owns: low-rank queries (`wq_a`, `q_norm`, `wq_b`),
    one shared K=V latent (`wkv`, `kv_norm`), the grouped output (`wo_a`, `wo_b`) and per-head sinks."""

    def __init__(self, config, dtype, rngs: nnx.Rngs):
        d, h, hd, g = config.hidden_size, config.num_attention_heads, config.head_dim, config.o_groups
        self.wq_a = Linear(d, config.q_lora_rank, dtype, rngs)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = Linear(config.q_lora_rank, h * hd, dtype, rngs)
        self.wkv = Linear(d, hd, dtype, rngs)
        self.kv_norm = RMSNorm(hd, config.rms_norm_eps)
        self.wo_a = GroupedLinear(h * hd // g, config.o_lora_rank, g, dtype, rngs)
        self.wo_b = Linear(g * config.o_lora_rank, d, dtype, rngs)
        self.attn_sink = param(jnp.zeros((h,), jnp.float32), "heads")

    def output(self, out: Float[Array, "b c h d"], positions: Int[Array, "*pb c"], freqs) -> Float[Array, "b c D"]:
        """Inverse RoPE at the query positions, then the grouped low-rank output projection."""
        b, c = out.shape[:2]
        out = apply_rope(out, positions, freqs, inverse=True)
        return self.wo_b(self.wo_a(out.reshape(b, c, self.wo_a.groups, -1)).reshape(b, c, -1))


class Attention(LatentAttention):
    """One V4 layer's attention: the shared projections plus an optional compressor (+ indexer)."""

    def __init__(self, config: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        super().__init__(config, dtype, rngs)
        hd = config.head_dim
        self.kind = config.layer_kind(layer)
        if self.kind in (CSA, HCA):
            self.compressor = Compressor(config, config.compress_ratios[layer], hd, self.kind == CSA, dtype, rngs)
        if self.kind == CSA:
            self.indexer = Indexer(config, dtype, rngs)
        self.freqs = tuple(layer_frequencies(config, layer).tolist())  # static python floats
        self.config = config

    def init_state(self, batch: int, max_len: int, ring: int | None = None) -> dict:
        """Empty per-sequence state: the window ring (`ring` >= window slots, so rejected speculative tokens
        can roll back) and, where present, compressor and indexer states."""
        state = ring_state(self.config, batch, ring)
        backtrack = state["ring_kv"].shape[1] - self.config.sliding_window
        if self.kind in (CSA, HCA):
            state["compressor"] = self.compressor.init_state(batch, max_len, backtrack)
        if self.kind == CSA:
            state["indexer"] = self.indexer.compressor.init_state(batch, max_len, backtrack)
        return state

    def compress(self, x: Float[Array, "b c d"], start: Int[Array, "*start"], state: dict, count
                 ) -> tuple[dict, dict]:
        """(the pooled windows of the chunk's first `count` tokens by compressor, `compressor` and `indexer`
        where present; the state with their new rings of recent slots)."""
        windows, new_state = {}, dict(state)
        freqs = jnp.asarray(self.freqs, jnp.float32)
        for name, compressor in self._compressors():
            windows[name], recent = compressor(x, start, state[name], freqs, count)
            new_state[name] = {**state[name], **recent}
        return windows, new_state

    def store(self, windows: dict, start: Int[Array, "*start"], count, state: dict) -> tuple[dict]:
        """The state with the completed `windows` written into their compressors' page pools (all rows)."""
        new_state = dict(state)
        for name, compressor in self._compressors():
            new_state[name] = {**state[name], "entries": store_windows(state[name]["entries"], windows[name], start,
                                                                        count, compressor.ratio)}
        return (new_state,)

    def _compressors(self) -> list:
        """(state key, compressor) of the layer's compressors."""
        if self.kind == CSA:
            return [("compressor", self.compressor), ("indexer", self.indexer.compressor)]
        return [("compressor", self.compressor)] if self.kind == HCA else []

    def attend(
        self, x: Float[Array, "b c d"], start: Int[Array, "*start"], state: dict, count=None
    ) -> tuple[Float[Array, "b c d"], dict]:
        """Attend for tokens at positions start..start+c-1 (x already normed; the chunk's completed windows
        already stored); returns output and new state. Only the first `count` tokens (default all) enter the
        window ring; the rest are padding of a static bucket."""
        cfg, freqs = self.config, jnp.asarray(self.freqs, jnp.float32)
        b, c, _ = x.shape
        count = c if count is None else count
        positions = start + jnp.arange(c, dtype=jnp.int32)
        q_lat = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_lat).reshape(b, c, cfg.num_attention_heads, cfg.head_dim)
        q = apply_rope(rms_normalize(q, cfg.rms_norm_eps), positions, freqs)
        kv = apply_rope(self.kv_norm(self.wkv(x))[:, :, None], positions, freqs)[:, :, 0]

        ids, valid = window_ids(state["ring_pos"], positions, cfg.sliding_window)
        window, sink = jnp.concatenate([state["ring_kv"].astype(kv.dtype), kv], axis=1), self.attn_sink[...]
        if self.kind == HCA:  # every visible entry
            entries = state["compressor"]["entries"]
            visible = (positions + 1) // self.compressor.ratio
            out = registry.op("paged_hca_attention")(q, window, ids, valid, sink, entries.pages, entries.table,
                                                     visible)
        elif self.kind == CSA:
            entries = state["compressor"]["entries"]
            picks = self.indexer.select(x, q_lat, positions, state["indexer"]["entries"], freqs)
            out = registry.op("paged_sink_attention")(q, window, ids, valid, sink, entries.pages, entries.table,
                                                      picks)
        else:
            out = registry.op("sink_attention")(q, window, ids, valid, sink)
        new_state = dict(state)
        new_state["ring_kv"], new_state["ring_pos"] = push_window(state, kv, positions, count)
        return self.output(out, positions, freqs), new_state
