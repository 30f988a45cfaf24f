"""DSpark: a drafter for speculative decoding that drafts a block of tokens in two stages.

A parallel backbone of a few mHC layers runs on the block, attending to it and to a window of the target's
features; a low-rank Markov head then samples the block left to right, and a confidence head gives each draft's
survival probability. The draft layers take the target's form (V4 or V4.1). See docs/speculative-decoding.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, NamedTuple, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int, UInt32

from model.attention import LatentAttention, push_window, ring_state
from model.config import ConfigError, ModelConfig
from model.config_v41 import V41Config
from model.fake_quant import fake_quant_fp8
from model.hyper import HyperHead, collapse, expand
from model.linear import Linear
from model.moe import MoE
from model.norms import RMSNorm, rms_normalize
from model.rope import apply_rope, inv_frequencies
from model.transformer import Embedding, HyperBlock
from model.sampling_keys import GREEDY_BELOW, PURPOSE_DRAFT, first_argmax, request_key
from model import registry

_JSON_KEYS = {  # DSparkConfig field -> its key in a checkpoint's config.json / dspark.json
    "num_layers": "num_nextn_predict_layers", "block_size": "dspark_block_size",
    "noise_token_id": "dspark_noise_token_id", "target_layer_ids": "dspark_target_layer_ids",
    "markov_rank": "dspark_markov_rank", "n_routed_experts": "dspark_n_routed_experts",
    "num_experts_per_tok": "dspark_num_experts_per_tok", "window": "dspark_window",
    "confidence_temperatures": "dspark_confidence_temperatures",
}


@no_type_check  # built from config.json's raw values, which `__post_init__` coerces and checks
@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """The drafter's own sizes; everything else (widths, heads, norms, RoPE) is the target's config."""

    target_layer_ids: tuple[int, ...]
    num_layers: int = 3
    block_size: int = 5  # gamma: drafts per block
    noise_token_id: int = 128799
    markov_rank: int = 256
    n_routed_experts: int = 128
    num_experts_per_tok: int = 3
    window: int = 128  # context positions a block attends to
    confidence_temperatures: tuple[float, ...] = ()  # STS, one per block position; () means all 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "confidence_temperatures", tuple(float(t) for t in self.confidence_temperatures))
        for name in ("num_layers", "block_size", "markov_rank", "n_routed_experts", "num_experts_per_tok", "window"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"DSpark {name} must be a positive integer, got {getattr(self, name)!r}")
        if not self.target_layer_ids or list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            raise ConfigError(f"DSpark target_layer_ids {list(self.target_layer_ids)} must be increasing layer ids")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"DSpark num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts")
        temps = self.confidence_temperatures
        if temps and (len(temps) != self.block_size or not all(t > 0 for t in temps)):
            raise ConfigError(f"confidence_temperatures {list(temps)} must be {self.block_size} positive numbers")

    @property
    def temperatures(self) -> np.ndarray:
        """The STS temperature of each block position [gamma] (ones before calibration)."""
        return np.asarray(self.confidence_temperatures or (1.0,) * self.block_size, np.float32)

    @classmethod
    def from_v41(cls, config: V41Config) -> DSparkConfig:
        """The drafter a V4.1 checkpoint's config.json describes (its `dspark_*` fields, window = the target's)."""
        return cls(target_layer_ids=config.dspark_target_layer_ids, num_layers=config.num_nextn_predict_layers,
                   block_size=config.dspark_block_size, noise_token_id=config.dspark_noise_token_id,
                   markov_rank=config.dspark_markov_rank, n_routed_experts=config.dspark_n_routed_experts,
                   num_experts_per_tok=config.dspark_num_experts_per_tok, window=config.sliding_window)

    @classmethod
    def from_v4(cls, raw: dict[str, Any], target: ModelConfig, num_layers: int) -> DSparkConfig:
        """The drafter of a V4 checkpoint (V4-Flash-0731): its config.json's `dspark_*` fields (which V4's
        ModelConfig does not keep) and its `num_layers` stages, counted from its `mtp.*` tensors (its
        `num_nextn_predict_layers` is MTP's 1); experts and window default to the target's."""
        fields = {f: raw[k] for f, k in _JSON_KEYS.items() if k in raw and f != "num_layers"}
        defaults = {"n_routed_experts": target.n_routed_experts, "num_experts_per_tok": target.num_experts_per_tok,
                    "window": raw.get("dspark_window_size", target.sliding_window)}
        if "target_layer_ids" not in fields:
            raise ConfigError("config.json has DSpark tensors (mtp.*.main_proj) but no dspark_target_layer_ids")
        return cls(num_layers=num_layers, **(defaults | fields))

    @classmethod
    def from_json(cls, path: str | Path) -> DSparkConfig:
        """Read a `dspark.json` (the V4.1 config.json spelling of each field)."""
        raw: dict[str, Any] = json.loads(Path(path).read_text())
        unknown = sorted(set(raw) - set(_JSON_KEYS.values()))
        if unknown:
            raise ConfigError(f"{path}: unknown DSpark fields {unknown}")
        try:
            return cls(**{f: raw[k] for f, k in _JSON_KEYS.items() if k in raw})
        except TypeError as e:
            raise ConfigError(f"{path}: incomplete DSpark config: {e}") from None

    def save_json(self, path: str | Path) -> None:
        """Write a `dspark.json` (read back by `from_json`)."""
        fields = {k: getattr(self, f) for f, k in _JSON_KEYS.items()}
        Path(path).write_text(json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()},
                                         indent=2) + "\n")

    def stage_config(self, target: V41Config | ModelConfig) -> V41Config | ModelConfig:
        """The config the draft layers are built from: the target's widths with the drafter's experts and
        window (the draft layers hold no compressed KV)."""
        if self.target_layer_ids[-1] >= target.num_hidden_layers:
            raise ConfigError(f"DSpark target_layer_ids {list(self.target_layer_ids)} exceed the target's "
                              f"{target.num_hidden_layers} layers")
        if not 0 <= self.noise_token_id < target.vocab_size:
            raise ConfigError(f"dspark noise_token_id={self.noise_token_id} is outside the vocabulary")
        return dataclasses.replace(target, n_routed_experts=self.n_routed_experts,
                                   num_experts_per_tok=self.num_experts_per_tok, sliding_window=self.window)


_V4_NAMES = {"markov_head.embed.weight": "markov_head.markov_w1.weight",
             "markov_head.head.weight": "markov_head.markov_w2.weight"}  # V4-Flash-0731's spelling


def checkpoint_name(name: str, num_layers: int, v41: bool = True) -> str:
    """The checkpoint name of a drafter parameter: layer s lives under `mtp.{s}`, the context projection under
    the first layer, the final norm and collapse and the Markov and confidence heads under the last. V4.1
    checkpoints name the Markov head's tensors `embed` / `head`, V4 ones `markov_w1` / `markov_w2`."""
    if name.startswith("layers."):
        return "mtp." + name.removeprefix("layers.")
    return f"mtp.{0 if name.startswith('main_') else num_layers - 1}.{name if v41 else _V4_NAMES.get(name, name)}"


class DraftOutput(NamedTuple):
    """One drafted block per row: the tokens, the exact distributions they were drawn from, each draft's
    calibrated conditional survival probability, and the drafter state after absorbing the new features."""

    tokens: Int[Array, "r g"]
    probs: Float[Array, "r g V"]
    confidences: Float[Array, "r g"]
    state: list


def draft_noise(
    seeds: UInt32[Array, "r 2"], positions: Int[Array, "r g"], temperature: Float[Array, " r"], vocab: int
) -> Float[Array, "r g V"]:
    """The Gumbel noise of every draft position, from `request_key(seed, position, PURPOSE_DRAFT)`, generated in
    one batched call; zeros when every row is greedy (a batch-level `cond` that changes no row's draft)."""

    def noise():
        one = lambda seed, pos: jax.random.gumbel(request_key(seed, pos, PURPOSE_DRAFT), (vocab,), jnp.float32)  # noqa: E731
        return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(seeds, positions)

    return jax.lax.cond(jnp.any(temperature >= GREEDY_BELOW), noise,
                        lambda: jnp.zeros((*positions.shape, vocab), jnp.float32))


def draw_draft(
    logits: Float[Array, "r V"], seeds: UInt32[Array, "r 2"], positions: Int[Array, " r"],
    temperature: Float[Array, " r"], gumbel: Float[Array, "r V"] | None = None,
) -> tuple[Int[Array, " r"], Float[Array, "r V"]]:
    """(token, the distribution it was drawn from) per row: softmax(logits / T) by the Gumbel-max trick with
    noise from `request_key(seed, position, PURPOSE_DRAFT)` (or the same noise precomputed by `draft_noise`);
    greedy rows (T < 1e-5) take the argmax, one-hot."""
    if gumbel is None:
        gumbel = draft_noise(seeds, positions[:, None], temperature, logits.shape[-1])[:, 0]

    def row(logits, temp, noise):
        greedy = temp < GREEDY_BELOW
        scaled = logits / jnp.where(greedy, 1.0, temp)
        token = first_argmax(jnp.where(greedy, logits, scaled + noise))
        probs = jnp.where(greedy, jax.nn.one_hot(token, logits.shape[-1], dtype=jnp.float32),
                          jax.nn.softmax(scaled))
        return token, probs

    return jax.vmap(row)(logits.astype(jnp.float32), temperature, gumbel)


class DraftAttention(LatentAttention):
    """A draft layer's attention: block queries against the context window and the whole block (queries
    RMS-normalised per head beside a V4 target, as V4's attention does; not beside a V4.1 one)."""

    def __init__(self, config: V41Config | ModelConfig, dtype, rngs: nnx.Rngs):
        super().__init__(config, dtype, rngs)
        self.freqs = tuple(inv_frequencies(config.qk_rope_head_dim, config.rope_theta, None).tolist())
        self.config = config
        self.normalize_q = not isinstance(config, V41Config)

    def keys(self, x: Float[Array, "n c d"], positions: Int[Array, "n c"]) -> Float[Array, "n c hd"]:
        """K = V latents of inputs at their positions (context features, or normed block hidden states)."""
        kv = apply_rope(self.kv_norm(self.wkv(x))[:, :, None], positions, np.asarray(self.freqs, np.float32))
        return fake_quant_fp8(kv[:, :, 0], 32) if getattr(self.config, "qat_fake_quant", False) else kv[:, :, 0]

    def __call__(
        self, x: Float[Array, "n g d"], start: Int[Array, " n"], context: Float[Array, "n k hd"],
        visible: Bool[Array, "n k"],
    ) -> Float[Array, "n g d"]:
        """Attention of block rows at positions start.. (x already normed) over the `visible` context entries
        and every block row."""
        cfg, freqs = self.config, np.asarray(self.freqs, np.float32)
        (n, g, _), k = x.shape, context.shape[1]
        positions = start[:, None] + jnp.arange(g, dtype=jnp.int32)
        q = self.wq_b(self.q_norm(self.wq_a(x))).reshape(n, g, cfg.num_attention_heads, cfg.head_dim)
        q = apply_rope(rms_normalize(q, cfg.rms_norm_eps) if self.normalize_q else q, positions, freqs)
        kv = self.keys(x, positions)
        pool = jnp.concatenate([context.astype(kv.dtype), kv], axis=1)
        ids = jnp.broadcast_to(jnp.arange(k + g), (n, g, k + g))
        valid = jnp.concatenate([jnp.broadcast_to(visible[:, None], (n, g, k)), jnp.ones((n, g, g), bool)], -1)
        out = registry.op("sink_attention")(q, pool, ids, valid, self.attn_sink[...])
        return self.output(out, positions, freqs)


class DraftBlock(HyperBlock):
    """A draft layer: mHC around the draft attention and a MoE, in the target's form: V4.1's single pass (each
    site's `pre` weights collapse the next site's input) and gate, or V4's (each site collapses its own input)."""

    def __init__(self, config: V41Config | ModelConfig, dtype, rngs: nnx.Rngs):
        super().__init__(config, rngs)
        self.single_pass = isinstance(config, V41Config)
        self.attn = DraftAttention(config, dtype, rngs)
        self.ffn = MoE(config, False, dtype, rngs, v41=self.single_pass)

    def __call__(self, streams, pre_mix, tokens, start, context, visible):
        """(streams, the `pre` weights for the next site: None in V4's form) after attention and MoE."""
        attn_pre, post, comb, h = self.hc_attn.site(streams, pre_mix)
        streams = expand(streams, self.attn(self.attn_norm(h), start, context, visible), post, comb)
        ffn_pre, post, comb, h = self.hc_ffn.site(streams, attn_pre if self.single_pass else None)
        return expand(streams, self.ffn(self.ffn_norm(h), tokens), post, comb), ffn_pre if self.single_pass else None


class MarkovHead(nnx.Module):
    """B(previous token) = head(embed[previous token]): a rank-r bigram bias on the draft logits (V4 checkpoints
    name `embed` / `head` `markov_w1` / `markov_w2`, see `checkpoint_name`)."""

    def __init__(self, vocab: int, rank: int, dtype, rngs: nnx.Rngs):
        self.embed = Embedding(vocab, rank, dtype, rngs)
        self.head = Linear(rank, vocab, dtype, rngs, compute_dtype=jnp.float32)

    def __call__(self, previous: Int[Array, "..."]) -> tuple[Float[Array, "... V"], Float[Array, "... r"]]:
        """(logit bias, the previous token's Markov embedding)."""
        e = self.embed(previous)
        return self.head(e), e


class ConfidenceHead(nnx.Module):
    """Raw confidence logit w . [pre-norm hidden ; Markov embedding of the previous token]."""

    def __init__(self, dim: int, dtype, rngs: nnx.Rngs):
        self.proj = Linear(dim, 1, dtype, rngs, compute_dtype=jnp.float32)

    def __call__(self, h: Float[Array, "... d"], e: Float[Array, "... r"]) -> Float[Array, "..."]:
        return self.proj(jnp.concatenate([h.astype(jnp.float32), e.astype(jnp.float32)], axis=-1))[..., 0]


def lm_head(head: Float[Array, "V d"], x: Float[Array, "... d"]) -> Float[Array, "... V"]:
    """fp32 logits through the target's output projection `head` ([vocab, hidden])."""
    return jnp.einsum("...d,vd->...v", x.astype(jnp.float32), head.astype(jnp.float32))


class DSparkDrafter(nnx.Module):
    """The drafter module: context projection, draft layers, final norm, Markov and confidence heads."""

    def __init__(self, target: V41Config | ModelConfig, config: DSparkConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        stage = config.stage_config(target)
        d = target.hidden_size
        self.main_proj = Linear(len(config.target_layer_ids) * d, d, dtype, rngs)
        self.main_norm = RMSNorm(d, target.rms_norm_eps)
        self.layers = nnx.List([DraftBlock(stage, dtype, rngs) for _ in range(config.num_layers)])
        self.single_pass = isinstance(target, V41Config)
        if not self.single_pass:
            self.hc_head = HyperHead(stage.hc_mult, d, stage.hc_eps, stage.rms_norm_eps, rngs)
        self.norm = RMSNorm(d, target.rms_norm_eps)
        self.markov_head = MarkovHead(target.vocab_size, config.markov_rank, dtype, rngs)
        self.confidence_head = ConfidenceHead(d + config.markov_rank, dtype, rngs)
        self.config, self.stage = config, stage

    # ---- serving ---------------------------------------------------------------------------------------------
    def init_state(self, batch: int, ring: int | None = None) -> list[dict]:
        """Empty per-row context rings, one per draft layer: `ring` slots (default window + block + 1, so a
        rejected block of up to gamma + 1 positions rolls back by restarting earlier)."""
        ring = ring or self.config.window + self.config.block_size + 1
        return [ring_state(self.stage, batch, ring) for _ in self.layers]

    def absorb(
        self, features: Float[Array, "r c F"], start: Int[Array, " r"], count: Int[Array, " r"], state: list
    ) -> list:
        """Write each row's first `count` context features (positions start..) into its rings."""
        main_x = self.context(features)
        positions = start[:, None] + jnp.arange(features.shape[1], dtype=jnp.int32)

        def push(ring_kv, ring_pos, kv, pos, n):
            ring_kv, ring_pos = push_window({"ring_kv": ring_kv[None], "ring_pos": ring_pos[None]}, kv[None], pos, n)
            return {"ring_kv": ring_kv[0], "ring_pos": ring_pos[0]}

        out = []
        for blk, ring in zip(self.layers, state):
            out.append(jax.vmap(push)(ring["ring_kv"], ring["ring_pos"], blk.attn.keys(main_x, positions),
                                      positions, count))
        return out

    def draft(
        self, embed: Float[Array, "V d"], head: Float[Array, "V d"], features: Float[Array, "r c F"],
        start: Int[Array, " r"], count: Int[Array, " r"], state: list, anchor: Int[Array, " r"],
        seeds: UInt32[Array, "r 2"], temperature: Float[Array, " r"],
    ) -> DraftOutput:
        """Absorb each row's new context features (positions start .. start + count - 1; rows past `count` are
        padding), then draft a block after the anchor, the token at position start + count: draft k takes
        position start + count + 1 + k. Pure and jittable; `embed` / `head` are the target's weights."""
        state = self.absorb(features, start, count, state)
        anchor_pos = (start + count).astype(jnp.int32)
        contexts = [(ring["ring_kv"], (ring["ring_pos"] >= 0) & (ring["ring_pos"] < anchor_pos[:, None])
                     & (ring["ring_pos"] >= anchor_pos[:, None] - self.config.window)) for ring in state]
        h = self.block_hidden(embed, anchor, anchor_pos, contexts)
        tokens, probs, conf_logits = self.sample_block(lm_head(head, self.norm(h)), h, anchor, anchor_pos, seeds,
                                                       temperature)
        confidences = jax.nn.sigmoid(conf_logits / jnp.asarray(self.config.temperatures))
        return DraftOutput(tokens, probs, confidences, state)

    def serve(
        self, embed: Float[Array, "V d"], head: Float[Array, "V d"], features: Float[Array, "r c F"],
        tokens: Int[Array, "r c"], start: Int[Array, " r"], count: Int[Array, " r"], state: list,
        anchor: Int[Array, " r"], seeds: UInt32[Array, "r 2"], temperature: Float[Array, " r"],
        drafting: Bool[Array, ""],
    ) -> DraftOutput:
        """The serving engine's drafter call: `draft` when `drafting`, else only `absorb` (the no-draft
        fallback: zero drafts, the context advanced). The rows' input `tokens` are part of the drafter protocol
        (the MTP drafter pairs positions with them); DSpark's context is the features alone."""
        del tokens

        def skip():
            r, g, vocab = start.shape[0], self.config.block_size, head.shape[0]
            return DraftOutput(jnp.zeros((r, g), jnp.int32), jnp.zeros((r, g, vocab), jnp.float32),
                               jnp.zeros((r, g), jnp.float32), self.absorb(features, start, count, state))

        return jax.lax.cond(drafting, lambda: self.draft(embed, head, features, start, count, state, anchor, seeds,
                                                         temperature), skip)

    def sample_block(
        self, base_logits: Float[Array, "n g V"], h: Float[Array, "n g d"], anchor: Int[Array, " n"],
        anchor_pos: Int[Array, " n"], seeds: UInt32[Array, "n 2"], temperature: Float[Array, " n"],
    ) -> tuple[Int[Array, "n g"], Float[Array, "n g V"], Float[Array, "n g"]]:
        """The sequential stage: left to right, logits + Markov bias of the previous token, drawn by
        `draw_draft`; returns (tokens, their distributions, raw confidence logits)."""
        g = base_logits.shape[1]
        noise = draft_noise(seeds, anchor_pos[:, None] + 1 + jnp.arange(g), temperature, base_logits.shape[-1])
        previous, tokens, probs, conf = anchor, [], [], []
        for k in range(g):
            bias, e = self.markov_head(previous)
            conf.append(self.confidence_head(h[:, k], e))
            previous, p = draw_draft(base_logits[:, k] + bias, seeds, anchor_pos + 1 + k, temperature, noise[:, k])
            tokens.append(previous)
            probs.append(p)
        return jnp.stack(tokens, 1), jnp.stack(probs, 1), jnp.stack(conf, 1)

    # ---- the backbone (serving and training) ---------------------------------------------------------------
    def context(self, features: Float[Array, "... F"]) -> Float[Array, "... d"]:
        """main_norm(main_proj(target features)): the context every draft layer's keys are projected from. A V4
        target's taps are its flattened streams; a V4.1 target's are already averaged over the hc copies."""
        if not self.single_pass:
            n, d = self.stage.hc_mult, self.stage.hidden_size
            streams = features.reshape(*features.shape[:-1], len(self.config.target_layer_ids), n, d)
            features = jnp.mean(streams.astype(jnp.float32), axis=-2).reshape(*features.shape[:-1], -1)
        return self.main_norm(self.main_proj(features))

    def block_hidden(
        self, embed: Float[Array, "V d"], anchor: Int[Array, " n"], anchor_pos: Int[Array, " n"], contexts: list
    ) -> Float[Array, "n g d"]:
        """Pre-norm hidden states of the block [anchor, noise ...] at positions anchor_pos.. given, per draft
        layer, its context (K = V latents [n, k, hd], visible [n, k])."""
        g, n_hc = self.config.block_size, self.stage.hc_mult
        tokens = jnp.concatenate([anchor[:, None], jnp.full((anchor.shape[0], g - 1), self.config.noise_token_id,
                                                            jnp.int32)], axis=1).astype(jnp.int32)
        x = embed[tokens]
        streams = jnp.broadcast_to(x[:, :, None], (*x.shape[:2], n_hc, x.shape[-1]))
        pre_mix = (jnp.broadcast_to(jax.nn.one_hot(0, n_hc, dtype=jnp.float32), (*x.shape[:2], n_hc))
                   if self.single_pass else None)
        for blk, (context, visible) in zip(self.layers, contexts):
            streams, pre_mix = blk(streams, pre_mix, tokens, anchor_pos, context, visible)
        return collapse(streams, pre_mix) if self.single_pass else self.hc_head(streams)

    def anchored_hidden(
        self, embed: Float[Array, "V d"], features: Float[Array, "b s F"], tokens: Int[Array, "b s"],
        anchors: Int[Array, "b a"],
    ) -> Float[Array, "n g d"]:
        """Pre-norm hidden states [b * a, gamma, d] of blocks anchored at positions `anchors` of whole
        sequences (positions 0..s-1), each seeing the features of the `window` positions before its anchor:
        what `draft` computes for that anchor from a ring holding those features."""
        b, s = tokens.shape
        a, w = anchors.shape[1], self.config.window
        main_x = self.context(features)
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        window = anchors[..., None] - w + jnp.arange(w)  # [b, a, w] context positions of each anchor
        visible = (window >= 0).reshape(b * a, w)
        contexts = []
        for blk in self.layers:
            kv = blk.attn.keys(main_x, positions)  # [b, s, hd]
            picked = jnp.take_along_axis(kv[:, None], jnp.clip(window, 0)[..., None], axis=2)
            contexts.append((picked.reshape(b * a, w, -1), visible))
        anchor_tokens = jnp.take_along_axis(tokens, anchors, 1).reshape(-1)
        return self.block_hidden(embed, anchor_tokens, anchors.reshape(-1).astype(jnp.int32), contexts)

    def teacher_forced(
        self, embed: Float[Array, "V d"], head: Float[Array, "V d"], features: Float[Array, "b s F"],
        tokens: Int[Array, "b s"], anchors: Int[Array, "b a"],
    ) -> tuple[Float[Array, "b a g V"], Float[Array, "b a g"]]:
        """The training forward: (draft logits with the Markov bias of the true previous token, raw confidence
        logits) of blocks at `anchors`. Block position k of anchor t predicts token t + k + 1, so anchors need
        t + gamma <= s - 1."""
        (b, s), (a, g) = tokens.shape, (anchors.shape[1], self.config.block_size)
        h = self.anchored_hidden(embed, features, tokens, anchors)
        previous = jnp.take_along_axis(tokens, jnp.clip(anchors[..., None] + jnp.arange(g), 0, s - 1).reshape(b, -1),
                                       1).reshape(b * a, g)
        bias, e = self.markov_head(previous)
        logits = lm_head(head, self.norm(h)) + bias
        return logits.reshape(b, a, g, -1), self.confidence_head(h, e).reshape(b, a, g)


class Drafter:
    """A DSpark drafter ready to run beside its target Model: the graph, a pure parameter pytree (`params`) and
    a jitted `draft` (the row states are donated)."""

    def __init__(self, module: nnx.Module):
        self.graphdef, self.params = nnx.split(module)
        self.config: DSparkConfig = module.config

    def module(self) -> nnx.Module:
        """The drafter module (`DSparkDrafter`, or `model.mtp_drafter.MTPDrafter` for a V4 MTP block)."""
        return nnx.merge(self.graphdef, self.params)

    def init_state(self, batch: int, ring: int | None = None) -> list[dict]:
        return self.module().init_state(batch, ring)

    @functools.cached_property
    def _draft(self):
        graphdef = self.graphdef

        def draft(params, embed, head, *args):
            return nnx.merge(graphdef, params).draft(embed, head, *args)

        return jax.jit(draft, donate_argnums=6)

    def draft(self, target, features, start, count, state, anchor, seeds, temperature) -> DraftOutput:
        """`DSparkDrafter.draft` with the embedding and head of `target` (a model.api.Model)."""
        module = target.module()
        return self._draft(self.params, module.embed.weight[...], module.head.weight[...], features,
                           jnp.asarray(start, jnp.int32), jnp.asarray(count, jnp.int32), state,
                           jnp.asarray(anchor, jnp.int32), jnp.asarray(seeds, jnp.uint32),
                           jnp.asarray(temperature, jnp.float32))


def init_drafter(target: V41Config | ModelConfig, config: DSparkConfig, seed: int = 0, dtype=jnp.float32) -> Drafter:
    """A randomly initialised drafter for a target config (std 0.02 matrices, unit norms, zero sinks)."""
    return Drafter(DSparkDrafter(target, config, nnx.Rngs(seed), dtype))
