"""The prefill side of P/D disaggregation (`serving.api.disagg`): a prefill engine that takes requests off a link
(`serving.api.prefill_link`), prefills them and sends back each one's hand-off, or its result if it finished at its
first token. It runs in a process the decode engine spawned on its host (`spawned_worker`) or in a prefill server
on another (`serving.api.prefill_server`)."""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection

import jax

from serving.api.prefill_link import Inbox
from serving.base.engine_config import EngineConfig
from serving.core.engine import Engine


def prefill_engine(model, config: EngineConfig) -> Engine:
    """The prefill engine of `model` under the decode engine's settings `config`, compiled. Zero-overhead
    scheduling is off: each step is read before the next one is dispatched, so a request stops at its first
    token."""
    from serving.base.tokenizer import tokenizer_for

    engine = Engine(model, config, zero_overhead=False, detokenize=tokenizer_for(model).decode)
    engine.warmup()
    return engine


def weight_bytes(model) -> int:
    """The bytes of `model`'s weights as loaded (stored FP8 / FP4 ones as stored)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))


def ready(engine: Engine, model) -> tuple:
    """The "ready" message: how the prefill engine is laid out and the bytes of the weights of `model` it holds
    resident."""
    placement = engine.placement
    return "ready", (f"{placement.ranks} attention rank(s), experts over {placement.ep} shard(s)",
                     weight_bytes(model))


def prefill_loop(link: Connection, engine: Engine, split: str) -> None:
    """Prefill what arrives on `link` until ("stop",) or the link's end, sending back hand-offs (or the results of
    requests that finished at their first token). Each request is acknowledged ("accepted" or "error") as soon as
    it arrives; a cancelled one is acknowledged ("cancelled") once the engine has let it go. `split`
    `asymmetric`: the engine runs the model's prefill part, whose hand-offs are partial (the layers' state of the
    prompt head it was given, nothing else). On return the engine holds no request and the link is closed."""
    inbox, pending = Inbox(link), set()
    try:
        while True:
            message = inbox.get(block=not engine.has_work)
            while message is not None:
                if message[0] == "stop":
                    return
                if message[0] == "cancel":
                    if message[1] in pending:
                        engine.cancel(message[1])
                        pending.discard(message[1])
                    link.send(("cancelled", message[1]))
                else:
                    _, request_id, prompt, params, constraint, trigger = message
                    try:
                        engine.add_request(prompt, params, request_id, constraint=constraint,
                                           constraint_trigger=trigger)
                        pending.add(request_id)
                        link.send(("accepted", request_id))
                    except ValueError as e:
                        link.send(("error", (request_id, str(e))))
                message = inbox.get(block=False)
            if engine.has_work:
                _step(link, engine, split, pending)
    except (EOFError, OSError):  # the decode side is gone mid-reply
        return
    finally:
        try:
            engine.abort()
            engine.requests.clear()
        finally:  # the decode side sees the link end even if the engine is broken
            inbox.close()


def _step(link: Connection, engine: Engine, split: str, pending: set[str]) -> None:
    """One engine step; send what it finished and the hand-offs of the requests that have their first token."""
    for output in engine.step():
        engine.requests.pop(output.request_id, None)
        if output.request_id in pending:  # finished at its first token (eos, a stop, max_tokens 1)
            pending.discard(output.request_id)
            link.send(("finished", output))
    handed = [r for r in pending if engine.requests[r].output]
    for request_id in handed:
        state = engine.export_slot(request_id)
        if split == "asymmetric":  # its first token is the prefill part's, not the model's: none is sent
            state = dataclasses.replace(state, output=[], logprobs=[], slot={}, drafts=[], confidence=[])
        link.send(("handoff", state))
    for request_id in handed:  # its slot and pages are free again; the next step collects the cancellation
        engine.cancel(request_id)
        pending.discard(request_id)


def spawned_worker(link: Connection, model_path, config: EngineConfig, compile_cache: str | None,
                   cpu_devices: int, split: str) -> None:
    """A prefill process of the decode engine's host: load the model (its prefill part for an `asymmetric`
    split), say "ready" (or "failed", why), then `prefill_loop`. `cpu_devices`: the parent's emulated CPU devices
    (`jax_num_cpu_devices`, -1: JAX's default), which a mesh engine on CPU needs here too."""
    jax.config.update("jax_num_cpu_devices", cpu_devices)  # before any JAX operation
    if compile_cache:
        jax.config.update("jax_compilation_cache_dir", compile_cache)
    from model import load_model

    try:
        model = load_model(model_path, part="prefill" if split == "asymmetric" else "all")
        engine = prefill_engine(model, config)
    except Exception as e:  # the parent says why
        link.send(("failed", f"{type(e).__name__}: {e}"))
        return
    link.send(ready(engine, model))
    prefill_loop(link, engine, split)
