"""The DeepSeek-V4 stack: embedding, mHC blocks (attention + MoE), final stream collapse, head, MTP blocks."""

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from model.attention import Attention, attend_rows
from model.axes import param
from model.config import ModelConfig
from model.hyper import HyperConnection, HyperHead, expand
from model.linear import Linear, normal_init
from model.moe import MoE
from model.norms import RMSNorm
from model.replay import take_positions


def empty_cache(config, layers, batch: int, max_len: int, ring: int | None = None) -> dict:
    """Position 0 and every layer's empty attention state, for sequences of up to `max_len` tokens."""
    if max_len > config.max_position_embeddings:
        raise ValueError(f"max_len={max_len} exceeds max_position_embeddings={config.max_position_embeddings}")
    return {"pos": jnp.zeros((), jnp.int32),
            "layers": [block.attn.init_state(batch, max_len, ring) for block in layers]}


def input_streams(embed, tokens: Int[Array, "b c"], n: int) -> Float[Array, "b c n d"]:
    """The residual streams a chunk enters the first layer with: its embeddings, copied to each of `n` streams."""
    x = embed(tokens)
    return jnp.broadcast_to(x[:, :, None], (*x.shape[:2], n, x.shape[-1]))


def project_logits(hc_head, norm, head, streams: Float[Array, "b c n d"]) -> Float[Array, "b c v"]:
    """fp32 logits from the streams: collapsed (`hc_head`), normed, projected onto the vocabulary."""
    return head(norm(hc_head(streams)).astype(jnp.float32))


class Embedding(nnx.Module):
    """Token embedding table [vocab, hidden]."""

    def __init__(self, vocab: int, dim: int, dtype, rngs: nnx.Rngs):
        self.weight = param(normal_init(rngs, (vocab, dim), dtype), "vocab", "embed")

    def __call__(self, tokens: Int[Array, "*t"]) -> Float[Array, "*t d"]:
        return self.weight[...][tokens]


class HyperBlock(nnx.Module):
    """What every V4 / V4.1 layer owns around its attention and MoE: their input norms and mHC sites."""

    def __init__(self, config, rngs: nnx.Rngs):
        d = config.hidden_size
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, config.rms_norm_eps)
        hc = (config.hc_mult, d, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.hc_attn = HyperConnection(*hc, rngs=rngs)
        self.hc_ffn = HyperConnection(*hc, rngs=rngs)


class Block(HyperBlock):
    """One layer: mHC around attention, then mHC around the MoE."""

    def __init__(self, config: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        super().__init__(config, rngs)
        self.attn = Attention(config, layer, dtype, rngs)
        self.ffn = MoE(config, config.is_hash_layer(layer), dtype, rngs)

    def __call__(
        self, streams: Float[Array, "b c n d"], tokens: Int[Array, "b c"], start: Int[Array, "*start"], state: dict,
        count=None,
    ) -> tuple[Float[Array, "b c n d"], dict]:
        _, post, comb, h = self.hc_attn.site(streams)
        y, state = attend_rows(self.attn, self.attn_norm(h), start, count, state)
        streams = expand(streams, y, post, comb)
        _, post, comb, h = self.hc_ffn.site(streams)
        y = self.ffn(self.ffn_norm(h), tokens)
        return expand(streams, y, post, comb), state


class MTPBlock(Block):
    """Next-token-prediction block: mixes the next token's embedding into the main streams, then one Block.

    It shares the embedding and head with the main model and has its own final collapse and norm.
    """

    def __init__(self, config: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        super().__init__(config, layer, dtype, rngs)
        d = config.hidden_size
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.e_proj = Linear(d, d, dtype, rngs)
        self.h_proj = Linear(d, d, dtype, rngs)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.hc_head = HyperHead(config.hc_mult, d, config.hc_eps, config.rms_norm_eps, rngs)

    def mix_inputs(
        self, streams: Float[Array, "b c n d"], next_embeds: Float[Array, "b c d"]
    ) -> Float[Array, "b c n d"]:
        """Block input: e_proj(enorm(embedding)) broadcast to every stream + h_proj(hnorm(stream))."""
        return self.e_proj(self.enorm(next_embeds))[:, :, None] + self.h_proj(self.hnorm(streams))


class DeepseekV4(nnx.Module):
    """The whole model; `__call__` runs a chunk of tokens against a per-sequence cache."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        d = config.hidden_size
        self.embed = Embedding(config.vocab_size, d, dtype, rngs)
        self.layers = nnx.List([Block(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.hc_head = HyperHead(config.hc_mult, d, config.hc_eps, config.rms_norm_eps, rngs)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.head = Linear(d, config.vocab_size, dtype, rngs, compute_dtype=jnp.float32)
        n_main = config.num_hidden_layers
        self.mtp = nnx.List([MTPBlock(config, n_main + i, dtype, rngs)
                             for i in range(config.num_nextn_predict_layers)])
        self.config = config

    def init_cache(self, batch: int, max_len: int, ring: int | None = None) -> dict:
        """An empty cache for `batch` sequences of up to `max_len` tokens (MTP layers included); window
        rings of `ring` slots (default: the window)."""
        return {**empty_cache(self.config, self.layers, batch, max_len, ring),
                "mtp": [blk.attn.init_state(batch, max_len, ring) for blk in self.mtp]}

    def streams(self, tokens: Int[Array, "b c"], cache: dict, count=None, collect=()):
        """Residual streams after the last layer for the next chunk of tokens and the advanced cache, plus the
        taps [b, c, len(collect) * n * d] when `collect` names layers: each one's output streams, flattened and
        concatenated in `collect` order (the MTP drafter reads the last layer's).

        Only the first `count` tokens (default all) are real: the rest pad a static bucket.
        """
        n_layers = self.config.num_hidden_layers
        if any(not 0 <= i < n_layers for i in collect):
            raise ValueError(f"collect={list(collect)} names layers outside [0, {n_layers})")
        count = tokens.shape[1] if count is None else count
        start = cache["pos"]
        streams = input_streams(self.embed, tokens, self.config.hc_mult)
        states, taps = [], {}
        for i, (block, state) in enumerate(zip(self.layers, cache["layers"])):
            streams, state = block(streams, tokens, start, state, count)
            if i in collect:
                taps[i] = streams
            states.append(state)
        taps = {i: tap.reshape(*tap.shape[:2], -1) for i, tap in taps.items()}
        cache = {**cache, "pos": start + count, "layers": states}
        if collect:
            return streams, cache, jnp.concatenate([taps[i] for i in collect], axis=-1)
        return streams, cache

    def head_logits(self, streams: Float[Array, "b c n d"], hc_head=None, norm=None) -> Float[Array, "b c v"]:
        """fp32 logits from the streams (the main collapse and norm unless an MTP block's are given)."""
        return project_logits(hc_head or self.hc_head, norm or self.norm, self.head, streams)

    def __call__(self, tokens: Int[Array, "b c"], cache: dict, count=None, collect=(), at=None, final=False):
        """(fp32 logits [b, c, vocab], new cache), plus the taps of `streams` when `collect` names layers.
        `at` [b, v] (chunk offsets) gives the logits of those positions only, [b, v, vocab]: the vocabulary
        projection runs on them alone. `final` also returns, last, every position's final streams: what
        `final_logits` projects (a server's prompt logprobs)."""
        streams, cache, *taps = self.streams(tokens, cache, count, collect)
        return (self.head_logits(take_positions(streams, at)), cache, *taps) + ((streams,) if final else ())

    def final_logits(self, streams: Float[Array, "b c n d"]) -> Float[Array, "b c v"]:
        """fp32 logits of every position from the final streams `__call__(..., final=True)` returns."""
        return self.head_logits(streams)

    def mtp_logits(
        self, streams: Float[Array, "b c n d"], next_tokens: Int[Array, "b c"], cache: dict, depth: int = 0
    ) -> tuple[Float[Array, "b c v"], dict]:
        """Logits of MTP block `depth` for position t+2, from the main streams at t and the token at t+1.

        `cache["pos"]` must be the position of the first row of `streams` (the MTP cache advances by its own
        chunks, so call it with the same chunking as the main model).
        """
        blk = self.mtp[depth]
        start = cache["pos"] - streams.shape[1]
        x = blk.mix_inputs(streams, self.embed(next_tokens))
        out, state = blk(x, next_tokens, start, cache["mtp"][depth])
        mtp_states = list(cache["mtp"])
        mtp_states[depth] = state
        return self.head_logits(out, blk.hc_head, blk.norm), {**cache, "mtp": mtp_states}
