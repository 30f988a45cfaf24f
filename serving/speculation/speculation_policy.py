"""How a speculative engine runs each decode step: plain decoding, or a verify bucket and the drafts each row
verifies. "fixed" verifies every drafted token; "dspark" plans with the verification scheduler
(`serving.speculation.verify_plan`) over the drafter's confidences and the cost table of the decode / verify buckets, and
with its no-draft fallback stops drafting while no verify budget pays, probing now and then.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from serving.base.engine_config import EngineConfig
from serving.base.request import Request
from serving.base.request import Row
from serving.speculation.verify_plan import CostTable, Plan, plan_verify, prefix_survival


class SpeculationPolicy:
    """The engine's speculation settings and state: `mode`, `num_drafts` (0 without a drafter), the verify
    bucket widths, the DSpark cost table (`costs`: seconds per decode / verify bucket, profiled by the engine and
    corrected by observed periods) and the no-draft fallback's probing."""

    def __init__(self, config: EngineConfig, block: int, clock: Callable[[], float] = time.perf_counter):
        """`block`: the drafter's block size (0: no drafter); `clock` times the observed periods (the engine's
        `HostChoices.now`). Raises ValueError for drafts it cannot give."""
        self.clock = clock
        num_drafts = block if config.num_drafts is None else config.num_drafts
        if block and not num_drafts <= block:
            raise ValueError(f"num_drafts must be in [1, {block}] (the drafter's block size), got {num_drafts}")
        self.mode, self.num_drafts = config.speculation, num_drafts if block else 0
        # verify bucket widths (1 + drafts): every width for DSpark, the full block for fixed speculation
        widths = config.verify_widths or tuple(range(2, self.num_drafts + 2))
        if self.mode == "dspark" and not widths[-1] <= self.num_drafts + 1:
            raise ValueError(f"verify_widths {list(widths)} must lie in [2, num_drafts + 1 = {self.num_drafts + 1}]")
        self.verify_widths = {"none": (), "fixed": (self.num_drafts + 1,), "dspark": widths}[self.mode]
        self.draft_fallback, self.probe_every = config.draft_fallback and self.mode == "dspark", config.probe_every
        self.costs: CostTable | None = None
        self._nodraft_streak = 0  # decode steps since the last one that drafted (the no-draft fallback)
        self._probe_interval = self.probe_every  # doubles after each probe, back to probe_every once verifying
        self._cost_key: tuple[int, int] | None = None  # the cost-table bucket of the last decode step
        self._steady_since: float | None = None  # end of the last iteration that ran no prefill step

    def decide(self, rows: list[Row], ranks: list[int], num_ranks: int, decode_rows: tuple[int, ...],
               zero_overhead: bool, profile: Callable[[], CostTable]) -> tuple[int, list[int] | None, bool]:
        """The decode step over `rows` (on attention ranks `ranks`, of `num_ranks`: a mesh step runs one bucket
        on every rank, `decode_rows` rows per rank): (width, each rank's drafts budget or None: every row
        verifies its cap, whether the drafter drafts); width 1 is plain decoding. Sets each row's cap. DSpark
        plans each rank's rows on their own (the step costs what one rank's bucket does) and the step takes the
        widest width any rank's plan chose. `profile` builds the cost table if DSpark has none yet."""
        if self.mode == "none" or not any(row.caps for row in rows):
            return self._plain(rows)
        caps = np.array([row.caps for row in rows])
        budget = None
        if self.mode == "fixed":
            width = self.verify_widths[0]
        else:
            on_rank = [np.flatnonzero(np.asarray(ranks) == d) for d in range(num_ranks)]
            bucket_rows = next(r for r in decode_rows if r >= max(map(len, on_rank)))
            if self.costs is None:
                self.costs = profile()
            survival = prefix_survival(np.array([self._planning_confidence(row.request, zero_overhead)
                                                 for row in rows]))
            plans = [plan_verify(survival[i], caps[i], bucket_rows, (1,) + self.verify_widths, self.costs)
                     if len(i) else Plan(1, 0) for i in on_rank]
            widest = max(plan.width for plan in plans)
            if widest == 1:
                return self._plain(rows)
            # a block drafted before a step that did not draft is stale: its row verifies nothing
            stale = np.array([not row.request.drafts_fresh for row in rows])
            if stale.all():  # verification pays by the last confidences: draft now, verify next step
                return self._plain(rows, draft=True)
            width, budget = widest, [plan.budget for plan in plans]  # each rank splits its budget on the device
            caps = np.where(stale, 0, caps)
        for row, cap in zip(rows, caps):
            row.caps = int(min(cap, width - 1))
        self._nodraft_streak, self._probe_interval = 0, self.probe_every
        return width, budget, True

    def _planning_confidence(self, request: Request, zero_overhead: bool) -> list[float]:
        """The confidences DSpark plans a row's budget with: those of a block older than the one it verifies (a
        draft's confidence depends on the drafts before it, so planning with the verified block's own would let
        a draft decide whether it is verified, which biases sampling). With zero-overhead scheduling that is the
        newest block the host has read (the next one is still in flight), otherwise the block before the
        slot's current one; 1.0 where the request has no such block yet (its first verification)."""
        known = request.confidence if zero_overhead else request.prior_confidence
        return (known or [1.0] * self.num_drafts)[:self.num_drafts]

    def _plain(self, rows: list[Row], draft: bool | None = None) -> tuple[int, None, bool]:
        """A decode step of one token per row. With the no-draft fallback its drafter only absorbs features,
        except for probes, which draft again so that fresh confidences let the planner resume verification:
        after `probe_every` such steps, then after twice as many each time a probe did not resume it (at most
        8 x `probe_every`). `draft` True: draft now."""
        for row in rows:
            row.caps = 0
        self._nodraft_streak += 1
        if draft is None:
            draft = not self.draft_fallback or self._nodraft_streak > self._probe_interval
            if draft and self.draft_fallback:
                self._probe_interval = min(2 * self._probe_interval, 8 * self.probe_every)
        if draft:
            self._nodraft_streak = 0
        return 1, None, draft

    def dispatched(self, rows: int, width: int, draft: bool) -> None:
        """A decode / verify step of bucket (`rows`, `width`) was launched: the cost-table entry it runs."""
        self._cost_key = (rows, width if draft else 0)

    def observe_period(self, steady: bool) -> None:
        """Correct the DSpark cost table with the period of steady decode iterations (`steady`: no prefill step
        and no request finishing in this or the previous iteration: a finishing request's bookkeeping is no cost
        of the bucket, and the narrower buckets often run only in a request's last step): what a decode / verify
        step really costs, host work included. Without a cost table the clock is not read (in a multi-process
        engine each reading is a message)."""
        if self.costs is None:
            return
        now = self.clock()
        if steady and self._steady_since is not None:
            self.costs.observe(*self._cost_key, now - self._steady_since)
        self._steady_since = now if steady else None
