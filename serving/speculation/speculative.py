"""Lossless verification of speculative drafts: greedy matching and rejection sampling with a residual.

A verify row holds the last committed token and up to v-1 draft tokens; the target's processed logits at its
v positions give p_0 .. p_{v-1}, where p_j is the target's distribution of the token after row position j.
Draft j+1 (sampled by the drafter from q_j) is accepted with probability min(1, p_j(d) / q_j(d)); at the first
rejection the emitted token is drawn from the residual max(0, p_j - q_j) (normalised) and the rest of the row
is discarded; when every draft survives, a bonus token is drawn from p at the position after the last draft.
Each emitted token is then distributed exactly as the target's own sample. Greedy rows accept while the draft
equals the target's argmax and emit the argmax where they stop. `admit` splits a verification budget over rows
by prefix survival (DSpark's scheduler, on the device).

Randomness is a pure function of (request seed, position, purpose): the accept test's uniform uses
PURPOSE_ACCEPT, the residual draw PURPOSE_RESIDUAL, and the bonus token PURPOSE_SAMPLE, the purpose of plain
decoding, so a bonus token is the very token non-speculative decoding would have sampled there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt32

from model.sampling_keys import PURPOSE_ACCEPT, PURPOSE_RESIDUAL, PURPOSE_SAMPLE, first_argmax, request_key


class Verdict(NamedTuple):
    """Per row: accepted drafts, the emitted tokens (accepted drafts, then the final token; -1 past them),
    and each draft's acceptance probability given its prefix survived, for calibration metrics: sum_v min(p, q)
    when sampling, 1 or 0 (draft == the target's argmax) for greedy rows."""

    accepted: Int[Array, " r"]
    tokens: Int[Array, "r v"]
    accept_prob: Float[Array, "r g"]


def _verify_row(logits, drafts, draft_probs, num_drafts, greedy, seed, positions, sampling: bool):
    """One row; `sampling` (static) is False when every row of the batch is greedy: then no noise is drawn."""
    v = logits.shape[0]
    j = jnp.arange(v - 1)
    is_argmax = drafts == first_argmax(logits[:-1])
    if not sampling:
        accepted = jnp.sum(jnp.cumprod((is_argmax & (j < num_drafts)).astype(jnp.int32)))
        final = first_argmax(logits[accepted])
        accept_prob = is_argmax.astype(jnp.float32)
    else:
        target = jax.nn.softmax(logits, axis=-1)  # [v, V]
        q = jnp.take_along_axis(draft_probs, drafts[:, None], axis=1)[:, 0]
        p = jnp.take_along_axis(target[:-1], drafts[:, None], axis=1)[:, 0]
        uniform = jax.vmap(lambda pos: jax.random.uniform(request_key(seed, pos, PURPOSE_ACCEPT)))(positions[:-1])
        ok = jnp.where(greedy, is_argmax, uniform * q < p) & (j < num_drafts)
        accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
        rejected = accepted < num_drafts
        residual = jnp.maximum(target[accepted] - jnp.where(rejected, draft_probs[jnp.minimum(accepted, v - 2)], 0), 0)
        residual = jnp.where(jnp.sum(residual) > 0, residual, target[accepted])
        # one Gumbel-max draw: from the residual (keyed PURPOSE_RESIDUAL) or, for the bonus token, from the
        # target exactly as the plain sampler draws (`serving.base.sampling.draw_tokens`, keyed PURPOSE_SAMPLE)
        key = jnp.where(rejected, *(jax.random.key_data(request_key(seed, positions[accepted], purpose))
                                    for purpose in (PURPOSE_RESIDUAL, PURPOSE_SAMPLE)))
        gumbel = jax.random.gumbel(jax.random.wrap_key_data(key, impl="threefry2x32"), logits.shape[1:])
        sampled = first_argmax(jnp.where(rejected, jnp.log(residual), logits[accepted]) + gumbel)
        final = jnp.where(greedy, first_argmax(logits[accepted]), sampled)
        overlap = jnp.sum(jnp.minimum(target[:-1], draft_probs), axis=-1)
        accept_prob = jnp.where(greedy, is_argmax.astype(jnp.float32), overlap)
    slots = jnp.arange(v)
    tokens = jnp.where(slots < accepted, jnp.pad(drafts, (0, 1)), jnp.where(slots == accepted, final, -1))
    return accepted, tokens, accept_prob


def verify(
    logits: Float[Array, "r v V"], drafts: Int[Array, "r g"], draft_probs: Float[Array, "r g V"],
    num_drafts: Int[Array, " r"], greedy: Bool[Array, " r"], seeds: UInt32[Array, "r 2"],
    positions: Int[Array, "r v"],
) -> Verdict:
    """Verify each row's first `num_drafts` drafts (g = v - 1 >= 1 slots) against the target's processed logits
    at its v positions; `positions[:, j]` is the sequence position of the token emitted after row position j.
    A batch of greedy rows draws no randomness (a batch-level `cond` that changes no row's result)."""

    def rows(sampling: bool):
        one = functools.partial(_verify_row, sampling=sampling)
        return lambda: Verdict(*jax.vmap(one)(logits, drafts, draft_probs, num_drafts, greedy, seeds, positions))

    return jax.lax.cond(jnp.all(greedy), rows(False), rows(True))


def admit(survival: Float[Array | np.ndarray, "r g"], caps: Int[Array | np.ndarray, " r"],
          budget: Int[Array | np.ndarray, ""] | int | np.integer) -> Int[Array, " r"]:
    """Drafts to verify per row: the `budget` (row, position) pairs of highest prefix survival among each row's
    first `caps` positions. Survival never rises along a row and ties go to the earlier position, so every row
    gets a prefix of its block."""
    r, g = survival.shape
    valid = jnp.arange(g)[None, :] < caps[:, None]
    order = jnp.argsort(-jnp.where(valid, survival, -1.0).reshape(-1), stable=True)
    rank = jnp.zeros(r * g, jnp.int32).at[order].set(jnp.arange(r * g, dtype=jnp.int32)).reshape(r, g)
    return jnp.sum(valid & (rank < budget), axis=1).astype(jnp.int32)
