"""Token masks of constrained requests: the host fills packed bitmasks, the compiled sampler applies them.

A mask row is int32 `[W]`, W = ceil(V / 32): token i is allowed when bit `i % 32` of word `i // 32` is set
(llguidance's layout); -1 in every word allows everything, the row of an unconstrained request.
`RequestGrammar` is one request's matcher: it fills the mask of its next position, commits emitted tokens,
offers grammar-forced tokens (jump-forward), holds the constraint off until a trigger token (the end of a
reasoning block), closes the output before its token limit (`serving.structured.grammar_budget`), and for speculative
decoding fills one mask per verify position while tentatively taking the drafts, then settles on the number the
verifier accepted. `fill_masks` / `speculate_masks` do a batch: the masks computed on llguidance's thread pool,
or for plain decoding as `MaskFill` finds faster (in the calling thread on a small or busy CPU).
`apply_token_bitmask` is the device side: pure jnp, for the jitted sampler.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax.numpy as jnp
import llguidance as llg
import numpy as np
from jaxtyping import Array, Float, Int

from serving.base.engine_config import ClosePolicy
from serving.structured.constraints import CompiledConstraint
from serving.structured.grammar_budget import Closing, closing_path, reconnect

ALL_ALLOWED = -1  # a mask word with every bit set


def bitmask_width(vocab_size: int) -> int:
    """Words of a mask row over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: Float[Array, "*rows vocab"], bitmask: Int[Array, "*mask_rows words"]
                        ) -> Float[Array, "*rows vocab"]:
    """The logits with every token the bitmask leaves out set to -inf (bit i % 32 of word i // 32 allows
    token i). Pure and vectorised, for use inside the jitted sampler; the bitmask's leading axes broadcast
    against the logits'."""
    vocab, words = logits.shape[-1], bitmask.shape[-1]
    if words * 32 < vocab:
        raise ValueError(f"a bitmask of {words} words covers {words * 32} tokens, fewer than the {vocab} logits")
    bits = (bitmask[..., :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(*bitmask.shape[:-1], words * 32)[..., :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def _only(tokens: Sequence[int], row: np.ndarray) -> None:
    """Fill a mask row that allows exactly `tokens`."""
    row[:] = 0
    words = row.view(np.uint32)
    for t in tokens:
        words[t // 32] |= np.uint32(1 << (t % 32))


def _allows(row: np.ndarray, token: int) -> bool:
    return bool(row.view(np.uint32)[token // 32] >> np.uint32(token % 32) & 1)


@dataclasses.dataclass(frozen=True)
class _Taken:
    """A draft taken tentatively: whether the matcher consumed it (a token of the constrained output), and
    whether it switched the constraint on (the trigger)."""

    consumed: bool
    activated: bool


_CONSUMED, _ACTIVATED, _PASSED = _Taken(True, False), _Taken(False, True), _Taken(False, False)


class RequestGrammar:
    """One request's constraint while it decodes.

    Args: `constraint` from `ConstraintCompiler.compile`; `trigger`: a token id after which the constraint
    starts (e.g. `</think>`: the reasoning before it is free), None to start at once; `max_tokens`: the
    request's output limit (every token counts, the reasoning before the trigger and the EOS too), and `close`
    how the masks finish the output within it (`serving.structured.grammar_budget`; None: never, the limit may cut it).

    The state follows the request's emitted tokens (`accept`). An end-of-sequence token ends the output: it
    is allowed where the constraint is complete, and once it is taken, or the constraint admits no further
    token (`finished`), the mask allows EOS only. A token the constraint refuses (a caller bug, or a stop
    token the grammar does not contain) puts the request in `error` and its mask to EOS only; the engine
    should then stop it.
    """

    def __init__(self, constraint: CompiledConstraint, trigger: int | None = None, max_tokens: int | None = None,
                 close: ClosePolicy | None = None):
        if trigger is not None and not 0 <= trigger < constraint.vocab_size:
            raise ValueError(f"trigger token {trigger} is outside the vocabulary [0, {constraint.vocab_size})")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if close is not None and max_tokens is None:
            raise ValueError("closing the output before its limit needs max_tokens")
        self.matcher = constraint.new_matcher()
        self.token_bytes, self.max_tokens, self.close = constraint.token_bytes, max_tokens, close
        self.emitted = 0  # tokens committed (`accept`, and drafts kept by `settle`)
        self.closed = 0  # masks that close mode cut to a closing path
        self._consumed = 0  # tokens the matcher has taken (committed and tentative)
        self._closing: tuple[int, Closing | None] | None = None  # (at `_consumed`, closing path) last computed
        self._searched: tuple[int, int | None] | None = None  # (tokens left, closing tokens) at the last search
        self._candidate: Closing | None = None  # the last closing path known: tried again before a new search
        self.eos_ids = constraint.eos_ids
        self.words = bitmask_width(constraint.vocab_size)
        self.trigger = trigger
        self.active = trigger is None
        self.ended = False  # an EOS was taken
        self.error: str | None = None
        self._taken: list[_Taken] | None = None  # drafts under verification (`speculate` .. `settle`)

    @property
    def speculating(self) -> bool:
        """Drafts are under verification (`speculate` was called, `settle` not yet)."""
        return self._taken is not None

    @property
    def stopped(self) -> bool:
        """The constraint admits no further token (the last one it took completed it)."""
        return self.active and self.error is None and self.matcher.is_stopped()

    @property
    def finished(self) -> bool:
        """The output is complete: only EOS may follow."""
        return self.ended or self.error is not None or (self.active and self.matcher.is_stopped())

    def fill(self, row: Int[np.ndarray, " words"]) -> None:
        """Write the mask of the next token into `row` (int32 [W], C-contiguous)."""
        self._check_row(row)
        self._check_settled()
        self._fill(row)

    def _fill(self, row: np.ndarray, ahead: int = 0) -> None:
        """Fill the mask `ahead` tokens past the committed ones (the matcher has taken that many drafts)."""
        if self.ended or self.error is not None:
            _only(self.eos_ids, row)
        elif not self.active:
            row[:] = ALL_ALLOWED
        else:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            self._check_filled(row)
            if self.error is None and self.closing_due(ahead):
                self._close(row, self.max_tokens - self.emitted - ahead)

    def closing_due(self, ahead: int = 0) -> bool:
        """Whether close mode watches the mask `ahead` tokens past the committed ones (the last `window`
        tokens of the limit)."""
        return self.close is not None and self.max_tokens - self.emitted - ahead <= self.close.window

    def closing_active(self, ahead: int = 0) -> bool:
        """Whether close mode may search or cut a mask up to `ahead` tokens past the committed ones: verify
        masks of such a request are filled one at a time, the others in parallel."""
        if not self.closing_due(ahead):
            return False
        fresh = self._closing is not None and self._closing[0] == self._consumed and self._closing[1] is not None
        return fresh or self.close.search_due(self.max_tokens - self.emitted - ahead, self._searched)

    def _close(self, row: np.ndarray, left: int) -> None:
        """Cut the grammar's mask in `row` to the closing path once `left` tokens are barely enough for it."""
        if self._closing is None or self._closing[0] != self._consumed:
            if not self.close.search_due(left, self._searched):
                return
            found = self._candidate and reconnect(self.matcher, self.token_bytes, self._candidate, self.eos_ids[0])
            if found is None:
                found = closing_path(self.matcher, self.token_bytes, self.close.max_bytes, self.close.max_nodes)
            self._closing, self._candidate = (self._consumed, found), found
            self._searched = (left, None if found is None else found.tokens)
        closing = self._closing[1]
        if closing is None or left > closing.tokens + self.close.margin:
            return
        keep = np.zeros_like(row)
        _only(closing.next_tokens(self.token_bytes, left) if closing.path else self.eos_ids, keep)
        if (keep & row).any():
            row &= keep
            self.closed += 1

    def accept(self, tokens: Sequence[int]) -> bool:
        """Commit tokens the request emitted, in order; False (and `error` set) if the constraint refuses one."""
        self._check_settled()
        for t in tokens:
            taken = self._take(int(t))
            if taken is None:
                if self.error is None:
                    self.error = f"token {int(t)} breaks the constraint"
                return False
            self.emitted += 1
        return True

    def forced_tokens(self) -> list[int]:
        """Tokens the constraint forces next (the only continuation, tokenised canonically; a trailing token
        that could still merge with what follows is held back): what jump-forward decoding may append
        without sampling. Empty when nothing is forced or the constraint is not active."""
        if not self.active or self.finished:
            return []
        return list(self.matcher.compute_ff_tokens())

    def speculate(self, drafts: Sequence[int], masks: Int[np.ndarray, "v words"]) -> int:
        """Masks for a verify row: `masks[j]` is the mask of the token after the committed tokens and drafts
        `d_1 .. d_j` (v >= len(drafts) + 1 rows). Drafts are taken tentatively up to the first one the
        constraint refuses; returns how many were taken. Rows past that position repeat its mask (the verifier
        rejects there, so they are never used). Follow with `settle`."""
        self._check_row(masks[0])
        if len(drafts) + 1 > masks.shape[0]:
            raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} mask rows, got {masks.shape[0]}")
        self._check_settled()
        self._taken = []
        for j, t in enumerate(drafts):
            self._fill(masks[j], j)
            if not _allows(masks[j], int(t)):
                break
            taken = self._take(int(t))
            if taken is None:
                break
            self._taken.append(taken)
        n = len(self._taken)
        if n == len(drafts):
            self._fill(masks[n], n)
        masks[n + 1:] = masks[n]
        return n

    def settle(self, accepted: int) -> None:
        """Keep the first `accepted` drafts taken by `speculate` and undo the rest; then `accept` the token the
        verifier emitted after them."""
        taken = self._taken
        if taken is None:
            raise RuntimeError("settle() without speculate()")
        if not 0 <= accepted <= len(taken):
            raise ValueError(f"accepted={accepted} drafts, but only {len(taken)} were allowed by the constraint")
        self._taken = None
        self.emitted += accepted
        dropped = taken[accepted:]
        self._rollback(sum(d.consumed for d in dropped))
        if any(d.activated for d in dropped):
            self.active = False
        if self.ended and accepted < len(taken):
            self.ended = False  # only the last taken draft can be an EOS

    def _take(self, t: int) -> _Taken | None:
        """Advance over one token; None (state unchanged) if the constraint refuses it."""
        if self.ended or self.error is not None:
            return None
        if not self.active:
            if t == self.trigger:
                self.active = True
                return _ACTIVATED
            return _PASSED
        if t in self.eos_ids:
            if not (self.matcher.is_stopped() or self.matcher.is_accepting()):
                return None
            self.ended = True  # EOS is not fed to the matcher: the output ends here
            return _PASSED
        if self.matcher.try_consume_tokens([t]) != 1:
            return None
        self._consumed_one(t)
        return _CONSUMED

    def _consumed_one(self, token: int) -> None:
        """Count a token the matcher took; a known closing path carries over when the token follows it."""
        if self._closing is not None and self._closing[0] == self._consumed and self._closing[1] is not None:
            rest = self._closing[1].after(self.token_bytes.of_token[token])
            self._closing = None if rest is None else (self._consumed + 1, rest)
            self._candidate = rest or self._candidate  # leaving the path: the path from before, to reconnect
        self._consumed += 1

    def _rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            self._consumed -= n
            self._closing = None

    def _take_active(self, drafts: list[int]) -> list[_Taken]:
        """`_take` over drafts up to the first refused one, for an active constraint: one matcher call."""
        end = next((j for j, t in enumerate(drafts) if t in self.eos_ids), len(drafts))
        taken = [_CONSUMED] * self.matcher.try_consume_tokens(drafts[:end])
        self._consumed += len(taken)
        self._closing = None
        if len(taken) == end < len(drafts) and self._take(drafts[end]) is not None:
            taken.append(_PASSED)
        return taken

    def _check_settled(self) -> None:
        if self._taken is not None:
            raise RuntimeError("settle() the drafts under verification first")

    def _check_row(self, row: np.ndarray) -> None:
        if row.dtype != np.int32 or row.shape[-1] != self.words or not row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"mask rows must be C-contiguous int32 [..., {self.words}], got {row.dtype} "
                             f"{row.shape}")

    def _check_filled(self, row: np.ndarray) -> None:
        """A mask with no token left would make the sampler's distribution all -inf: end the output instead."""
        if self.matcher.is_error() or not row.any():
            self.error = self.matcher.get_error() or "the constraint allows no token here"
            _only(self.eos_ids, row)


class MaskFill:
    """Computes a batch's grammar masks in the calling thread or on llguidance's thread pool, whichever is
    faster here. Both give the same masks; which is faster depends on the machine (the pool pays with idle cores
    and masks costly enough for the hand-off, as with a large vocabulary; on a busy CPU waking the pool costs
    more than a small mask). The first `trials` batches alternate the two and time them per row; the faster
    median is kept from then on (`serial`: True, False, or None while timing)."""

    def __init__(self, executor: llg.LLExecutor, trials: int = 16):
        if trials < 2:
            raise ValueError(f"trials must be >= 2 (one batch each way), got {trials}")
        self.executor, self.trials = executor, trials
        self.serial: bool | None = None
        self._seconds: tuple[list[float], list[float]] = ([], [])  # per row: pool, serial

    def __call__(self, rows: list[tuple[llg.LLMatcher, int]], masks: Int[np.ndarray, "r words"]) -> None:
        """Write matcher k's mask into `masks[row_k]`, for each (matcher, row_k) in `rows`."""
        serial = self.serial if self.serial is not None else len(self._seconds[1]) < len(self._seconds[0])
        start = time.perf_counter()
        if serial:
            base, nbytes = masks.ctypes.data, masks[0].nbytes  # rows of a C-contiguous array
            for matcher, i in rows:
                matcher.unsafe_compute_mask_ptr(base + i * nbytes, nbytes)
        else:
            self.executor.unsafe_compute_mask_ptr(rows, masks.ctypes.data, masks[0].nbytes, masks.shape[0])
        if self.serial is None:
            self._seconds[serial].append((time.perf_counter() - start) / len(rows))
            if len(self._seconds[0]) + len(self._seconds[1]) >= self.trials:
                self.serial = bool(np.median(self._seconds[1]) < np.median(self._seconds[0]))


def fill_masks(grammars: Sequence[RequestGrammar | None], masks: Int[np.ndarray, "r words"],
               executor: llg.LLExecutor | MaskFill) -> None:
    """Fill one mask row per batch row: row i from `grammars[i]` (None: unconstrained, all allowed; rows past
    the list too). Active matchers run in parallel on `executor`, or as a `MaskFill` chooses."""
    _check_batch(masks, len(grammars))
    masks[len(grammars):] = ALL_ALLOWED
    parallel = []
    for i, g in enumerate(grammars):
        if g is None:
            masks[i] = ALL_ALLOWED
        elif g.active and not g.finished:
            g._check_settled()
            parallel.append((g.matcher, i))
        else:
            g.fill(masks[i])
    if parallel:
        if isinstance(executor, MaskFill):
            executor(parallel, masks)
        else:
            executor.unsafe_compute_mask_ptr(parallel, masks.ctypes.data, masks[0].nbytes, masks.shape[0])
        empty = ~masks.any(axis=1)
        for matcher, i in parallel:
            g = grammars[i]
            if empty[i] or matcher.is_error():
                g._check_filled(masks[i])
            elif g.closing_due():
                g._close(masks[i], g.max_tokens - g.emitted)


def speculate_masks(grammars: Sequence[RequestGrammar | None], drafts: Sequence[Sequence[int]],
                    masks: Int[np.ndarray, "r v words"], executor: llg.LLExecutor | MaskFill) -> list[int]:
    """`RequestGrammar.speculate` for a batch of verify rows: row i's v masks from `grammars[i]` and its
    drafts (None: all allowed). Returns the drafts each row's constraint allows (len(drafts[i]) for an
    unconstrained row). Active matchers compute their masks in parallel on `executor`; a row whose constraint
    is not yet active (its drafts may cross the trigger) goes token by token (a `MaskFill`: on its pool)."""
    _check_batch(masks, len(grammars))
    executor = executor.executor if isinstance(executor, MaskFill) else executor
    if len(drafts) != len(grammars):
        raise ValueError(f"{len(grammars)} grammars but {len(drafts)} draft lists")
    rows, verify, words = masks.shape
    masks[len(grammars):] = ALL_ALLOWED
    allowed, parallel, undrafted = [], [], []
    for i, (g, d) in enumerate(zip(grammars, drafts)):
        if len(d) + 1 > verify:
            raise ValueError(f"row {i}: {len(d)} drafts need {len(d) + 1} mask rows, got {verify}")
        if g is None:
            masks[i] = ALL_ALLOWED
            allowed.append(len(d))
        elif g.active and not g.finished and not g.closing_active(len(d)):
            g._check_settled()
            if len(d):
                parallel.append((g.matcher, i * verify, [int(t) for t in d]))
            else:  # llguidance's draft fill takes no empty draft list: a plain fill of the row's first mask
                undrafted.append((g.matcher, i * verify))
            allowed.append(-1)  # taken below, after the parallel fill
        else:
            allowed.append(g.speculate(d, masks[i]))
    flat = masks.reshape(rows * verify, words)
    if parallel:
        executor.unsafe_compute_mask_ptr_with_draft_token(parallel, flat.ctypes.data, flat[0].nbytes, rows * verify)
    if undrafted:
        executor.unsafe_compute_mask_ptr(undrafted, flat.ctypes.data, flat[0].nbytes, rows * verify)
    for at, d in [(at, d) for _, at, d in parallel] + [(at, []) for _, at in undrafted]:
        i = at // verify
        g = grammars[i]
        g._taken = g._take_active(d)
        n = len(g._taken)
        if g.ended:  # the last draft taken is an EOS: only EOS follows
            _only(g.eos_ids, masks[i, n])
        for j in range(n + 1):
            g._check_filled(masks[i, j])
        masks[i, n + 1:] = masks[i, n]
        allowed[i] = n
    return allowed


def _check_batch(masks: np.ndarray, num_grammars: int) -> None:
    if masks.dtype != np.int32 or not masks.flags["C_CONTIGUOUS"]:
        raise ValueError(f"masks must be a C-contiguous int32 array, got {masks.dtype}")
    if num_grammars > masks.shape[0]:
        raise ValueError(f"{num_grammars} grammars do not fit in {masks.shape[0]} mask rows")
