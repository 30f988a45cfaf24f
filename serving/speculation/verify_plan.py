"""DSpark's verification scheduler (host side): how many drafts each request verifies in the next step.

The planner picks the verify budget and width that maximise expected tokens per second, from the drafter's
calibrated confidences and a cost table of the compiled verify buckets, or a step without drafting when no
budget beats plain decoding. It plans with confidences one block older than the drafts it verifies, so sampled
outputs keep the target's distribution. See docs/speculative-decoding.md.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

import numpy as np
from jaxtyping import Float, Int


@dataclasses.dataclass
class Plan:
    """The next verify step: its bucket width (1 + drafts per row at most), the total `budget` of drafts the
    device splits over the rows by prefix survival, and whether the step drafts the next blocks (False: the
    no-draft fallback's plain decode)."""

    width: int
    budget: int
    draft: bool = True


class CostTable:
    """Seconds per step of each compiled (rows, width) decode / verify bucket (width 0: a decode step that does
    not draft, where the no-draft fallback is on): profiled at start-up, then the median of the last `window`
    observed periods of steady iterations that ran it (host work included; a median, because one slow
    iteration would otherwise keep a rarely chosen bucket out of the plans, and with it out of the
    observations); a bucket observed fewer than 3 times is its profiled time plus the median gap between
    observed and profiled times over the observed buckets of the same rows (the host's work grows with the
    rows), or over all observed buckets while none of its rows is. `window` 0: observations are ignored."""

    def __init__(self, seconds: dict[tuple[int, int], float], window: int = 9):
        if not seconds or min(seconds.values()) <= 0:
            raise ValueError("a cost table needs a positive time for every bucket")
        self.profiled, self.window = dict(seconds), window
        self.periods: dict[tuple[int, int], collections.deque] = {}
        self.observed: dict[tuple[int, int], float] = {}

    def offset(self, rows: int) -> float:
        """Median observed minus profiled seconds over the observed buckets of `rows` rows, else over all
        observed buckets (0 before any observation)."""
        same = [b for b in self.observed if b[0] == rows] or list(self.observed)
        return statistics.median(self.observed[b] - self.profiled[b] for b in same) if same else 0.0

    def __contains__(self, bucket: tuple[int, int]) -> bool:
        return bucket in self.profiled

    def __call__(self, rows: int, width: int) -> float:
        if (rows, width) in self.observed:
            return self.observed[rows, width]
        return self.profiled[rows, width] + self.offset(rows)

    def observe(self, rows: int, width: int, period: float) -> None:
        """A steady iteration of bucket (rows, width) took `period` seconds."""
        if (rows, width) in self.profiled and self.window:
            periods = self.periods.setdefault((rows, width), collections.deque(maxlen=self.window))
            periods.append(period)
            if len(periods) >= 3:  # the median of 3 rejects one slow iteration
                self.observed[rows, width] = statistics.median(periods)


def monotone_in_width(seconds: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """A profiled table with no bucket costlier than a wider one of the same rows: a wider step does all a
    narrower one does and more, so a narrower bucket timed slower was disturbed, and its time becomes the
    wider one's (the running minimum from the widest bucket down)."""
    out = {}
    for rows in {r for r, _ in seconds}:
        lowest = float("inf")
        for width in sorted((w for r, w in seconds if r == rows), reverse=True):
            lowest = min(lowest, seconds[rows, width])
            out[rows, width] = lowest
    return out


def interpolated(seconds: dict[tuple[int, int], float], rows: tuple[int, ...], widths: tuple[int, ...]
                 ) -> dict[tuple[int, int], float]:
    """A cost table over every (rows, width) bucket from one profiled at a few of them (the extremes): at each
    profiled rows, linear in the width between its profiled widths >= 1 (width 0, the no-draft decode, stays
    as profiled); then at every rows, linear in the rows between the profiled rows (both clamped at the
    extremes). A table non-decreasing in the width (`monotone_in_width`) stays so."""
    profiled = sorted({r for r, _ in seconds})
    at_rows = {}
    for r in profiled:
        known = sorted(w for q, w in seconds if q == r and w >= 1)
        at_rows |= {(r, w): float(np.interp(w, known, [seconds[r, k] for k in known])) for w in widths}
        at_rows |= {(r, 0): seconds[r, 0]} if (r, 0) in seconds else {}
    every_width = sorted({w for _, w in at_rows})
    return {(r, w): float(np.interp(r, profiled, [at_rows[p, w] for p in profiled])) for r in rows
            for w in every_width}


def prefix_survival(confidence: Float[np.ndarray, "*r g"]) -> Float[np.ndarray, "*r g"]:
    """a[..., j] = c[..., 0] * ... * c[..., j]: the chance that draft j of a block and all before it are
    accepted."""
    return np.cumprod(np.clip(confidence, 0.0, 1.0), axis=-1)


def plan_verify(survival: Float[np.ndarray, "r g"], caps: Int[np.ndarray, " r"], rows_bucket: int,
                widths: tuple[int, ...], cost: CostTable) -> Plan:
    """The budget maximising expected tokens x steps/s over the compiled `widths` (1 = plain decode, a decode
    step that does not draft instead where `cost` has width 0), admitting each row's drafts up to its cap
    (drafts past max_tokens / max_len are not worth verifying). `survival` must not come from the drafts
    the plan verifies (see the module docstring)."""
    r, g = survival.shape
    caps = np.minimum(np.asarray(caps, np.int64), min(g, max(widths) - 1))
    rows_idx, pos_idx = np.nonzero(np.arange(g)[None, :] < caps[:, None])
    values = survival[rows_idx, pos_idx]
    order = np.lexsort((pos_idx, rows_idx, -values))  # descending survival; ties: earlier row, then position
    rows_idx, pos_idx, values = rows_idx[order], pos_idx[order], values[order]
    need = np.maximum.accumulate(pos_idx + 2) if len(order) else pos_idx  # width after admitting each pair
    fallback = (rows_bucket, 0) in cost
    best = Plan(1, 0, draft=not fallback)
    best_rate = r / cost(rows_bucket, 0 if fallback else 1)
    verify_costs = [cost(rows_bucket, w) for w in widths if w >= 2]
    if not verify_costs or (r + values.sum()) / min(verify_costs) <= best_rate:
        return best  # not even every draft at the cheapest verify bucket beats plain decoding
    gained = float(r)
    for b in range(len(order)):
        gained += values[b]
        fitting = [w for w in widths if w >= need[b]]
        if not fitting:
            break
        width = fitting[0]
        rate = gained / cost(rows_bucket, width)
        if rate > best_rate:
            best_rate = rate
            best = Plan(width, b + 1)
    return best
