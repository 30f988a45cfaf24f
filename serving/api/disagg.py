"""Prefill / decode disaggregation: a prefill engine in its own process computes a request's prompt state and first
token, and hands the request's whole cache state to the decode engine, which generates the rest.

The hand-off (`SlotState`) is everything the engine keeps for one request: its compressed-KV pages and indexer
keys (the paged leaves, in block-table order), its slot leaves (the sliding-window ring, the compressors' open
windows, ...), every other per-slot cache entry (last sampled token, penalty statistics, ...), the host-side
Engram n-gram history, and the request itself (prompt, first token, seeded sampling parameters, output
constraint). Sampling is keyed by (seed, position), so the decode engine continues exactly as the prefill engine
would have: outputs equal a single engine's. A constrained request's grammar state is rebuilt on the decode side
from its constraint (compiled there once per distinct spec) by taking the tokens already emitted.

The hand-off is the engine's own: `Engine.export_slot` and `Engine.import_slot` (`serving.core.slot_state`). The
prefill side (`serving.api.prefill_worker`) is a process this one spawns, or a prefill server on another host
(`jaxseek serve --role prefill`, `serving.api.prefill_server`), over the link of `serving.api.prefill_link`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
from collections.abc import Sequence

import jax
import numpy as np

from serving.api.prefill_link import connect
from serving.api.prefill_worker import spawned_worker
from serving.base.request import RequestOutput
from serving.base.sampling import SamplingParams
from serving.core.engine import Engine
from serving.core.slot_state import SlotState
from serving.structured.constraints import ConstraintSpec
from sharding.mesh import MeshSpec

LOG = logging.getLogger(__name__)
SPLITS = ("symmetric", "asymmetric")  # what the prefill side computes of a prompt: all of it, or a V4.1 head


class DisaggregatedEngine:
    """A decode `Engine` here, fed by a prefill engine in another process, behind the engine's own interface
    (`add_request`, `step`, `cancel`, `has_work`, `requests`, `run`), so the server runs it as it runs an engine.

    `add_request` hands the prompt to the prefill side (which validates it: a refusal raises ValueError
    here); `step` installs the hand-offs that arrived and runs one decode-engine step. The prefill engine runs
    the decode engine's settings, on its own mesh if `prefill_mesh` is given (a `MeshSpec` string: the two meshes
    may differ in shape; EPLB stays on the decode side), else on the decode engine's, and on the model of
    `model_path`: the checkpoint the decode engine's model was loaded from (None: the bundled model). A hand-off
    leaves a rank of the prefill mesh and goes to the decode engine's least loaded rank. A request without a seed
    gets one here, since both engines must draw the same tokens; outputs then equal a single engine's.

    `prefill_address` (HOST:PORT) takes a prefill server on another host instead of a process here (`jaxseek serve
    --role prefill`, `serving.api.prefill_server`, linked with the secret of `$JAXSEEK_PD_KEY`): it runs these
    settings on its own mesh and its own copy of the checkpoint (it refuses another model, or another split).

    If the prefill side dies (killed, out of memory, its host gone; its link ends, so nothing waits on a message it
    was writing), the decode engine takes over: every request that was on the prefill side prefills here from its
    prompt (seeded, so its output is the pair's), every later request too, and `failure` says why (`retried`
    counts the requests taken over). Hand-offs that had arrived are kept.

    `split` `asymmetric` (a V4.1 model with bounded replay in the decode engine's prefill, `model.replay`): the
    prefill side loads the model's prefill part alone (`V41Config.prefill_part`: the layers through the last
    KV source) and prefills each prompt's head, all but its last `keep` tokens (the decode engine's replay keep),
    handing over those layers' state of the head; the decode engine prefills the tail through every layer, as
    its own bounded prefill would have run the replay layers on it (outputs equal a single engine's). A prompt of
    at most `keep` tokens, or one asking for prompt logprobs (every position through every layer), prefills in
    the decode engine. `prefill_weight_bytes` is what the prefill side holds resident.
    """

    def __init__(self, decode_engine, model_path=None, compile_cache: str | None = None,
                 start_timeout: float = 600.0, seed: int = 0, prefill_mesh: str | None = None,
                 split: str = "symmetric", prefill_address: str | None = None):
        self.engine = decode_engine
        self.layout, self.scheduler, self.requests = decode_engine.layout, decode_engine.scheduler, \
            decode_engine.requests
        if split not in SPLITS:
            raise ValueError(f"the P/D split must be one of {SPLITS}, got {split!r}")
        config = dataclasses.replace(decode_engine.config, detokenize=None)
        self.split, self.keep = split, 0  # asymmetric: the prompt tail the decode engine prefills
        if split == "asymmetric":
            if decode_engine.replay is None:
                raise ValueError("an asymmetric P/D split needs a causal encoder-decoder (V4.1) model with bounded "
                                 "replay in the decode engine's prefill (--replay compact or mask)")
            self.keep = decode_engine.replay.keep
            # the prefill part has no replay layer and no drafter; its rings keep the decode engine's backtracking
            backtrack = decode_engine.layout.ring - decode_engine.model_config.sliding_window
            config = dataclasses.replace(config, replay=None, speculation="none", backtrack=backtrack)
        if prefill_mesh is not None:
            if prefill_address is not None:
                raise ValueError("a prefill server runs on its own mesh (its --mesh): prefill_mesh is for a prefill "
                                 "process of this host")
            if not isinstance(prefill_mesh, str):
                raise ValueError(f"prefill_mesh must be a mesh spec like 'dp=2,ep=2', got {prefill_mesh!r}")
            MeshSpec.parse(prefill_mesh)  # a bad spec is refused here, before a process starts
            config = dataclasses.replace(config, mesh=prefill_mesh)
        config = dataclasses.replace(config, redundant_experts=0, eplb_every=0)  # EPLB stays on the decode side
        self.address, self.process = prefill_address, None
        if prefill_address is None:
            context = multiprocessing.get_context("spawn")
            self.link, there = context.Pipe()
            self.process = context.Process(target=spawned_worker, daemon=True, args=(
                there, model_path, config, compile_cache, jax.config.jax_num_cpu_devices, split))
            self.process.start()
            there.close()  # the prefill process holds the only other end: its end ends the link, even mid-message
        else:
            self.link = connect(prefill_address)
            self.link.send(("hello", config, split, decode_engine.model_config))
        kind, why = self._next(start_timeout) or ("failed", f"no answer within {start_timeout:g} s")
        if kind == "gone":
            why = self._exit()
        if kind != "ready":
            self.link.close()
            if self.process is None:
                raise RuntimeError(f"the prefill server at {prefill_address} did not take this decode engine: {why}")
            self.process.kill()
            raise RuntimeError(f"the prefill process did not start: {why}")
        # how the prefill engine is laid out and the bytes of its resident weights, as it reported
        self.prefill_layout, self.prefill_weight_bytes = why
        self.waiting: list[SlotState] = []  # hand-offs waiting for a slot / pages here
        self.finished: list[RequestOutput] = []
        self.acks: dict[str, str | None] = {}  # request id -> None (accepted) or the refusal
        # requests on the prefill side: (prompt, params, constraint, trigger), as add_request took them
        self.in_prefill: dict[str, tuple] = {}
        self.cancelled: set[str] = set()  # cancelled while on the prefill side: its hand-off is dropped
        self.failure: str | None = None  # why the prefill side is gone (the decode engine prefills since)
        self.retried = 0  # requests taken over from a dead prefill side
        self.handoff_bytes = 0
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(seed)

    def warmup(self) -> None:
        self.engine.warmup()
        if self.split == "asymmetric":  # a partial hand-off starts as a prefix hit does
            self.engine.device_pages.warmup()

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, constraint: ConstraintSpec | None = None,
                    constraint_trigger: int | None = None) -> str:
        """Hand a request to the prefill side; raises ValueError (and keeps nothing) if it refuses it (an
        invalid constraint included: the prefill engine compiles it first)."""
        params = params or SamplingParams()
        if params.seed is None:
            params = dataclasses.replace(params, seed=int(self._seeds.integers(0, 2**63 - 1)))
        request_id = request_id or f"pd-{next(self._ids)}"
        if request_id in self.in_prefill or request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        submission = ([int(t) for t in prompt], params, constraint, constraint_trigger)
        if self.split == "asymmetric":
            head = self._head(request_id, submission)
            if head is None:
                return self._prefill_here(request_id, submission)
            message = ("add", request_id, head, SamplingParams(max_tokens=2, ignore_eos=True, seed=0), None, None)
        else:
            message = ("add", request_id, *submission)
        if self.failure is None:
            self._send(message)
        while request_id not in self.acks:
            if self.failure is not None:  # gone before it answered: prefill here
                return self._prefill_here(request_id, submission)
            self._receive(block=True)
        refusal = self.acks.pop(request_id)
        if refusal is not None:
            raise ValueError(refusal)
        self.in_prefill[request_id] = submission
        return request_id

    def _head(self, request_id: str, submission: tuple) -> list[int] | None:
        """Asymmetric split: the prompt head the prefill side computes (None: the decode engine prefills the
        whole prompt). The request is checked here first: the prefill side sees only the head."""
        prompt, params, constraint, trigger = submission
        self.engine.validate(prompt, params)
        self.engine.structured.grammar(constraint, trigger, params.max_tokens)  # compiled once per spec
        if len(prompt) <= self.keep or params.prompt_logprobs is not None or self.failure is not None:
            return None
        return prompt[:len(prompt) - self.keep]

    def _prefill_here(self, request_id: str, submission: tuple) -> str:
        prompt, params, constraint, trigger = submission
        return self.engine.add_request(prompt, params, request_id, constraint=constraint, constraint_trigger=trigger)

    def _send(self, message: tuple) -> None:
        """Send to the prefill side; if it is gone, the next read finds the link's end."""
        try:
            self.link.send(message)
        except OSError:
            pass

    def _next(self, timeout: float) -> tuple | None:
        """The prefill side's next message; None if none came within `timeout` seconds; ("gone", None) once its
        link has ended (the process exited or the server closed it, perhaps in the middle of a message)."""
        try:
            return self.link.recv() if self.link.poll(timeout) else None
        except (EOFError, OSError):
            return "gone", None

    def _exit(self) -> str:
        """How the prefill side ended."""
        if self.process is None:
            return f"the prefill server at {self.address} closed the link"
        self.process.join(5)
        return f"the prefill process exited (exit code {self.process.exitcode})"

    def _take_over(self) -> None:
        """The prefill side is gone: the decode engine prefills every request that was in it, in the order
        they came, and every later one."""
        self.failure = self._exit()
        LOG.warning("%s: the decode engine prefills from now on", self.failure)
        for request_id, submission in self.in_prefill.items():
            if request_id in self.cancelled:  # dropped, as a request cancelled on the prefill side is
                continue
            try:
                self._prefill_here(request_id, submission)
                self.retried += 1
            except ValueError as e:  # the decode engine refuses what the prefill engine took: it fails, logged why
                LOG.error("request %s could not be taken over from %s: %s", request_id, self.failure, e)
                self.finished.append(RequestOutput(request_id, submission[0], [], "", "error", None, 0, None, 0.0))
        self.in_prefill, self.cancelled = {}, set()

    def cancel(self, request_id: str) -> None:
        """Stop a request wherever it is (its result, if any, has finish_reason 'cancelled')."""
        if request_id in self.in_prefill:
            self.cancelled.add(request_id)
            self._send(("cancel", request_id))
        elif any(s.request_id == request_id for s in self.waiting):
            self.waiting = [s for s in self.waiting if s.request_id != request_id]
        elif request_id in self.engine.requests:
            self.engine.cancel(request_id)

    def abort(self) -> list[RequestOutput]:
        """After a failed step: the decode engine's `abort`; requests still in prefill or waiting are dropped."""
        for request_id in self.in_prefill:
            self._send(("cancel", request_id))
        self.in_prefill, self.waiting, self.finished = {}, [], []
        return self.engine.abort()

    @property
    def has_work(self) -> bool:
        return bool(self.in_prefill or self.waiting or self.finished or self.engine.has_work)

    def _receive(self, block: bool) -> None:
        """Take the prefill side's messages (waiting for one if `block`)."""
        while True:
            message = self._next(0.01 if block else 0)
            if message is None:
                return
            kind, payload = message
            if kind == "gone":  # everything it sent is read: take its requests over
                if self.failure is None:
                    self._take_over()
                return
            block = False
            if kind in ("accepted", "error"):
                request_id, refusal = (payload, None) if kind == "accepted" else payload
                self.acks[request_id] = refusal
                continue
            request_id = payload if kind == "cancelled" else payload.request_id
            if request_id in self.cancelled:  # dropped; the prefill side acknowledges the cancel last
                if kind == "cancelled":
                    self.cancelled.discard(request_id)
                    self.in_prefill.pop(request_id, None)
                continue
            submission = self.in_prefill.pop(request_id, None)
            if kind == "handoff":
                if self.split == "asymmetric":  # the request as it came, its head computed (a partial state)
                    prompt, params, constraint, trigger = submission
                    payload = dataclasses.replace(payload, prompt=prompt, params=params, constraint=constraint,
                                                  constraint_trigger=trigger)
                self.waiting.append(payload)
                self.handoff_bytes += payload.nbytes
            elif kind == "finished":
                self.finished.append(self._with_text(payload, submission[1].stop if submission else ()))

    def _with_text(self, output: RequestOutput, stop: tuple[str, ...]) -> RequestOutput:
        """A result of the prefill side with its text decoded as the decode engine decodes, cut at the first
        stop string as the engine cuts."""
        detokenize = self.engine.config.detokenize
        if detokenize is None:
            return output
        text = detokenize(output.token_ids)
        hits = [text.find(s) for s in stop if s in text]
        return dataclasses.replace(output, text=text[:min(hits)] if hits else text)

    def step(self) -> list[RequestOutput]:
        """Install arrived hand-offs, run one decode step; returns requests finished."""
        self._receive(block=bool(self.in_prefill) and not (self.waiting or self.engine.has_work))
        while self.waiting and self.engine.import_slot(self.waiting[0]):
            self.waiting.pop(0)
        finished, self.finished = self.finished, []
        return finished + (self.engine.step() if self.engine.has_work else [])

    run = Engine.run  # step until every request has finished; results by request id

    def close(self) -> None:
        self._send(("stop",))
        if self.process is not None:
            self.process.join(30)
        self.link.close()
