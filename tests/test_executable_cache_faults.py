"""The executable cache with JAX's persistent cache on (`serving/core/executable_cache.py`): what JAX's cache serves, in
the compiling thread, in another, or through JAX's in-process cache (a decode step's decide half, the same at every
context bucket), is never stored; an entry that loads but fails when run (stored the way that bad path stored one)
costs one recompile, the request completes with the tokens of an engine without the cache, and a later engine
loads the replaced entry; an engine whose step fails frees its slots and pages and `/health` says why."""

import concurrent.futures
import shutil

import httpx
import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from model.config import preset
from serving.core import executable_cache
from serving.core.engine import Engine
from serving.base.sampling import SamplingParams
from serving.api.server import Server, ServerConfig, serve_in_thread
from tests.helpers import random_model

SETTINGS = {"max_slots": 2, "max_len": 64, "prefill_chunk": 16, "max_prefill_rows": 1, "context_tokens": 16,
            "page_tokens": 16}
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9]]
SEEDED = [SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=s) for s in (1, 2)]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """JAX's compile-cache directory set to a fresh one, JAX's persistent cache on for every compilation."""
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
              jax.config.jax_persistent_cache_min_entry_size_bytes)
    root = tmp_path_factory.mktemp("compile-cache")
    jax.config.update("jax_compilation_cache_dir", str(root))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    yield root
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", before[2])
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def model(cache_root):
    return random_model(preset("tiny"), seed=3, noise=0.05)


@pytest.fixture(scope="module")
def reference(model):
    """The seeded tokens of an engine without the executable cache (every bucket compiled in the process)."""
    engine = Engine(model, **SETTINGS)
    engine.executables = None
    return [out.token_ids for out in engine.generate(PROMPTS, SEEDED)]


def clear(root, executables: bool = True, jax_entries: bool = False) -> None:
    """Empty the executable cache and / or JAX's own persistent cache under `root`."""
    for path in root.iterdir():
        if (path.name == executable_cache.SUBDIR) == executables or (path.name != executable_cache.SUBDIR
                                                                    and jax_entries):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    compilation_cache.reset_cache()


def test_what_jax_cache_served_is_never_stored(model, cache_root, reference):
    clear(cache_root, jax_entries=True)
    first = Engine(model, **SETTINGS)
    small, large = (1, 1, 1, first.context_pages[0]), (1, 1, 1, first.context_pages[-1])
    assert small != large
    first._executable(small)  # compiled afresh: stored, and written to JAX's cache
    assert first.executables.stored == 1
    clear(cache_root)  # JAX's cache holds `small`'s programs, the executable cache nothing
    second = Engine(model, **SETTINGS)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # served by JAX's cache in another thread
        pool.submit(second._executable, small).result()
    second._executable(large)  # its forward afresh, its decide half from JAX's in-process cache: served before
    assert second.executables.stored == 0 and not any(second.executables.root.glob("*"))
    third = Engine(model, **SETTINGS)
    assert [out.token_ids for out in third.generate(PROMPTS, SEEDED)] == reference
    assert third.executables.dropped == 0


def test_an_entry_that_fails_when_run_is_compiled_again(model, cache_root, reference):
    clear(cache_root, jax_entries=True)
    first = Engine(model, **SETTINGS)
    first.generate(PROMPTS, SEEDED)
    buckets = sorted(first.compiled)
    clear(cache_root)
    served = Engine(model, **SETTINGS)
    for bucket in buckets:
        served._executable(bucket)
        compiled = served.compiled[bucket]
        # the bad path: storing executables that JAX's persistent cache served
        served.executables.store(bucket, getattr(compiled, "executables", [compiled]))
    clear(cache_root, executables=False, jax_entries=True)  # so that the recompiles are fresh
    engine = Engine(model, **SETTINGS)
    assert [out.token_ids for out in engine.generate(PROMPTS, SEEDED)] == reference
    assert engine.executables.loaded == len(buckets)
    assert 0 < engine.executables.dropped == engine.executables.stored  # each that failed replaced
    later = Engine(model, **SETTINGS)
    assert [out.token_ids for out in later.generate(PROMPTS, SEEDED)] == reference
    assert later.executables.loaded == len(buckets) and later.executables.dropped == 0


def test_a_failed_engine_frees_its_slots_and_pages_and_health_says_why(model, monkeypatch):
    server = Server(model, ServerConfig(model_name="tiny"), **SETTINGS)
    total = server.engine.layout.num_pages

    def fail(*args, **kwargs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(server.engine, "_dispatch", fail)  # after the scheduler gave the request a slot and pages
    url, stop = serve_in_thread(server.app)
    try:
        reply = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 17, 3], "max_tokens": 4},
                           timeout=60)
        assert reply.status_code == 500 and "the device is gone" in reply.text
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "failed" and "the device is gone" in body["error"]
        assert body["running"] == 0 and body["waiting"] == 0 and body["free_pages"] == total
        assert server.engine.scheduler.free_slots and len(server.engine.scheduler.free_slots) == SETTINGS["max_slots"]
    finally:
        stop()
