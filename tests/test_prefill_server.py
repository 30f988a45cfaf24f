"""P/D across hosts: `jaxseek serve --role prefill` (a process of its own, as on another host, prefilling on a
dp=2 mesh) serves a decode engine here that links to it by address. Outputs equal a single engine's, symmetric and
with V4.1's asymmetric split; a link with the wrong key, the wrong split or another model is refused with a
reason, as is a second decode engine while one is served; the server outlives a decode engine's link, closed or
cut mid-prompt, and serves the next (a `Server` with `prefill_address`); killed mid-prompt, it leaves its requests
to the decode engine, which finishes them alike."""

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from benchmarks.serving import free_port
from model import load_model
from serving.api.prefill_link import KEY_ENV, connect
from serving.base.engine_config import EngineConfig
from serving.core.engine import Engine
from tests.test_disagg import ASYMMETRIC, ENGINE, KEEP, PARAMS, TEXTS, killed_mid_prompt, same

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-secret"
START = 300  # seconds the prefill server may take to load its model on 2 shared cores


@pytest.fixture(scope="module")
def setup():
    model = load_model()
    engine = Engine(model, detokenize=model.tokenizer.decode, **ENGINE)
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    return model, prompts, engine.generate(prompts, PARAMS)


@contextlib.contextmanager
def running_prefill_server(where: Path, *flags: str):
    """`jaxseek serve --role prefill --mesh dp=2 FLAGS` on a free port of 127.0.0.1, with conftest's JAX
    settings; its address and process."""
    log = where / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update({KEY_ENV: KEY, "JAX_NUM_CPU_DEVICES": "8", "JAX_DEFAULT_MATMUL_PRECISION": "highest",
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxseek.cli", "serve", "--role", "prefill", "--port", str(port),
                             "--mesh", "dp=2", "--compile-cache", jax.config.jax_compilation_cache_dir, *flags],
                            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + START
        while "prefill server on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.2)
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def prefill_server(tmp_path_factory):
    with running_prefill_server(tmp_path_factory.mktemp("prefill")) as server:
        yield server


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def hello(address: str, split: str, model_config) -> tuple:
    """What the prefill server answers a link that says it is a decode engine of `model_config`."""
    link = connect(address)
    try:
        link.send(("hello", EngineConfig(**ENGINE), split, model_config))
        return link.recv()
    finally:
        link.close()


def test_a_prefill_server_refuses_what_it_cannot_serve(setup, prefill_server, monkeypatch):
    from serving.api.disagg import DisaggregatedEngine

    model = setup[0]
    address, _ = prefill_server
    monkeypatch.setenv(KEY_ENV, "wrong")
    with pytest.raises(RuntimeError, match="refused the link .* the same on both hosts"):
        connect(address)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ValueError, match=f"set \\${KEY_ENV}"):
        connect(address)
    with pytest.raises(ValueError, match="HOST:PORT"):
        DisaggregatedEngine(Engine(model, **ENGINE), prefill_address="127.0.0.1")
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(RuntimeError, match="no prefill server answers at 127.0.0.1:1"):
        connect("127.0.0.1:1")
    with socket.create_server(("127.0.0.1", 0)) as mute:  # takes the connection, never sends the challenge
        with pytest.raises(RuntimeError, match="no prefill server took the link at .* within 0.5 s"):
            connect("127.0.0.1:%d" % mute.getsockname()[1], timeout=0.5)
    assert hello(address, "asymmetric", model.config) == (
        "failed", "ValueError: the decode engine asks for a asymmetric P/D split; this prefill server loaded its "
                  "checkpoint for a symmetric one (--pd-split)")
    other = dataclasses.replace(model.config, rms_norm_eps=model.config.rms_norm_eps * 2)
    kind, why = hello(address, "symmetric", other)
    assert kind == "failed" and "not this prefill server's" in why


def test_decode_engines_linked_to_a_prefill_server(setup, prefill_server, key):
    """Two decode engines one after the other, the second a `Server`'s; the same tokens, logprobs and text as a
    single engine; a third that links while the first is served is told the server is busy."""
    from serving.api.disagg import DisaggregatedEngine
    from serving.api.server import Server, ServerConfig

    model, prompts, reference = setup
    address, _ = prefill_server
    pd = DisaggregatedEngine(Engine(model, detokenize=model.tokenizer.decode, **ENGINE), prefill_address=address)
    try:
        assert pd.prefill_layout == "2 attention rank(s), experts over 1 shard(s)" and pd.process is None
        with pytest.raises(RuntimeError, match="serves another decode engine"):
            DisaggregatedEngine(Engine(model, **ENGINE), prefill_address=address)
        ids = [pd.add_request(p, q) for p, q in zip(prompts, PARAMS)]
        results = pd.run()
        for rid, expected in zip(ids, reference):
            same(results[rid], expected)
        assert pd.handoff_bytes > 0 and pd.failure is None and pd.retried == 0
        assert pd.scheduler.pages.idle() == pd.layout.num_pages
    finally:
        pd.close()
    server = Server(model, ServerConfig(model_name="bundled", prefill_address=address), **ENGINE)
    try:
        rid = server.engine.add_request(prompts[1], PARAMS[1])
        assert server.engine.run()[rid].token_ids == reference[1].token_ids
        assert server.engine.failure is None
    finally:
        server.engine.close()


def test_an_asymmetric_split_with_a_prefill_server(setup, tmp_path, key):
    """`--pd-split asymmetric` on both sides: the prefill server holds the prefill part alone and prefills each
    long prompt's head; the decode engine (DSpark, bounded replay) prefills the tail; outputs equal a single
    engine's."""
    from model.replay import Replay
    from serving.api.disagg import DisaggregatedEngine

    model, prompts, _ = setup
    prompts = [prompts[0], prompts[1], prompts[2] + prompts[1][:30], prompts[3]]
    single = Engine(model, detokenize=model.tokenizer.decode, replay=Replay("compact", KEEP), prefix_cache=False,
                    **ASYMMETRIC)
    reference = single.generate(prompts, PARAMS)
    with running_prefill_server(tmp_path, "--pd-split", "asymmetric") as (address, _):
        pd = DisaggregatedEngine(single, prefill_address=address, split="asymmetric")
        try:
            ids = [pd.add_request(p, q) for p, q in zip(prompts, PARAMS)]
            assert len(pd.in_prefill) == 2  # the two prompts longer than KEEP
            results = pd.run()
            for rid, expected in zip(ids, reference):
                same(results[rid], expected)
            whole = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
            assert 0 < pd.prefill_weight_bytes < whole and pd.failure is None
        finally:
            pd.close()


def test_a_prefill_server_outlives_a_decode_engine_that_dies_mid_prompt(setup, prefill_server, key):
    """A decode engine's link cut while the prefill server prefills its two long prompts, as its process's death
    cuts it (no "stop"): the server lets both go (the engine has two slots, so a leaked one would starve the next)
    and serves the next decode engine, whose outputs equal a single engine's."""
    from serving.api.disagg import DisaggregatedEngine

    model, prompts, reference = setup
    address, proc = prefill_server
    doomed = DisaggregatedEngine(Engine(model, **ENGINE), prefill_address=address)
    for i in (1, 2):
        doomed.add_request(prompts[i], PARAMS[i])
    doomed.link.close()
    pd = DisaggregatedEngine(Engine(model, detokenize=model.tokenizer.decode, **ENGINE), prefill_address=address)
    try:
        ids = [pd.add_request(p, q) for p, q in zip(prompts, PARAMS)]
        results, end = {}, time.monotonic() + START
        while pd.has_work and time.monotonic() < end:
            results |= {o.request_id: o for o in pd.step()}
        assert set(results) == set(ids) and pd.failure is None and proc.poll() is None
        for rid, expected in zip(ids, reference):
            same(results[rid], expected)
    finally:
        pd.close()


def test_a_killed_prefill_server_leaves_its_requests_to_the_decode_engine(setup, prefill_server, key):
    """The prefill server killed while it prefills the two long prompts: each still finishes with the single
    engine's output, prefilled by the decode engine, and so do later requests; no page stays taken."""
    from serving.api.disagg import DisaggregatedEngine

    model, prompts, reference = setup
    address, proc = prefill_server
    pd = DisaggregatedEngine(Engine(model, detokenize=model.tokenizer.decode, **ENGINE), prefill_address=address)
    killed_mid_prompt(pd, proc.kill, prompts, reference)
    assert pd.failure == f"the prefill server at {address} closed the link"
