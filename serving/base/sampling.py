"""Request sampling parameters and the batch-invariant sampler that runs inside the engine's compiled step.

Randomness is a pure function of (request seed, token position, purpose) (DESIGN.md contract 7), and every
row is computed by `jax.vmap` of a one-row function, so a request's token does not depend on the batch size,
its row index or the other requests in the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt32

from model.sampling_keys import GREEDY_BELOW, PURPOSE_SAMPLE, first_argmax, request_key

MAX_STOP = 16
MAX_LOGPROBS = 20
SEED_LIMIT = 2**63


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return int(value)


def _check_float(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    allowed = f"{'(' if low_open else '['}{low}, {high}]"
    ok = (_is_int(value) or isinstance(value, (float, np.floating))) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        raise ValueError(f"{name} must be a finite number in {allowed}, got {value!r}")
    return float(value)


@no_type_check  # it takes a request's raw fields and checks them itself, naming the field (`__post_init__`)
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples, with OpenAI / vLLM semantics; invalid values raise `ValueError` naming the field.

    `temperature` 0 is greedy (so is anything below 1e-5, as in vLLM); `top_k` 0, `top_p` 1, `min_p` 0 and
    `repetition_penalty` 1 are off. `min_tokens` (vLLM's) tokens come before EOS, a stop token id or a stop
    string may end the output. `seed` None means the engine assigns one before the request is batched.
    `logprobs` None returns no logprobs; n returns the chosen token's logprob and the n most likely
    alternatives; `prompt_logprobs` n does the same for every prompt token (vLLM's field; a completion's
    `echo`). `stop` and `stop_token_ids` are stored as tuples.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        def fix(name, value):  # the dataclass is frozen
            object.__setattr__(self, name, value)

        fix("max_tokens", _check_int("max_tokens", self.max_tokens, 1, 1_000_000))
        fix("temperature", _check_float("temperature", self.temperature, 0, 100))
        fix("top_p", _check_float("top_p", self.top_p, 0, 1, low_open=True))
        fix("top_k", _check_int("top_k", self.top_k, 0))
        fix("min_p", _check_float("min_p", self.min_p, 0, 1))
        fix("repetition_penalty", _check_float("repetition_penalty", self.repetition_penalty, 0, 100, low_open=True))
        fix("presence_penalty", _check_float("presence_penalty", self.presence_penalty, -2, 2))
        fix("frequency_penalty", _check_float("frequency_penalty", self.frequency_penalty, -2, 2))
        if self.seed is not None:
            fix("seed", _check_int("seed", self.seed, 0, SEED_LIMIT - 1))
        stop_ok = isinstance(self.stop, (list, tuple)) and len(self.stop) <= MAX_STOP
        if not stop_ok or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of at most {MAX_STOP} non-empty strings, got {self.stop!r}")
        fix("stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}")
        fix("stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        fix("min_tokens", _check_int("min_tokens", self.min_tokens, 0))
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            fix("logprobs", _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        if self.prompt_logprobs is not None:
            fix("prompt_logprobs", _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS))

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> SamplingParams:
        """Parameters from the sampling fields of an OpenAI request body (see `sampling_fields`).

        JSON null means "not given". `max_completion_tokens` is an alias of `max_tokens`; logprobs come either
        chat style (`logprobs: true`, `top_logprobs: n`) or completions style (`logprobs: n`); `stop` may be
        one string; `n` must be 1.
        """
        if not isinstance(body, dict):
            raise ValueError(f"sampling parameters must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - sampling_fields())
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        d = {k: v for k, v in body.items() if v is not None}
        n = d.pop("n", 1)
        if n != 1 or isinstance(n, bool):
            raise ValueError(f"n={n!r} is not supported yet: only n=1 (one completion per request)")
        if "max_completion_tokens" in d:
            if "max_tokens" in d and d["max_tokens"] != d["max_completion_tokens"]:
                raise ValueError("max_tokens and max_completion_tokens are aliases; give one of them")
            d["max_tokens"] = d.pop("max_completion_tokens")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        logprobs, top = d.pop("logprobs", None), d.pop("top_logprobs", None)
        if isinstance(logprobs, bool):
            d["logprobs"] = (0 if top is None else top) if logprobs else None
            if top is not None and not logprobs:
                raise ValueError("top_logprobs requires logprobs: true")
        elif logprobs is not None:
            if top is not None:
                raise ValueError("give top_logprobs with logprobs: true, or logprobs: n alone, not both")
            d["logprobs"] = logprobs
        elif top is not None:
            raise ValueError("top_logprobs requires logprobs: true")
        return cls(**d)


def sampling_fields() -> frozenset[str]:
    """The request-body fields `SamplingParams.from_dict` reads (a server splits these off the body)."""
    own = {f.name for f in dataclasses.fields(SamplingParams)}
    return frozenset(own | {"max_completion_tokens", "top_logprobs", "n"})


class SamplingBatch(NamedTuple):
    """Per-row sampling parameters for one compiled step: a pytree of arrays with a leading row axis [R]."""

    temperature: Float[Array, " r"]
    top_k: Int[Array, " r"]
    top_p: Float[Array, " r"]
    min_p: Float[Array, " r"]
    repetition_penalty: Float[Array, " r"]
    presence_penalty: Float[Array, " r"]
    frequency_penalty: Float[Array, " r"]
    seed: UInt32[Array, "r 2"]  # (high, low) 32-bit halves of the 63-bit seed: JAX x64 is off
    logprobs: Int[Array, " r"]  # the top alternatives the row asks for (-1: no logprobs at all)

    @classmethod
    def from_params(cls, params: list[SamplingParams | None], num_rows: int) -> SamplingBatch:
        """Host (numpy) arrays for `num_rows` rows: row i from `params[i]`; None and trailing rows are greedy
        padding. Every present request must already have a seed."""
        if len(params) > num_rows:
            raise ValueError(f"{len(params)} requests do not fit in {num_rows} rows")
        padding = SamplingParams(temperature=0.0, seed=0)
        rows = [padding if p is None else p for p in params] + [padding] * (num_rows - len(params))
        if any(p.seed is None for p in rows):
            raise ValueError("every request needs a seed before batching (seed=None: the engine assigns one)")

        def col(name, dtype):
            return np.array([getattr(p, name) for p in rows], dtype)

        seeds = np.array([(p.seed >> 32, p.seed & 0xFFFFFFFF) for p in rows], np.uint32).reshape(num_rows, 2)
        return cls(
            temperature=col("temperature", np.float32), top_k=col("top_k", np.int32), top_p=col("top_p", np.float32),
            min_p=col("min_p", np.float32), repetition_penalty=col("repetition_penalty", np.float32),
            presence_penalty=col("presence_penalty", np.float32),
            frequency_penalty=col("frequency_penalty", np.float32), seed=seeds,
            logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in rows], np.int32))


class SampleOutput(NamedTuple):
    """One sampled token per row, its logprob, and the `n` most likely alternatives (raw-logit logprobs)."""

    tokens: Int[Array, " r"]
    logprob: Float[Array, " r"]
    top_ids: Int[Array, "r n"]
    top_logprobs: Float[Array, "r n"]


def _processed_row(logits, row: SamplingBatch, prompt_mask, counts, truncate: bool):
    """One row: penalties, temperature, top-k, top-p, min-p; dropped tokens are -inf. Greedy rows keep the
    penalised logits unscaled and untruncated. `truncate=False` skips the top-k / top-p sort: the same result
    for rows with neither."""
    seen = prompt_mask | (counts > 0)
    p = row.repetition_penalty
    logits = jnp.where(seen, jnp.where(logits > 0, logits / p, logits * p), logits)
    logits = logits - row.presence_penalty * (counts > 0) - row.frequency_penalty * counts
    greedy = row.temperature < GREEDY_BELOW
    scaled = logits / jnp.where(greedy, 1.0, row.temperature)
    keep = jnp.exp(scaled - jnp.max(scaled)) >= row.min_p
    if truncate:
        vocab = logits.shape[-1]
        ordered = -jnp.sort(-scaled)  # descending
        kth = ordered[jnp.clip(row.top_k, 1, vocab) - 1]
        keep &= (row.top_k == 0) | (scaled >= kth)
        ordered = jnp.where((row.top_k == 0) | (ordered >= kth), ordered, -jnp.inf)
        probs = jax.nn.softmax(ordered)
        before = jnp.cumsum(probs) - probs  # probability of the strictly more likely tokens
        last_kept = ordered[jnp.sum(before < row.top_p) - 1]
        keep &= (row.top_p >= 1) | (scaled >= last_kept)
    return jnp.where(greedy, logits, jnp.where(keep, scaled, -jnp.inf))


def processed_logits(
    logits: Float[Array, "r v"], batch: SamplingBatch, prompt_mask: Bool[Array, "r v"],
    output_counts: Int[Array, "r v"],
) -> Float[Array, "r v"]:
    """The logits each row samples from, in vLLM's order: penalties (repetition: for tokens seen in the prompt
    or output, positive logits / p and negative ones * p; presence: - p where the output count > 0; frequency:
    - f * output count), then temperature, then top-k, top-p (the smallest set of most likely tokens whose
    probability reaches p; the top token is always kept), min-p (drop tokens with probability < min_p * the
    top probability). Dropped tokens are -inf, and tokens tied with a boundary token are kept. Greedy rows
    return the penalised logits: their token is the argmax."""
    truncating = (batch.temperature >= GREEDY_BELOW) & ((batch.top_k > 0) | (batch.top_p < 1))

    def rows(truncate: bool):
        return lambda: jax.vmap(functools.partial(_processed_row, truncate=truncate))(
            logits, batch, prompt_mask, output_counts)

    return jax.lax.cond(jnp.any(truncating), rows(True), rows(False))


def _noisy_argmax(processed, row: SamplingBatch, position):
    """Gumbel-max draw of one row (greedy rows: the plain argmax)."""
    gumbel = jax.random.gumbel(request_key(row.seed, position, PURPOSE_SAMPLE), processed.shape, jnp.float32)
    return first_argmax(jnp.where(row.temperature < GREEDY_BELOW, processed, processed + gumbel))


def draw_tokens(processed: Float[Array, "r v"], batch: SamplingBatch, positions: Int[Array, " r"]) -> Int[Array, " r"]:
    """One token per row from its processed logits by the Gumbel-max trick with noise from
    `request_key(seed, position, PURPOSE_SAMPLE)` (greedy rows: the argmax). A batch of greedy rows draws no
    noise at all (a batch-level `cond` that changes no row's token)."""
    return jax.lax.cond(jnp.any(batch.temperature >= GREEDY_BELOW),
                        lambda: jax.vmap(_noisy_argmax)(processed, batch, positions),
                        lambda: first_argmax(processed))


def _logprobs_row(logits, token, num_top_logprobs: int):
    logprobs = jax.nn.log_softmax(logits)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top_logprobs)
    return SampleOutput(token, logprobs[token], top_ids.astype(jnp.int32), top_logprobs)


def token_logprobs(
    logits: Float[Array, "r v"], tokens: Int[Array, " r"], num_top_logprobs: int, wanted: Bool[Array, ""]
) -> SampleOutput:
    """Each row's token with its logprob and the `num_top_logprobs` most likely alternatives, all log-softmax of
    the RAW model logits (vLLM's default); `num_top_logprobs` must be static. A batch in which no row asks for
    logprobs (`wanted` False) skips the log-softmax and the top-k: zeros, which no reader looks at."""

    def compute():
        return jax.vmap(functools.partial(_logprobs_row, num_top_logprobs=num_top_logprobs))(logits, tokens)

    def skip():
        r = tokens.shape[0]
        return SampleOutput(tokens, jnp.zeros(r, logits.dtype), jnp.zeros((r, num_top_logprobs), jnp.int32),
                            jnp.zeros((r, num_top_logprobs), logits.dtype))

    return jax.lax.cond(wanted, compute, skip)


def sample(
    logits: Float[Array, "r v"], batch: SamplingBatch, positions: Int[Array, " r"], prompt_mask: Bool[Array, "r v"],
    output_counts: Int[Array, "r v"], num_top_logprobs: int,
) -> SampleOutput:
    """Sample one token per row from `processed_logits` by `draw_tokens`, where `positions` holds the sequence
    position the sampled token will occupy; every row is computed on its own (vmap), so a row's outputs are
    bit-identical whatever the batch around it. Pure and jit-able: `num_top_logprobs` must be static."""
    tokens = draw_tokens(processed_logits(logits, batch, prompt_mask, output_counts), batch, positions)
    return token_logprobs(logits, tokens, num_top_logprobs, jnp.any(batch.logprobs >= 0))
