"""The engine on a thread of its own, for an asyncio server: submissions and cancellations go in through a queue,
each request's new tokens come out on its caller's asyncio queue after every engine step."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from serving.structured.constraints import ConstraintSpec
from serving.base.request import RequestOutput, TokenLogprob
from serving.base.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Submission:
    """One choice to run: its prompt, sampling parameters and output constraint (None: free text), which starts
    after the token `trigger` when one is given (a reasoning block's end)."""

    prompt: list[int]
    params: SamplingParams
    constraint: ConstraintSpec | None = None
    trigger: int | None = None


@dataclasses.dataclass
class Delta:
    """New tokens of choice `index` (with their logprobs when asked; the first delta also the prompt's, when
    asked: `SamplingParams.prompt_logprobs`)."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class Done:
    """Choice `index` finished (its `output.text` is the whole text, cut at a stop string)."""

    index: int
    output: RequestOutput


@dataclasses.dataclass
class Failed:
    """The engine failed; the request cannot finish."""

    message: str


class Sink:
    """Where one HTTP request's events arrive: an asyncio queue fed from the engine thread."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def deliver(self, events: list) -> None:
        """Called on the engine thread."""
        self.loop.call_soon_threadsafe(self._put, events)

    def _put(self, events: list) -> None:
        for event in events:
            self.queue.put_nowait(event)


@dataclasses.dataclass
class _Tracked:
    sink: Sink
    index: int
    sent: int = 0  # output tokens delivered so far


class EngineLoop:
    """Owns an `Engine` on one daemon thread (the engine is not thread-safe: only this thread touches it).

    `submit` queues a group of `Submission`s (the choices of one HTTP request) and returns a future of their
    ids, or of the `ValueError` that refused one of them (then none of the group runs; an invalid constraint is
    refused here, when the engine compiles it). After each engine step the thread sends every tracked request's
    new tokens (`Delta`, several per step once the engine decodes speculatively) and its result (`Done`) to the
    request's `Sink`. `observe` (optional) is called after each step with the engine and the finished outputs,
    on the engine thread (metrics); `observe_constraint` (optional) with the seconds the engine took to add each
    constrained request (compiling its constraint, or finding it in the engine's cache), refused ones included.
    """

    def __init__(self, engine, observe=None, observe_constraint: Callable[[float], None] | None = None):
        self.engine, self.observe, self.observe_constraint = engine, observe, observe_constraint
        self.inbox: queue.Queue = queue.Queue()
        self.tracked: dict[str, _Tracked] = {}
        self.error: str | None = None
        self.on_failure: Callable[[], None] | None = None  # called on the engine thread after a failed step
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.inbox.put(("stop",))
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, requests: Sequence[Submission], sink: Sink) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(RuntimeError(f"the engine is not running: {self.error or 'stopped'}"))
        else:
            self.inbox.put(("add", list(requests), sink, future))
        return future

    def cancel(self, request_ids: Sequence[str]) -> None:
        self.inbox.put(("cancel", list(request_ids)))

    def fail_all(self, error: str) -> None:
        """Fail every tracked request with `error` and refuse new work: after a failed step, or from another thread
        when the engine thread will not return (a multi-process job lost a process mid-step)."""
        self.error = error
        tracked, self.tracked = self.tracked, {}
        for sink in {t.sink for t in tracked.values()}:
            sink.deliver([Failed(error)])

    # ---- the engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            try:
                command = self.inbox.get(block=not engine.has_work)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    return
                self._handle(command)
                try:
                    command = self.inbox.get_nowait()
                except queue.Empty:
                    command = None
            if not engine.has_work:
                continue
            try:
                finished = engine.step()
                self._deliver(finished)
                if self.observe is not None:
                    self.observe(engine, finished)
            except Exception as e:  # the engine's state is unknown: fail everyone, free what they hold, refuse new work
                log.exception("engine step failed")
                self.fail_all(f"{type(e).__name__}: {e}")
                self._release_after_failure()
                self._drain_after_failure()
                if self.on_failure is not None:
                    self.on_failure()
                return

    def _handle(self, command) -> None:
        if command[0] == "cancel":
            for request_id in command[1]:
                if self.tracked.pop(request_id, None) is not None:  # tracked: not finished yet
                    self.engine.cancel(request_id)
            return
        _, requests, sink, future = command
        added = []
        try:
            for index, s in enumerate(requests):
                request_id = self._add(s)
                added.append(request_id)
                self.tracked[request_id] = _Tracked(sink, index)
        except ValueError as e:
            for request_id in added:
                self.tracked.pop(request_id)
                self.engine.cancel(request_id)
            future.set_exception(e)
            return
        future.set_result(added)

    def _add(self, s: Submission) -> str:
        if s.constraint is None:
            return self.engine.add_request(s.prompt, s.params)
        start = time.perf_counter()
        try:
            return self.engine.add_request(s.prompt, s.params, constraint=s.constraint, constraint_trigger=s.trigger)
        finally:
            if self.observe_constraint is not None:
                self.observe_constraint(time.perf_counter() - start)

    def _deliver(self, finished: list[RequestOutput]) -> None:
        events: dict[Sink, list] = {}
        for request_id, t in self.tracked.items():
            request = self.engine.requests.get(request_id)  # None: not in this engine yet (P/D: prefilling)
            if request is not None and len(request.output) > t.sent:
                lps = request.logprobs[t.sent:len(request.output)] if request.params.logprobs is not None else []
                prompt = request.asked_prompt_logprobs() if t.sent == 0 else None
                events.setdefault(t.sink, []).append(Delta(t.index, request.output[t.sent:], lps, prompt))
                t.sent = len(request.output)
        for output in finished:
            t = self.tracked.pop(output.request_id, None)
            self.engine.requests.pop(output.request_id, None)  # the engine keeps every request otherwise
            if t is not None:
                events.setdefault(t.sink, []).append(Done(t.index, output))
        for sink, batch in events.items():
            sink.deliver(batch)

    def _release_after_failure(self) -> None:
        """Finish the failed engine's requests and free their slots and pages (so `observe`, e.g. /health, shows
        them released)."""
        try:
            aborted = self.engine.abort()
            for output in aborted:
                self.engine.requests.pop(output.request_id, None)
            if self.observe is not None:
                self.observe(self.engine, [])
        except Exception:  # noqa: BLE001  (the engine is already failed: its error stands)
            log.exception("releasing the failed engine's requests failed")

    def _drain_after_failure(self) -> None:
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                command[3].set_exception(RuntimeError(f"the engine failed: {self.error}"))
