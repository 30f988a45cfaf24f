"""The engine's compiled step: `(weights, cache, batch) -> (outputs, cache)` for one static (rows, tokens, verify)
bucket.

Each row (a prefill chunk, a decode token or a verify block) runs in one batch at its own position. `StepHalves`
compiles decode and verify buckets as a forward and a decide half, so the host fills token masks while the
device runs the forward. See docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from model.replay import Replay
from serving.structured.grammar_mask import ALL_ALLOWED, apply_token_bitmask, bitmask_width
from serving.base.kv_cache import CacheLayout, EngineCache, gather_slots, layer_rows, put_rows
from model.sampling_keys import GREEDY_BELOW
from serving.base.sampling import SampleOutput, SamplingBatch, draw_tokens, processed_logits, token_logprobs
from serving.speculation.speculative import admit, verify


class StepBatch(NamedTuple):
    """Host-built inputs of one step (numpy, shapes fixed by the bucket)."""

    tokens: Int[Array, "r t"]
    slots: Int[Array, " r"]
    starts: Int[Array, " r"]
    counts: Int[Array, " r"]  # real tokens in the row (0: padding row)
    from_prev: Bool[Array, " r"]  # a decode / verify row: tokens and start come from the slot on the device
    reset: Bool[Array, " r"]  # the slot starts a new request: clear its state first
    sample: Bool[Array, " r"]  # the row emits tokens (decode, verify, or a prompt's last chunk)
    kinds: Int[Array, "r t"]  # PROMPT, RECOMPUTED (a generated token replayed after preemption), COUNTED or DRAFT
    block_tables: Int[Array, "r p"]  # each row's first p pages: p is the step's context bucket
    sampling: SamplingBatch
    engram_rows: tuple  # V4.1: per Engram layer, looked-up table rows [r, t, n_lookups, head_dim]
    caps: Int[Array, " r"]  # verify rows: the most drafts the row may verify
    budget: Int[Array, ""]  # verify buckets: drafts verified over all rows, split by prefix survival
    bitmask: Int[Array, "r v words"]  # per verify position the allowed tokens, packed (-1: all; constraints)
    draft: Bool[Array, ""]  # a drafter step drafts the next blocks (False: its drafter only absorbs features)
    frozen: Int[Array, " r"]  # tokens at the row's sequence start held in shared pages: never written (prefix cache)
    prompt_end: Int[Array, " r"]  # bounded replay: where a prefill row's prompt ends (0: none, `model.replay`)
    targets: Int[Array, "r t"]  # prompt logprobs: the token after each position (the next prompt token)
    scored: Bool[Array, " r"]  # the row asks for the logprobs of `targets` (a prefill row of an echo request)


# What a token of a row is, for the penalty statistics: prompt tokens join the prompt mask, replayed
# generated tokens count again as outputs, and a decode row's input was counted when it was sampled. A DRAFT
# token (speculative, under verification) counts as an output only for the verify positions after it.
PROMPT, RECOMPUTED, COUNTED, DRAFT = 0, 1, 2, 3


class StepOutput(NamedTuple):
    """Per row and verify position j: the emitted token (-1 past the row's last), its logprob and the top
    alternatives (zeros in a step in which no row asks for logprobs); per row the drafts accepted and verified; per verified draft its acceptance probability given
    its prefix survived and the confidence it was scheduled with; the slot's next block of drafts and their
    confidences (drafter steps only: [r, 0] otherwise), and whether this step drafted them (a step that did not
    leaves the slots' previous, now stale, drafts in place)."""

    tokens: Int[Array, "r v"]
    logprob: Float[Array, "r v"]
    top_ids: Int[Array, "r v n"]
    top_logprobs: Float[Array, "r v n"]
    logits: Float[Array, "r v vocab"]  # the verify positions' logits ([r, v, 0] unless the engine asks for them)
    accepted: Int[Array, " r"]
    verified: Int[Array, " r"]
    accept_prob: Float[Array, "r g"]
    confidence: Float[Array, "r g"]
    next_drafts: Int[Array, "r k"]
    next_confidence: Float[Array, "r k"]
    prompt_logprob: Float[Array, "r t"]  # scored rows: each position's logprob of its target (zeros otherwise)
    prompt_top_ids: Int[Array, "r t n"]
    prompt_top_logprobs: Float[Array, "r t n"]
    drafted: Bool[Array, ""]  # last: a per-step scalar (`serving.core.engine_dp` shards every field before it)


def empty_batch(layout: CacheLayout, rows: int, tokens: int, engram_shapes=(), verify_len: int = 1,
                pages: int | None = None) -> StepBatch:
    """An all-padding batch of `rows` rows of `tokens` tokens (used to compile ahead of time and to fill unused
    rows); `engram_shapes` gives (n_lookups, head_dim) per Engram layer; `verify_len` the bucket's verify
    positions (the bitmask's second axis; every token allowed); `pages` the bucket's context pages, the width
    of its block tables (default: the whole table, `layout.pages_per_slot`)."""
    z = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)  # noqa: E731
    return StepBatch(
        tokens=z(rows, tokens), slots=np.full(rows, layout.scratch_slot, np.int32), starts=z(rows),
        counts=z(rows), from_prev=z(rows, dtype=bool), reset=z(rows, dtype=bool), sample=z(rows, dtype=bool),
        kinds=z(rows, tokens), block_tables=np.full((rows, pages or layout.pages_per_slot), layout.scratch_page,
                                                     np.int32),
        sampling=SamplingBatch.from_params([], rows),
        engram_rows=tuple(np.zeros((rows, tokens, *shape), np.float32) for shape in engram_shapes),
        caps=z(rows), budget=np.zeros((), np.int32), draft=np.ones((), bool),
        bitmask=np.full((rows, verify_len, bitmask_width(layout.vocab_size)), ALL_ALLOWED, np.int32),
        frozen=z(rows), prompt_end=z(rows), targets=z(rows, tokens), scored=z(rows, dtype=bool))


class DrafterSpec(NamedTuple):
    """What the step needs of a DSpark drafter: its graph, parameter tree structure, one-row empty context state
    and the target layers whose features it reads."""

    graphdef: object
    param_tree: object
    empty_state: list
    target_layers: tuple[int, ...]


class RowInputs(NamedTuple):
    """What each row runs in a step, resolved on the device: its tokens (a decode / verify row's from its slot),
    their kinds, its start position and real-token count, the drafts it verifies, its verify positions, and the
    batch's prompt-logprob targets and scored rows."""

    tokens: Int[Array, "r t"]
    kinds: Int[Array, "r t"]
    starts: Int[Array, " r"]
    counts: Int[Array, " r"]
    drafted: Int[Array, " r"]
    at: Int[Array, "r v"]
    targets: Int[Array, "r t"]
    scored: Bool[Array, " r"]


class Forwarded(NamedTuple):
    """What the forward half of a step hands the decide half (device arrays): the verify positions' logits, the
    drafter's target features, what the rows ran (`RowInputs`) and the scored rows' prompt logprobs."""

    picked: Float[Array, "r v vocab"]
    features: Float[Array, "r t f"]  # the drafter's target-layer features ([r, t, 0] without a drafter)
    rows: RowInputs
    prompt: SampleOutput  # [r, t]: each position's target, its logprob and the top alternatives


class DecideBatch(NamedTuple):
    """The host-built inputs the decide half reads (a subset of `StepBatch`, so its dispatch moves little)."""

    slots: Int[Array, " r"]
    starts: Int[Array, " r"]
    reset: Bool[Array, " r"]
    sample: Bool[Array, " r"]
    sampling: SamplingBatch
    bitmask: Int[Array, "r v words"]
    draft: Bool[Array, ""]


def decide_batch(batch: StepBatch) -> DecideBatch:
    """The fields of `batch` the decide half reads."""
    return DecideBatch(batch.slots, batch.starts, batch.reset, batch.sample, batch.sampling, batch.bitmask,
                       batch.draft)


def decide_weights(weights: tuple, head_leaves: tuple[int, ...]) -> tuple:
    """What the decide half takes of a step's `weights` (target leaves, drafter leaves): (the target leaves at
    `head_leaves`, the drafter's leaves)."""
    return [weights[0][i] for i in head_leaves], weights[1]


def row_inputs(cache: EngineCache, batch: StepBatch, verify_len: int) -> RowInputs:
    """The rows' `RowInputs` from the batch and, for decode and verify rows, their slots' last token, position
    and drafts."""
    slots, device = batch.slots, batch.from_prev
    rows, width = batch.tokens.shape
    starts = jnp.where(device, cache.next_pos[slots], batch.starts)
    if verify_len > 1:  # a verify row: [last token, its admitted drafts]
        drafted = admit(jnp.cumprod(cache.confidence[slots], axis=1), jnp.where(device, batch.caps, 0),
                        batch.budget)
        block = jnp.concatenate([cache.last_token[slots][:, None], cache.drafts[slots]], 1)[:, :width]
        tokens = jnp.where(device[:, None], block, batch.tokens)
        counts = jnp.where(device, drafted + 1, batch.counts)
        kinds = jnp.where(device[:, None], jnp.where(jnp.arange(width) == 0, COUNTED, DRAFT), batch.kinds)
    else:
        drafted = jnp.zeros(rows, jnp.int32)
        tokens = batch.tokens.at[:, 0].set(jnp.where(device, cache.last_token[slots], batch.tokens[:, 0]))
        counts, kinds = batch.counts, batch.kinds
    # the verify positions: the last drafted + 1 real ones (a prefill or decode row: its last); the model
    # projects only them onto the vocabulary
    at = jnp.clip(counts[:, None] - 1 - drafted[:, None] + jnp.arange(verify_len), 0, width - 1)  # [r, v]
    return RowInputs(tokens, kinds, starts, counts, drafted, at, batch.targets, batch.scored)


def prompt_logprobs(logits: Callable[[], Float[Array, "r t vocab"]], rows: RowInputs, num_top: int) -> SampleOutput:
    """Each position's logprob of its target and the `num_top` most likely alternatives (raw model logits, as
    for sampled tokens), for a server's prompt logprobs (`echo`). `logits()` gives every position's logits: it
    runs only in a step with a scored row, so other steps never project their whole chunk onto the vocabulary."""
    r, t = rows.targets.shape

    def score():
        out = token_logprobs(logits().reshape(r * t, -1), rows.targets.reshape(-1), num_top, jnp.asarray(True))
        return jax.tree.map(lambda x: x.reshape(r, t, *x.shape[1:]), out)

    def skip():
        return SampleOutput(rows.targets, jnp.zeros((r, t)), jnp.zeros((r, t, num_top), jnp.int32),
                            jnp.zeros((r, t, num_top)))

    return jax.lax.cond(jnp.any(rows.scored), score, skip)


def replay_prompt_end(replay: Replay, prompt_end: Int[Array, " r"], rows: RowInputs) -> Int[Array, " r"]:
    """Where bounded replay takes each row's prompt to end: a row without a prompt end (0) is unbounded, unless it
    outgrows compact's keep rows (then its chunk's end)."""
    unbounded = (prompt_end == 0) & (rows.counts <= replay.keep)
    return jnp.where(unbounded, 0, jnp.maximum(prompt_end, rows.starts + rows.counts))


def forwarded(picked: Float[Array, "r v vocab"], features: Float[Array, "r t f"] | None, rows: RowInputs,
              prompt: SampleOutput) -> Forwarded:
    """The forward half's hand-over: the verify positions' logits, the drafter's features (None: no drafter),
    the rows' inputs and their prompt logprobs (`prompt_logprobs`)."""
    if features is None:
        features = jnp.zeros((*rows.tokens.shape, 0), picked.dtype)
    return Forwarded(picked, features, rows, prompt)


class StepHalves(NamedTuple):
    """A step in two pure halves, so that a constrained batch's token masks can be filled on the host while the
    device runs the forward: `forward(target_leaves, cache, batch, verify_len) -> (Forwarded, cache)` and
    `decide(decide_weights, decided_cache, decide_batch, forwarded, verify_len) -> (StepOutput, decided_cache)`,
    where `decided_cache` is the cache without its layers and `decide_weights` is (the target leaves at
    `head_leaves`, the drafter's leaves). `step` is the two in one."""

    forward: Callable
    decide: Callable
    head_leaves: tuple[int, ...]  # the target's embedding and head leaves, which a drafter reads ((): none)
    step: Callable
    num_top: int  # top alternatives per logprob (sampled tokens and prompt logprobs)


def build_step_halves(graphdef, param_tree, empty_layers: list, num_top: int,
                      return_logits: bool, drafter: DrafterSpec | None = None, replay: Replay | None = None
                      ) -> StepHalves:
    """The pure step `step(weights, cache, batch, verify)` (jit it with the cache donated and `verify` static) and
    its two halves (`StepHalves`). `weights` is (the target's flat parameter leaves of tree structure `param_tree`,
    the drafter's leaves or []): flattening nnx state on every call costs host time. `empty_layers` is a fresh
    one-row state (its per-slot leaves start a reset row). `verify` is the bucket's verify length: 1 for prefill
    and decode buckets (each emitting row samples after its last real position), the row width for verify buckets (a
    DSpark drafter is required). An active `replay` (V4.1) bounds each prefill row's replay layers to the last
    `replay.keep` tokens before its `prompt_end`."""
    state = jax.tree.unflatten(param_tree, list(range(param_tree.num_leaves)))  # leaf indices, by parameter
    head_leaves = () if drafter is None else (state["embed"]["weight"].get_value(),
                                              state["head"]["weight"].get_value())

    def forward(target_leaves: list, cache: EngineCache, batch: StepBatch, verify_len: int) -> tuple[Forwarded, EngineCache]:
        module = nnx.merge(graphdef, jax.tree.unflatten(param_tree, target_leaves))
        states = layer_rows(cache.layers, batch.slots, batch.block_tables, batch.frozen, empty_layers, batch.reset)
        rows = row_inputs(cache, batch, verify_len)
        extra = {"engram_rows": batch.engram_rows} if batch.engram_rows else {}
        if drafter is not None:
            extra["collect"] = drafter.target_layers
        if replay is not None:
            extra |= {"replay": replay, "prompt_end": replay_prompt_end(replay, batch.prompt_end, rows)}
        picked, new, *taps, final = module(rows.tokens, {"pos": rows.starts, "layers": states}, count=rows.counts,
                                           at=rows.at, final=True, **extra)
        cache = cache.replace(layers=put_rows(cache.layers, batch.slots, new["layers"]))
        prompt = prompt_logprobs(lambda: module.final_logits(final), rows, num_top)
        return forwarded(picked, taps[0] if drafter is not None else None, rows, prompt), cache

    def decide(weights: tuple, cache: EngineCache, batch: DecideBatch, fwd: Forwarded, verify_len: int
               ) -> tuple[StepOutput, EngineCache]:
        head, drafter_leaves = weights
        rows_in = fwd.rows
        slots, tokens, starts, drafted, at = batch.slots, rows_in.tokens, rows_in.starts, rows_in.drafted, rows_in.at
        rows = tokens.shape[0]
        scratch = cache.last_token.shape[0] - 1
        constrained = jnp.any(batch.bitmask != ALL_ALLOWED)  # an unconstrained batch skips the masking
        picked = jax.lax.cond(constrained, apply_token_bitmask, lambda x, _: x, fwd.picked, batch.bitmask)
        cache, processed = _processed(cache, batch, slots, tokens, rows_in.kinds, rows_in.counts, at, picked)
        emitted, accepted, accept_prob = _decide(cache, batch, slots, starts, tokens, drafted, at, processed)

        # commit: the accepted drafts and the final token count as outputs; the final token is the slot's last
        emit = jnp.where(batch.sample, slots, scratch)
        final = jnp.take_along_axis(emitted, accepted[:, None], axis=1)[:, 0]
        committed = jnp.arange(verify_len)[None, :] <= accepted[:, None]
        output_counts = cache.output_counts.at[emit[:, None], jnp.maximum(emitted, 0)].add(
            committed.astype(jnp.int32))
        cache = cache.replace(output_counts=output_counts, last_token=cache.last_token.at[emit].set(final),
                              next_pos=cache.next_pos.at[emit].set(starts + at[:, 0] + accepted + 1))

        g = verify_len - 1
        confidence = cache.confidence[slots][:, :g] if drafter is not None else jnp.zeros((rows, 0))
        next_drafts, next_confidence = jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows, 0), jnp.float32)
        if drafter is not None:  # the committed positions' features, then the next block after the final token
            dmodule = nnx.merge(drafter.graphdef, jax.tree.unflatten(drafter.param_tree, drafter_leaves))
            dstate = jax.lax.optimization_barrier(gather_slots(cache.drafter, slots, drafter.empty_state,
                                                               batch.reset))
            absorbed = jnp.where(batch.sample, at[:, 0] + accepted + 1, rows_in.counts)
            out = dmodule.serve(head[0], head[1], fwd.features, tokens, starts, absorbed, dstate, final,
                                batch.sampling.seed, batch.sampling.temperature, batch.draft)
            drafted_to = jnp.where(batch.draft, emit, scratch)  # not drafting: the slots keep their old blocks
            cache = cache.replace(drafter=jax.tree.map(lambda leaf, row: leaf.at[slots].set(row), cache.drafter,
                                                       out.state),
                                  drafts=cache.drafts.at[drafted_to].set(out.tokens),
                                  draft_probs=cache.draft_probs.at[drafted_to].set(out.probs),
                                  confidence=cache.confidence.at[drafted_to].set(out.confidences))
            next_drafts, next_confidence = out.tokens, out.confidences

        flat = lambda x: x.reshape(rows * verify_len, *x.shape[2:])  # noqa: E731
        lp = token_logprobs(flat(picked), flat(jnp.maximum(emitted, 0)), num_top, jnp.any(batch.sampling.logprobs >= 0))
        lp = jax.tree.map(lambda x: x.reshape(rows, verify_len, *x.shape[1:]), lp)
        kept_logits = picked if return_logits else jnp.zeros((rows, verify_len, 0), picked.dtype)
        return StepOutput(emitted, lp.logprob, lp.top_ids, lp.top_logprobs, kept_logits, accepted, drafted,
                          accept_prob, confidence, next_drafts, next_confidence, fwd.prompt.logprob,
                          fwd.prompt.top_ids, fwd.prompt.top_logprobs,
                          jnp.asarray(batch.draft) & (drafter is not None)), cache

    def step(weights: tuple, cache: EngineCache, batch: StepBatch, verify_len: int) -> tuple[StepOutput, EngineCache]:
        fwd, cache = forward(weights[0], cache, batch, verify_len)
        decided, layer_state = split_cache(cache)
        out, decided = decide(decide_weights(weights, head_leaves), decided, decide_batch(batch), fwd, verify_len)
        return out, decided.replace(layers=layer_state)

    return StepHalves(forward, decide, head_leaves, step, num_top)


def _processed(cache, batch, slots, tokens, kinds, counts, at, picked):
    """Update the slots' prompt masks and replayed output counts; the processed logits of every verify
    position, whose output counts include the drafts before it."""
    rows, width = tokens.shape
    verify_len, vocab = picked.shape[1], picked.shape[2]
    scratch = cache.last_token.shape[0] - 1
    real = jnp.arange(width)[None, :] < counts[:, None]
    fresh = jnp.where(batch.reset & (batch.starts == 0), slots, scratch)  # a prefix hit: set by the engine
    prompt_mask = cache.prompt_mask.at[fresh].set(False)
    output_counts = cache.output_counts.at[fresh].set(0)
    as_prompt = jnp.where(real & (kinds == PROMPT), slots[:, None], scratch)
    prompt_mask = prompt_mask.at[as_prompt, tokens].set(True)
    output_counts = output_counts.at[slots[:, None], tokens].add((real & (kinds == RECOMPUTED)).astype(jnp.int32))
    counts_at = jnp.broadcast_to(output_counts[slots][:, None], (rows, verify_len, vocab))
    if verify_len > 1:  # drafts up to each verify position count as its outputs
        drafts = (jnp.arange(width) <= at[:, :, None]) & (real & (kinds == DRAFT))[:, None, :]
        counts_at = counts_at.at[jnp.arange(rows)[:, None, None], jnp.arange(verify_len)[None, :, None],
                                 tokens[:, None, :]].add(drafts.astype(jnp.int32))
    flat = lambda x: x.reshape(rows * verify_len, *x.shape[2:])  # noqa: E731
    per_position = jax.tree.map(lambda x: jnp.repeat(x, verify_len, axis=0), batch.sampling)
    processed = processed_logits(flat(picked), per_position, jnp.repeat(prompt_mask[slots], verify_len, axis=0),
                                 flat(counts_at))
    cache = cache.replace(prompt_mask=prompt_mask, output_counts=output_counts)
    return cache, processed.reshape(rows, verify_len, vocab)


def _decide(cache, batch, slots, starts, tokens, drafted, at, processed):
    """(emitted tokens [r, v], accepted drafts [r], acceptance probabilities [r, v - 1]): a verify bucket
    verifies its drafts, any other samples one token per row."""
    rows, verify_len = at.shape
    positions = starts[:, None] + at + 1  # of the token emitted after each verify position
    if verify_len == 1:
        token = draw_tokens(processed[:, 0], batch.sampling, positions[:, 0])
        return token[:, None], jnp.zeros(rows, jnp.int32), jnp.zeros((rows, 0), jnp.float32)
    greedy = batch.sampling.temperature < GREEDY_BELOW
    verdict = verify(processed, tokens[:, 1:verify_len], cache.draft_probs[slots][:, :verify_len - 1],
                     drafted, greedy, batch.sampling.seed, positions)
    return verdict.tokens, verdict.accepted, verdict.accept_prob


def split_cache(cache: EngineCache) -> tuple[EngineCache, list]:
    """(the entries the decide half updates, the layer states the forward half updates) of an engine cache."""
    return cache.replace(layers=None), cache.layers


def abstract_shapes(tree):
    """Shapes and dtypes of a pytree's leaves (no shardings: the step compiles for the default device)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def compile_step(step_fn, weights: tuple, cache: EngineCache, batch: StepBatch, verify_len: int):
    """Ahead-of-time compile for one bucket (the cache is donated); calling it never recompiles."""
    return jax.jit(step_fn, donate_argnums=1, static_argnums=3).lower(*abstract_shapes((weights, cache, batch)),
                                                                      verify_len).compile()


class CompiledHalves:
    """One bucket's step compiled as its two halves (`StepHalves`): `forward` launches the model, `decide` the
    masking, sampling / verification and drafting, which may follow later (the host fills the batch's token
    masks in between, while the device runs the forward); calling it runs both. Neither ever recompiles.
    `executables` are the two compiled halves (`compile_halves`)."""

    def __init__(self, executables: list, head_leaves: tuple[int, ...]):
        self._forward, self._decide = executables
        self.head_leaves = head_leaves

    @property
    def executables(self) -> list:
        return [self._forward, self._decide]

    def forward(self, weights: tuple, cache: EngineCache, batch: StepBatch) -> tuple[Forwarded, EngineCache]:
        return self._forward(weights[0], cache, batch)

    def decide(self, weights: tuple, cache: EngineCache, batch: StepBatch, fwd: Forwarded) -> tuple[StepOutput, EngineCache]:
        decided, layer_state = split_cache(cache)
        out, decided = self._decide(decide_weights(weights, self.head_leaves), decided, decide_batch(batch), fwd)
        return out, decided.replace(layers=layer_state)

    def __call__(self, weights: tuple, cache: EngineCache, batch: StepBatch) -> tuple[StepOutput, EngineCache]:
        fwd, cache = self.forward(weights, cache, batch)
        return self.decide(weights, cache, batch, fwd)


def compile_halves(halves: StepHalves, weights: tuple, cache: EngineCache, batch: StepBatch, verify_len: int
                   ) -> CompiledHalves:
    """Ahead-of-time compile one bucket's step as its two halves (each donating its cache)."""
    forward = jax.jit(halves.forward, donate_argnums=1, static_argnums=3).lower(
        *abstract_shapes((weights[0], cache, batch)), verify_len).compile()
    return CompiledHalves([forward, compile_decide(halves, weights, cache, batch, forward.out_info[0], verify_len)],
                          halves.head_leaves)


def decide_inputs(halves: StepHalves, weights: tuple, cache: EngineCache, batch: StepBatch, fwd) -> tuple:
    """What a bucket's decide half takes of a step's weights, cache and batch, with the forward half's `fwd`
    (`StepHalves.decide`'s arguments before `verify_len`)."""
    return decide_weights(weights, halves.head_leaves), split_cache(cache)[0], decide_batch(batch), fwd


def compile_decide(halves: StepHalves, weights: tuple, cache: EngineCache, batch: StepBatch, forwarded_info,
                   verify_len: int):
    """Ahead-of-time compile a bucket's decide half (donating its cache) for a forward half whose `Forwarded`
    has the shapes `forwarded_info`."""
    return jax.jit(halves.decide, donate_argnums=1, static_argnums=4).lower(
        *abstract_shapes(decide_inputs(halves, weights, cache, batch, forwarded_info)), verify_len).compile()
