"""A DeepSeek-V4 checkpoint's first MTP block as a plain one-token drafter for the serving engine, behind the
drafter protocol of the engine's step (`init_state`, `serve`, `config.block_size`, `config.target_layer_ids`;
see `model.dspark.DSparkDrafter`).

The block runs one position behind the target, carrying the target's last streams between steps, so a V4
checkpoint without a DSpark drafter can still speculate. See docs/speculative-decoding.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int, UInt32

from model.attention import ring_state
from model.dspark import DraftOutput, Drafter, draw_draft, lm_head
from model.transformer import DeepseekV4, MTPBlock


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """What the engine reads of a drafter's config: one draft per block, fed the target's last layer."""

    target_layer_ids: tuple[int, ...]
    block_size: int = 1


class MTPDrafter(nnx.Module):
    """The MTP block (the target's own parameters) with the per-row state it needs to draft while serving."""

    def __init__(self, block: MTPBlock, last_layer: int):
        self.block = block
        self.config = MTPConfig((last_layer,))

    def init_state(self, batch: int, ring: int | None = None) -> dict:
        """Empty per-row state: the block's window ring (default window + 2 slots), the target's streams at
        the last position the block has not consumed yet (`carry`, flattened) and that position (-1: none)."""
        cfg = self.block.attn.config
        return {"ring": ring_state(cfg, batch, ring or cfg.sliding_window + 2),
                "carry": jnp.zeros((batch, cfg.hc_mult * cfg.hidden_size), jnp.float32),
                "carry_pos": jnp.full((batch,), -1, jnp.int32)}

    def _advance(self, embed, features, tokens, start, count, state, anchor):
        """Run the block lagged by one over each row's new positions; returns (the block's output streams at
        the row's last fed position, the new state)."""
        blk, (r, c) = self.block, features.shape[:2]
        shift = (state["carry_pos"] != start - 1).astype(jnp.int32)  # no carried position (a fresh slot)
        streams = jnp.concatenate([state["carry"][:, None].astype(features.dtype), features], axis=1)
        i = jnp.arange(c + 1)
        nexts = jnp.where(i == count[:, None], anchor[:, None],
                          jnp.concatenate([tokens, jnp.zeros((r, 1), tokens.dtype)], axis=1))
        pick = jnp.minimum(i + shift[:, None], c)
        streams = jnp.take_along_axis(streams, pick[:, :, None], axis=1).reshape(
            r, c + 1, blk.hc_head.base.shape[0], -1)
        nexts = jnp.take_along_axis(nexts, pick, axis=1)
        fed = count + 1 - shift
        x = blk.mix_inputs(streams, embed[nexts])
        out, ring = blk(x, nexts, start - 1 + shift, state["ring"], fed)
        last = jnp.take_along_axis(out, jnp.maximum(fed - 1, 0)[:, None, None, None], axis=1)[:, 0]
        carry = jnp.take_along_axis(features, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
        return last, {"ring": ring, "carry": carry.astype(jnp.float32), "carry_pos": start + count - 1}

    def serve(
        self, embed: Float[Array, "V d"], head: Float[Array, "V d"], features: Float[Array, "r c F"],
        tokens: Int[Array, "r c"], start: Int[Array, " r"], count: Int[Array, " r"], state: dict,
        anchor: Int[Array, " r"], seeds: UInt32[Array, "r 2"], temperature: Float[Array, " r"],
        drafting: Bool[Array, ""],
    ) -> DraftOutput:
        """Feed each row's first `count` positions (start ..) and the anchor after them (the token at
        start + count), then, when `drafting`, draft the token at start + count + 1 (sampled as
        `model.dspark.draw_draft`; zeros otherwise).

        The MTP block has no confidence head: the reported confidence is the draft's probability at
        temperature 1, a heuristic rather than a calibrated survival probability."""
        last, state = self._advance(embed, features, tokens, start, count, state, anchor)

        def draft():
            logits = lm_head(head, self.block.norm(self.block.hc_head(last[:, None])))[:, 0]
            token, probs = draw_draft(logits, seeds, start + count + 1, temperature)
            confidence = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), token[:, None], axis=1)
            return token[:, None], probs[:, None], jnp.clip(confidence, 1e-6, 1 - 1e-6)

        def skip():
            r = start.shape[0]
            return (jnp.zeros((r, 1), jnp.int32), jnp.zeros((r, 1, head.shape[0]), jnp.float32),
                    jnp.zeros((r, 1), jnp.float32))

        return DraftOutput(*jax.lax.cond(drafting, draft, skip), state)


def mtp_drafter(module: DeepseekV4) -> Drafter | None:
    """The module's first MTP block as a serving drafter (None when the checkpoint has no MTP block)."""
    if not isinstance(module, DeepseekV4) or not module.mtp:
        return None
    return Drafter(MTPDrafter(module.mtp[0], module.config.num_hidden_layers - 1))
