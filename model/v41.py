"""DeepSeek-V4.1: causal encoder-decoder with shared KV sources, two-level index selection, single-pass mHC.

Every layer keeps its own sliding window. Layers with a compress ratio read the shared compressed KV of the
latest KV-source layer at or below them (ratio 2 in the encoder, ratio 1 — per-token KV projected once from
the encoder output — in the decoder). Index-source layers publish top-k picks that the layers after them
reuse; the candidate source also publishes a pool of blocks that later (re-index) sources select inside.
Semantics follow transformers' `models/deepseek_v41/modular_deepseek_v41.py` (GitHub main).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from model.attention import LatentAttention, attend_rows, push_window, ring_state, window_ids
from model.compressor import gated_pool, recent_slots, top_visible
from model.config_v41 import V41Config
from model.engram import Engram
from model.fake_quant import fake_quant_fp4, fake_quant_fp8
from model.hyper import collapse, expand
from model.linear import Linear
from model.moe import MoE, any_rank
from model.norms import RMSNorm
from model.paged import Paged, row_pages, store_windows
from model.replay import Replay, key_positions, kept_span, put_rows, take_positions, take_rows
from model.rope import apply_rope, layer_frequencies
from model.transformer import Embedding, HyperBlock, empty_cache, input_streams
from model import registry


def candidate_pool(
    scores: Float[Array, "b c t"], visible_count: Int[Array, " c"], topk_blocks: int, block: int
) -> Bool[Array, "b c t"]:
    """Level one of the two-level selection: the best `topk_blocks` blocks of `block` entries per query.

    A block scores the max of its entries (-inf when none is visible); the block holding the newest visible
    entry is always kept, since it is only partly filled.
    """
    t = scores.shape[-1]
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, -t % block)), constant_values=-jnp.inf)
    block_scores = jnp.max(padded.reshape(*scores.shape[:2], -1, block), axis=-1)
    n_blocks = block_scores.shape[-1]
    newest = (visible_count - 1) // block  # -1 (nothing pinned) before the first entry
    block_scores = jnp.where(jnp.arange(n_blocks) == newest[:, None], jnp.inf, block_scores)
    values, ids = jax.lax.top_k(block_scores, min(topk_blocks, n_blocks))
    keep = jnp.zeros(block_scores.shape, bool)
    keep = jax.vmap(jax.vmap(lambda k, i, v: k.at[i].set(v > -jnp.inf)))(keep, ids, values)
    return jnp.repeat(keep, block, axis=-1)[..., :t]


PER_QUERY = ("picks", "candidates")  # shared group state with a query axis (axis 1); the rest is per sequence


class SharedCompressor(nnx.Module):
    """A KV source's compressor: ratio r > 1 pools r tokens with a softmax gate; ratio 1 projects each token."""

    def __init__(self, config: V41Config, ratio: int, dtype, rngs: nnx.Rngs):
        self.wkv = Linear(config.hidden_size, config.head_dim, dtype, rngs, compute_dtype=jnp.float32)
        if ratio > 1:
            self.wgate = Linear(config.hidden_size, config.head_dim, dtype, rngs, compute_dtype=jnp.float32)
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.ratio = ratio

    def latents(self, x: Float[Array, "b c d"], start, state: dict, count):
        """(pre-RoPE latents [b, n, hd] of groups start//r + i, new buffer state); incomplete groups included."""
        if self.ratio == 1:
            return self.norm(self.wkv(x)), {}
        pooled, recent = gated_pool(state, self.wkv(x), self.wgate(x), start, count, self.ratio)
        return self.norm(pooled), recent


class SharedIndexer(nnx.Module):
    """An index source: scores queries against the shared index keys; a KV source also derives those keys."""

    def __init__(self, config: V41Config, owns_keys: bool, dtype, rngs: nnx.Rngs):
        n, d = config.index_n_heads, config.index_head_dim
        self.wq_b = Linear(config.q_lora_rank, n * d, dtype, rngs, compute_dtype=jnp.float32)
        self.weights_proj = Linear(config.hidden_size, n, dtype, rngs, compute_dtype=jnp.float32)
        if owns_keys:
            self.wk = Linear(config.head_dim, d, dtype, rngs, compute_dtype=jnp.float32)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.owns_keys, self.n_heads, self.head_dim = owns_keys, n, d

    def keys(self, latents: Float[Array, "b n hd"], positions: Int[Array, " n"], freqs, quant: bool):
        """Index keys of pre-RoPE latents, roped at their group positions (FP4-simulated if `quant`)."""
        k = apply_rope(self.k_norm(self.wk(latents))[:, :, None], positions, freqs)[:, :, 0]
        return fake_quant_fp4(k, 32) if quant else k

    def scores(self, x, q_lat, positions, keys: Paged, visible_count, freqs, quant: bool) -> Float[Array, "b c t"]:
        """Weighted ReLU scores of this chunk's queries against the rows' index keys each sees (-inf past
        `visible_count`)."""
        b, c, _ = x.shape
        q = apply_rope(self.wq_b(q_lat).reshape(b, c, self.n_heads, self.head_dim), positions, freqs)
        if quant:
            q = fake_quant_fp4(q, 32)
        return registry.op("paged_index_scores")(q, keys.pages, keys.table, self.weights_proj(x), visible_count)


class AttentionV41(LatentAttention):
    """Shared-KV attention of one V4.1 layer: its own window plus its group's shared compressed KV."""

    def __init__(self, config: V41Config, layer: int, dtype, rngs: nnx.Rngs):
        super().__init__(config, dtype, rngs)
        self.ratio = config.compress_ratios[layer]
        self.is_kv_source = layer in config.kv_source_layer_ids
        self.is_index_source = layer in config.index_source_layer_ids
        if self.is_kv_source:
            self.compressor = SharedCompressor(config, self.ratio, dtype, rngs)
        if self.is_index_source:
            self.indexer = SharedIndexer(config, self.is_kv_source, dtype, rngs)
        self.is_candidate_source = layer == config.candidate_source_layer_id
        self.uses_candidates = 0 <= config.candidate_source_layer_id < layer
        self.freqs = tuple(layer_frequencies(config, layer).tolist())
        self.config = config

    def init_state(self, batch: int, max_len: int, ring: int | None = None) -> dict:
        """Window ring; for a KV source also its group buffers, shared entries and (if an index source) keys."""
        cfg = self.config
        state = ring_state(cfg, batch, ring)
        if self.is_kv_source:
            n = max_len // self.ratio
            state["entries"] = row_pages(jnp.zeros((batch, n, cfg.head_dim), jnp.float32))
            if self.ratio > 1:
                state.update(recent_slots(batch, self.ratio + state["ring_kv"].shape[1] - cfg.sliding_window,
                                          cfg.head_dim))
            if self.is_index_source:
                state["index_keys"] = row_pages(jnp.zeros((batch, n, cfg.index_head_dim), jnp.float32))
        return state

    def compress(self, x: Float[Array, "b c d"], start, state: dict, shared: dict, count):
        """(a KV source's compressed groups of the chunk, complete or not, by paged leaf: `entries` and, for an
        index source, `index_keys` ({} for other layers); the state with its new group buffers; shared)."""
        if not (self.ratio and self.is_kv_source):
            return {}, state, shared
        r, quant = self.ratio, self.config.qat_fake_quant
        freqs = jnp.asarray(self.freqs, jnp.float32)
        latents, buffers = self.compressor.latents(x, start, state, count)
        group_pos = (start // r + jnp.arange(latents.shape[1])) * r
        groups = {}
        if self.is_index_source:
            groups["index_keys"] = self.indexer.keys(latents, group_pos, freqs, quant)
        entries = apply_rope(latents[:, :, None], group_pos, freqs)[:, :, 0]
        groups["entries"] = fake_quant_fp4(entries, 16, e4m3_scales=True) if quant else entries
        return groups, {**state, **buffers}, shared

    def store(self, groups: dict, start, count, state: dict, shared: dict) -> tuple[dict, dict]:
        """(state, shared) with the completed `groups` written into the pools (all rows) and published."""
        state, shared = dict(state), dict(shared)
        for name, values in groups.items():
            state[name] = shared[name] = store_windows(state[name], values, start, count, self.ratio)
        return state, shared

    def attend(self, x: Float[Array, "b c d"], start, state: dict, shared: dict, count=None):
        """Attend for tokens start..start+c-1 (the chunk's completed groups already stored; the first `count`
        enter the window ring); returns (output, new state, updated shared group state)."""
        cfg, quant = self.config, self.config.qat_fake_quant
        freqs = jnp.asarray(self.freqs, jnp.float32)
        b, c, _ = x.shape
        count = c if count is None else count
        positions = start + jnp.arange(c, dtype=jnp.int32)
        q_lat = self.q_norm(self.wq_a(x))
        q = apply_rope(self.wq_b(q_lat).reshape(b, c, cfg.num_attention_heads, cfg.head_dim), positions, freqs)
        kv = apply_rope(self.kv_norm(self.wkv(x))[:, :, None], positions, freqs)[:, :, 0]
        if quant:
            kv = fake_quant_fp8(kv, 32)
        ids, valid = window_ids(state["ring_pos"], positions, cfg.sliding_window)
        floor = shared.get("replay_floor")  # [b]: bounded replay hides window keys below it (model.replay)
        if floor is not None:
            valid &= key_positions(state["ring_pos"], positions, cfg.sliding_window) >= floor[:, None, None]
        window, sink, new_state, shared = (jnp.concatenate([state["ring_kv"].astype(kv.dtype), kv], axis=1),
                                           self.attn_sink[...], dict(state), dict(shared))
        if self.ratio and self.is_index_source:
            self._select(x, q_lat, positions, shared, freqs)
        picks = shared.get("picks") if self.ratio else None
        if picks is not None:  # without an index source no compressed entry is attended
            entries = shared["entries"]
            out = registry.op("paged_sink_attention")(q, window, ids, valid, sink, entries.pages, entries.table, picks)
        else:
            out = registry.op("sink_attention")(q, window, ids, valid, sink)
        ring_kv, ring_pos = push_window(state, kv, positions, count)
        if floor is not None:  # tokens below the floor never enter the ring
            below = ring_pos < floor[:, None]
            ring_kv = jnp.where(below[..., None], state["ring_kv"], ring_kv)
            ring_pos = jnp.where(below, state["ring_pos"], ring_pos)
        new_state["ring_kv"], new_state["ring_pos"] = ring_kv, ring_pos
        return self.output(out, positions, freqs), new_state, shared

    def _select(self, x, q_lat, positions, shared: dict, freqs) -> None:
        """Top-k picks of this index source (inside the candidate pool when one was published)."""
        cfg, keys = self.config, shared["index_keys"]
        visible_count = (positions + 1) // self.ratio
        scores = self.indexer.scores(x, q_lat, positions, keys, visible_count, freqs, cfg.qat_fake_quant)
        if self.is_candidate_source:
            shared["candidates"] = candidate_pool(scores, visible_count, cfg.candidate_topk_blocks,
                                                  cfg.candidate_block_size)
        elif self.uses_candidates and "candidates" in shared:
            scores = jnp.where(shared["candidates"], scores, -jnp.inf)
        shared["picks"] = top_visible(scores, cfg.index_topk)


class BlockV41(HyperBlock):
    """A V4.1 layer with single-pass mHC: each site's `pre` weights collapse the input of the next site."""

    def __init__(self, config: V41Config, layer: int, dtype, rngs: nnx.Rngs):
        super().__init__(config, rngs)
        self.attn = AttentionV41(config, layer, dtype, rngs)
        self.ffn = MoE(config, False, dtype, rngs, v41=True)
        if layer in config.engram_layer_ids:
            self.engram = Engram(config.hidden_size, config.hc_mult, config.engram_lookups, config.engram_head_dim,
                                 config.rms_norm_eps, dtype, rngs)
        self.has_engram = layer in config.engram_layer_ids

    def __call__(self, streams, pre_mix, tokens, start, state: dict, shared: dict, engram_rows=None, count=None):
        """(streams, the `pre` for the next site, state, shared) after Engram (if any), attention and MoE."""
        if self.has_engram:
            streams = self.engram(streams, engram_rows)
        attn_pre, post, comb, h = self.hc_attn.site(streams, pre_mix)
        y, state, shared = attend_rows(self.attn, self.attn_norm(h), start, count, state, shared)
        streams = expand(streams, y, post, comb)
        ffn_pre, post, comb, h = self.hc_ffn.site(streams, attn_pre)
        y = self.ffn(self.ffn_norm(h), tokens)
        return expand(streams, y, post, comb), ffn_pre, state, shared


def first_streams(embed, tokens: Int[Array, "b c"], n: int) -> tuple[Float[Array, "b c n d"], Float[Array, "b c n"]]:
    """(the streams a chunk enters the first layer with, the first site's `pre` weights: the first stream)."""
    streams = input_streams(embed, tokens, n)
    return streams, jnp.broadcast_to(jax.nn.one_hot(0, n, dtype=jnp.float32), (*streams.shape[:2], n))


def mixed_logits(norm, head, streams: Float[Array, "b c n d"], pre_mix: Float[Array, "b c n"]) -> Float[Array, "b c v"]:
    """fp32 logits of the streams collapsed with the last site's `pre` weights."""
    return head(norm(collapse(streams, pre_mix)).astype(jnp.float32))


def tap(streams: Float[Array, "b c n d"]) -> Float[Array, "b c d"]:
    """A layer's output streams as a DSpark drafter reads them: averaged over the hc copies."""
    return jnp.mean(streams.astype(jnp.float32), axis=2)


def run_layer(block: BlockV41, streams, pre_mix, tokens, start, state: dict, shared: dict, engram_rows=None,
              count=None, kept=None):
    """`block` on (streams, pre_mix); with `kept` ([b, c] bool) the other positions keep their inputs. Returns
    (streams, pre_mix, state, shared)."""
    out_streams, out_mix, state, shared = block(streams, pre_mix, tokens, start, state, shared, engram_rows, count)
    if kept is not None:
        out_streams = jnp.where(kept[:, :, None, None], out_streams, streams)
        out_mix = jnp.where(kept[:, :, None], out_mix, pre_mix)
    return out_streams, out_mix, state, shared


def masked_rows(span: tuple, width: int) -> Bool[Array, "b c"]:
    """`mask` replay: the positions a replay layer updates (from each row's first kept token, `kept_span`)."""
    return jnp.arange(width)[None, :] >= jnp.reshape(span[0], (-1, 1))


def replays(span: tuple) -> Bool[Array, ""]:
    """`compact` replay: whether any row keeps a token (else the replay layers are skipped)."""
    return any_rank(jnp.any(span[1] > 0))


def kept_run(run: tuple, span: tuple, width: int, layer_ids) -> tuple:
    """`compact` replay's run (streams, pre_mix, tokens, Engram rows by layer, shared): each row's kept tail
    gathered into `width` rows (of the Engram rows, those of `layer_ids`), shared with the replay floor."""
    streams, pre_mix, tokens, rows, shared = run
    at = jnp.broadcast_to(span[0], (tokens.shape[0],))
    take = lambda x: take_rows(x, at, width)  # noqa: E731
    kept_shared = {k: take(v) if k in PER_QUERY else v for k, v in shared.items()}
    return (take(streams), take(pre_mix), take(tokens), {i: take(r) for i, r in rows.items() if i in layer_ids},
            {**kept_shared, "replay_floor": span[2]})


def put_kept(span: tuple, x: Array, kept: Array) -> Array:
    """`x` with each row's kept tail replaced by `kept` (the inverse of `kept_run`'s gather)."""
    b = x.shape[0]
    return put_rows(x, kept, jnp.broadcast_to(span[0], (b,)), jnp.broadcast_to(span[1], (b,)))


class DeepseekV41(nnx.Module):
    """The V4.1 text model; `__call__` runs a chunk of tokens against a per-sequence cache."""

    def __init__(self, config: V41Config, rngs: nnx.Rngs, dtype=jnp.float32):
        d = config.hidden_size
        self.embed = Embedding(config.vocab_size, d, dtype, rngs)
        self.layers = nnx.List([BlockV41(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.head = Linear(d, config.vocab_size, dtype, rngs, compute_dtype=jnp.float32)
        self.config = config

    def init_cache(self, batch: int, max_len: int, ring: int | None = None) -> dict:
        """An empty cache for `batch` sequences of up to `max_len` tokens (window rings of `ring` slots)."""
        return empty_cache(self.config, self.layers, batch, max_len, ring)

    def streams(self, tokens: Int[Array, "b c"], cache: dict, engram_rows=(), count=None, collect=(),
                replay: Replay | None = None, prompt_end=None):
        """(residual streams, the last site's `pre` weights, new cache) for the next chunk of tokens, plus the
        taps [b, c, len(collect) * hidden] when `collect` names layers: each one's output streams averaged over
        the hc copies, concatenated in `collect` order (the target features a DSpark drafter reads).

        `engram_rows` holds, per Engram layer in order, the looked-up table rows [b, c, n_lookups, head_dim].
        `replay` bounds the layers after the last KV source to each row's last `replay.keep` prompt tokens,
        the prompt ending at `prompt_end` (per row; default: this chunk's end); see `model.replay`.
        """
        if any(not 0 <= i < len(self.layers) for i in collect):
            raise ValueError(f"collect={list(collect)} names layers outside [0, {len(self.layers)})")
        start = cache["pos"]
        streams, pre_mix = first_streams(self.embed, tokens, self.config.hc_mult)
        if len(engram_rows) != len(self.config.engram_layer_ids):
            raise ValueError(f"expected Engram rows for layers {list(self.config.engram_layer_ids)}, "
                             f"got {len(engram_rows)} arrays")
        rows = dict(zip(self.config.engram_layer_ids, engram_rows))
        count = tokens.shape[1] if count is None else count
        replay = Replay() if replay is None else replay
        if not isinstance(replay, Replay):
            raise ValueError(f"replay must be a model.replay.Replay, got {replay!r}")
        split = self.config.n_prefill_layer if replay.active else len(self.layers)
        if split < len(self.layers):  # before tracing any layer: a bad keep fails fast
            replay.check(cache["layers"][split]["ring_kv"].shape[1], self.config.sliding_window)
        run = (streams, pre_mix, tokens, rows, {})
        streams, pre_mix, states, shared, taps = self._run_layers(range(split), run, start, cache, count, collect)
        if split < len(self.layers):
            span = kept_span(start, count, prompt_end, replay.keep, tokens.shape[0])
            run = (streams, pre_mix, tokens, rows, shared)
            replayed = (functools.partial(self._compact, width=min(tokens.shape[1], replay.keep))
                        if replay.mode == "compact" else self._masked)
            streams, pre_mix, more, more_taps = replayed(range(split, len(self.layers)), run, start, count, cache,
                                                         span, collect)
            states, taps = states + more, {**taps, **more_taps}
        cache = {**cache, "pos": start + count, "layers": states}
        if collect:
            return streams, pre_mix, cache, jnp.concatenate([taps[i] for i in collect], axis=-1)
        return streams, pre_mix, cache

    def _run_layers(self, layer_ids, run: tuple, start, cache: dict, count, collect, kept=None):
        """Layers `layer_ids` on `run` = (streams, pre_mix, tokens, Engram rows by layer, shared group state);
        with `kept` ([b, c] bool) the other rows keep their input streams. Returns (streams, pre_mix, the
        layers' states, shared, taps by layer)."""
        streams, pre_mix, tokens, rows, shared = run
        states, taps = [], {}
        for i in layer_ids:
            streams, pre_mix, state, shared = run_layer(self.layers[i], streams, pre_mix, tokens, start,
                                                        cache["layers"][i], shared, rows.get(i), count, kept)
            states.append(state)
            if i in collect:
                taps[i] = tap(streams)
        return streams, pre_mix, states, shared, taps

    def _masked(self, layer_ids, run: tuple, start, count, cache: dict, span, collect):
        """`mask` replay: every row runs with window keys below the floor hidden; rows before it are kept."""
        kept = masked_rows(span, run[0].shape[1])
        run = (*run[:4], {**run[4], "replay_floor": span[2]})
        streams, pre_mix, states, _, taps = self._run_layers(layer_ids, run, start, cache, count, collect, kept)
        return streams, pre_mix, states, taps

    def _compact(self, layer_ids, run: tuple, start, count, cache: dict, span, collect, width: int):
        """`compact` replay: each row's kept tail gathered into `width` = min(chunk, keep) rows, run, scattered
        back; the layers are skipped when no row keeps a token."""
        streams, pre_mix = run[:2]
        offset, length, _ = span
        unchanged = {i: tap(streams) for i in collect if i in layer_ids}
        put = functools.partial(put_kept, span)

        def replayed():
            kept = kept_run(run, span, width, layer_ids)
            out, out_mix, states, _, taps = self._run_layers(layer_ids, kept, start + offset, cache, length, collect)
            return put(streams, out), put(pre_mix, out_mix), states, {i: put(unchanged[i], t) for i, t in taps.items()}

        def skipped():
            return streams, pre_mix, [cache["layers"][i] for i in layer_ids], unchanged

        return jax.lax.cond(replays(span), replayed, skipped)

    def __call__(self, tokens: Int[Array, "b c"], cache: dict, engram_rows=(), count=None, collect=(),
                 replay: Replay | None = None, prompt_end=None, at=None, final=False):
        """(fp32 logits [b, c, vocab], new cache), plus the taps of `streams` when `collect` names layers.
        With an active `replay`, positions below each row's floor hold no next-token logits (`model.replay`).
        `at` [b, v] (chunk offsets) gives the logits of those positions only, [b, v, vocab]. `final` also
        returns, last, every position's (streams, pre-mix weights): what `final_logits` projects."""
        streams, pre_mix, cache, *taps = self.streams(tokens, cache, engram_rows, count, collect, replay, prompt_end)
        picked = self.final_logits((take_positions(streams, at), take_positions(pre_mix, at)))
        return (picked, cache, *taps) + (((streams, pre_mix),) if final else ())

    def final_logits(self, final: tuple) -> Float[Array, "b c v"]:
        """fp32 logits of every position from the (streams, pre-mix weights) `__call__(..., final=True)` returns."""
        return mixed_logits(self.norm, self.head, *final)
