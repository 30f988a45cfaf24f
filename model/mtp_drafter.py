"""A DeepSeek-V4 checkpoint's first MTP block as a plain one-token drafter, behind the DSpark drafter's
serving interface (`model.dspark.DraftOutput`).

The MTP block predicts the token two places after a position from the target's final streams there and the
embedding of the token after it. Its own window ring (the block's attention state) is addressed by position
like the target's, so a rejected draft rolls back by restarting at an earlier position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt32

from model.dspark import DraftOutput, draw_draft
from model.transformer import DeepseekV4


def init_mtp_state(module: DeepseekV4, batch: int, max_len: int, ring: int | None = None) -> dict:
    """The MTP block's empty attention state for `batch` rows (default ring: window + 2 slots, so a rejected
    draft and its bonus position roll back)."""
    if not module.mtp:
        raise ValueError("this checkpoint has no MTP block (num_nextn_predict_layers = 0)")
    return module.mtp[0].attn.init_state(batch, max_len, ring or module.config.sliding_window + 2)


def mtp_draft(
    module: DeepseekV4, streams: Float[Array, "r c n d"], next_tokens: Int[Array, "r c"], start: Int[Array, " r"],
    count: Int[Array, " r"], state: dict, seeds: UInt32[Array, "r 2"], temperature: Float[Array, " r"],
) -> DraftOutput:
    """Draft one token per row. `streams` holds the target's final streams at positions start .. start + count - 1
    (rows past `count` are padding) and `next_tokens` the token after each, so the last real one is the anchor
    at start + count; the draft takes position start + count + 1. Sampling as `model.dspark.draw_draft`.

    The MTP block has no confidence head: the reported confidence is the draft token's probability at
    temperature 1, a heuristic rather than a calibrated survival probability."""
    blk = module.mtp[0]
    x = blk.mix_inputs(streams, module.embed(next_tokens))
    out, state = blk(x, next_tokens, start, state, count)
    last = jnp.take_along_axis(out, (count - 1)[:, None, None, None], axis=1)
    logits = module.head_logits(last, blk.hc_head, blk.norm)[:, 0]
    token, probs = draw_draft(logits, seeds, start + count + 1, temperature)
    confidence = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), token[:, None], axis=1)
    return DraftOutput(token[:, None], probs[:, None], jnp.clip(confidence, 1e-6, 1 - 1e-6), state)
