"""The engine's compiled step: `(params, cache, batch) -> (outputs, cache)` for one static (rows, tokens) bucket.

Each row is one request's chunk: a prefill chunk, one decode token, or (later) a verify block. The model runs
all rows as one batch, each at its own position: the weight-heavy parts (projections, MoE, mHC) as batched
matmuls, the attention against each row's own state as vmapped one-row calls, so a row's numbers depend only
on its own inputs and the bucket shape. The first token of a decode row comes from the previous step's sampled token on the
device (`from_prev`), so the host can dispatch step N+1 before it has read step N.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from serving.kv_cache import CacheLayout, gather_rows, scatter_rows
from serving.sampling import SamplingBatch, sample


class StepBatch(NamedTuple):
    """Host-built inputs of one step (numpy, shapes fixed by the bucket)."""

    tokens: Int[Array, "r t"]
    slots: Int[Array, " r"]
    starts: Int[Array, " r"]
    counts: Int[Array, " r"]  # real tokens in the row (0: padding row)
    from_prev: Bool[Array, " r"]  # token 0 is the slot's last sampled token (on the device)
    reset: Bool[Array, " r"]  # the slot starts a new request: clear its state first
    sample: Bool[Array, "r v"]  # the row emits a token after each of its last v real positions (v: verify length)
    kinds: Int[Array, "r t"]  # PROMPT, RECOMPUTED (a generated token replayed after preemption), COUNTED or DRAFT
    block_tables: Int[Array, "r p"]
    sampling: SamplingBatch
    engram_rows: tuple  # V4.1: per Engram layer, looked-up table rows [r, t, n_lookups, head_dim]


# What a token of a row is, for the penalty statistics: prompt tokens join the prompt mask, replayed
# generated tokens count again as outputs, and a decode row's input was counted when it was sampled. A DRAFT
# token (speculative, under verification) counts as an output only for the verify positions after it.
PROMPT, RECOMPUTED, COUNTED, DRAFT = 0, 1, 2, 3


class StepOutput(NamedTuple):
    tokens: Int[Array, "r v"]
    logprob: Float[Array, "r v"]
    top_ids: Int[Array, "r v n"]
    top_logprobs: Float[Array, "r v n"]
    logits: Float[Array, "r v vocab"]  # the sampled positions' logits ([r, v, 0] unless the engine asks for them)


def empty_batch(layout: CacheLayout, rows: int, tokens: int, verify: int = 1, engram_shapes=()) -> StepBatch:
    """An all-padding batch of the bucket (rows, tokens, verify) (used to compile ahead of time and to fill
    unused rows); `engram_shapes` gives (n_lookups, head_dim) per Engram layer."""
    z = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)  # noqa: E731
    return StepBatch(
        tokens=z(rows, tokens), slots=np.full(rows, layout.scratch_slot, np.int32), starts=z(rows),
        counts=z(rows), from_prev=z(rows, dtype=bool), reset=z(rows, dtype=bool),
        sample=z(rows, verify, dtype=bool),
        kinds=z(rows, tokens), block_tables=np.full((rows, layout.pages_per_slot),
                                                                     layout.scratch_page, np.int32),
        sampling=SamplingBatch.from_params([], rows),
        engram_rows=tuple(np.zeros((rows, tokens, *shape), np.float32) for shape in engram_shapes))


def build_step(graphdef, param_tree, empty_layers: dict, page_tokens: int, num_top: int, return_logits: bool):
    """The pure step function (jit it with the cache donated). It takes the parameters as the flat list of
    leaves of the tree structure `param_tree` (flattening the nnx state on every call costs host time);
    `empty_layers` is a fresh one-row state, `page_tokens` the cache layout's page size."""

    def step(weights: list, cache: dict, batch: StepBatch) -> tuple[StepOutput, dict]:
        module = nnx.merge(graphdef, jax.tree.unflatten(param_tree, weights))
        slots, counts = batch.slots, batch.counts
        rows, width = batch.tokens.shape
        cache = {**cache, "block_tables": cache["block_tables"].at[slots].set(batch.block_tables)}
        # materialised before use, so the slot buffers are no longer read when they are updated in place
        states = jax.lax.optimization_barrier(gather_rows(cache, slots, empty_layers, batch.reset))
        first = jnp.where(batch.from_prev, cache["last_token"][slots], batch.tokens[:, 0])
        tokens = batch.tokens.at[:, 0].set(first)

        extra = {"engram_rows": batch.engram_rows} if batch.engram_rows else {}
        logits, new = module(tokens, {"pos": batch.starts, "layers": states}, count=counts, **extra)
        pages = min(batch.block_tables.shape[1], (width - 1) // page_tokens + 2)  # a chunk spans at most these
        cache = scatter_rows(cache, slots, new["layers"], batch.starts // page_tokens, pages)
        verify, vocab = batch.sample.shape[1], logits.shape[-1]
        at = jnp.clip(counts[:, None] - verify + jnp.arange(verify), 0, width - 1)  # the sampled positions [r, v]
        picked = jnp.take_along_axis(logits, at[:, :, None], axis=1)  # [r, v, vocab]

        scratch = cache["last_token"].shape[0] - 1
        real = jnp.arange(width)[None, :] < counts[:, None]
        fresh = jnp.where(batch.reset, slots, scratch)
        prompt_mask = cache["prompt_mask"].at[fresh].set(False)
        output_counts = cache["output_counts"].at[fresh].set(0)
        as_prompt = jnp.where(real & (batch.kinds == PROMPT), slots[:, None], scratch)
        prompt_mask = prompt_mask.at[as_prompt, tokens].set(True)
        output_counts = output_counts.at[slots[:, None], tokens].add(
            (real & (batch.kinds == RECOMPUTED)).astype(jnp.int32))
        counts_at = jnp.broadcast_to(output_counts[slots][:, None], (rows, verify, vocab))
        if verify > 1:  # drafts up to each verify position count as its outputs
            drafted = (jnp.arange(width) <= at[:, :, None]) & (real & (batch.kinds == DRAFT))[:, None, :]
            counts_at = counts_at.at[jnp.arange(rows)[:, None, None], jnp.arange(verify)[None, :, None],
                                     tokens[:, None, :]].add(drafted.astype(jnp.int32))

        flat = lambda x: x.reshape(rows * verify, *x.shape[2:])  # noqa: E731
        per_position = jax.tree.map(lambda x: jnp.repeat(x, verify, axis=0), batch.sampling)
        out = sample(flat(picked), per_position, flat(batch.starts[:, None] + at + 1),
                     jnp.repeat(prompt_mask[slots], verify, axis=0), flat(counts_at), num_top)
        out = jax.tree.map(lambda x: x.reshape(rows, verify, *x.shape[1:]), out)
        # a decode or prefill row (v = 1) commits its token; a verify row commits nothing: acceptance decides
        emit = jnp.where(batch.sample[:, -1] & (verify == 1), slots, scratch)
        cache = {**cache, "prompt_mask": prompt_mask,
                 "output_counts": output_counts.at[emit, out.tokens[:, -1]].add(1),
                 "last_token": cache["last_token"].at[emit].set(out.tokens[:, -1])}
        kept_logits = picked if return_logits else jnp.zeros((rows, verify, 0), picked.dtype)
        return StepOutput(out.tokens, out.logprob, out.top_ids, out.top_logprobs, kept_logits), cache

    return step


def compile_step(step_fn, weights: list, cache: dict, batch: StepBatch):
    """Ahead-of-time compile for one bucket (the cache is donated); calling it never recompiles."""
    spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)  # noqa: E731
    return jax.jit(step_fn, donate_argnums=1).lower(
        jax.tree.map(spec, weights), jax.tree.map(spec, cache), jax.tree.map(spec, batch)).compile()
