"""The executable cache (`serving/core/executable_cache.py`): a second engine over the same cache loads its buckets
without tracing its step and decodes the same tokens; another engine's key misses; an unreadable entry is
compiled again and overwritten."""

import dataclasses
import re

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from model.config import preset
from serving.core import engine as engine_module
from serving.core.engine import Engine
from serving.base.sampling import SamplingParams
from serving.core.step import build_step_halves
from tests.helpers import random_model
from tests.test_structured_engine import tiny  # noqa: F401  (a fixture: V4.1 with a character tokenizer)

CONFIG = preset("tiny")
SETTINGS = {"max_slots": 2, "max_len": 64, "prefill_chunk": 16, "max_prefill_rows": 1}
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """JAX's compile-cache directory set to a fresh one (the executables go to its `jaxseek-executables/`), with
    JAX's own persistent cache off, so that every bucket compiles afresh and is stored."""
    before = jax.config.jax_compilation_cache_dir
    root = tmp_path_factory.mktemp("compile-cache")
    jax.config.update("jax_compilation_cache_dir", str(root))
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield root / "jaxseek-executables"
    jax.config.update("jax_compilation_cache_dir", before)
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


@pytest.fixture
def traced(monkeypatch):
    """The step functions engines trace from now on, by name, as they are traced."""
    names = []

    def build(*args, **kwargs):
        halves = build_step_halves(*args, **kwargs)

        def counted(name, fn):
            def traced_fn(*a):
                names.append(name)
                return fn(*a)
            return traced_fn

        return halves._replace(**{name: counted(name, getattr(halves, name)) for name in ("forward", "decide",
                                                                                          "step")})

    monkeypatch.setattr(engine_module, "build_step_halves", build)
    return names


@pytest.fixture(scope="module")
def model(cache_dir):
    return random_model(CONFIG, seed=3, noise=0.05)


@pytest.fixture(scope="module")
def first(model, cache_dir):
    """A fresh engine that compiled and stored the buckets its greedy run used, and that run's tokens."""
    engine = Engine(model, **SETTINGS)
    tokens = [out.token_ids for out in engine.generate(PROMPTS, GREEDY)]
    assert engine.executables.stored == len(engine.compiled) >= 2 and engine.executables.loaded == 0
    return engine, tokens


def test_a_second_engine_loads_its_buckets_without_tracing(model, first, traced):
    engine = Engine(model, **SETTINGS)
    tokens = [out.token_ids for out in engine.generate(PROMPTS, GREEDY)]
    assert traced == []
    assert engine.executables.loaded == len(engine.compiled) == len(first[0].compiled)
    assert tokens == first[1]


def test_another_layout_or_config_misses(model, first):
    bucket = next(iter(first[0].compiled))
    assert first[0].executables.path(bucket).exists()
    assert Engine(model, **{**SETTINGS, "max_len": 128}).executables.load(bucket) is None
    assert Engine(model, **{**SETTINGS, "num_top_logprobs": 3}).executables.load(bucket) is None
    other = random_model(dataclasses.replace(CONFIG, rms_norm_eps=1e-5), seed=3, noise=0.05)
    assert Engine(other, **SETTINGS).executables.load(bucket) is None


def test_a_truncated_entry_is_compiled_again(model, first, traced):
    bucket = next(iter(first[0].compiled))
    path = first[0].executables.path(bucket)
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2])
    engine = Engine(model, **SETTINGS)
    engine._executable(bucket)
    assert traced and engine.executables.loaded == 0 and engine.executables.stored == 1
    assert engine.executables.load(bucket) is not None  # overwritten whole
    assert [out.token_ids for out in engine.generate(PROMPTS, GREEDY)] == first[1]


def test_constrained_rows_of_a_loaded_bucket_get_their_masks_after_the_tokens_in_flight(cache_dir, tiny):
    """A loaded bucket's first call is waited for (to prove it runs); a decode step with constrained rows still
    fills their token masks after the tokens in flight are read (zero-overhead), so an engine loading its buckets
    gives the regex outputs of the engine that compiled them (before, that first step masked from the grammar
    state one token behind: outputs such as "((" for a parenthesised pattern)."""
    from serving.structured.constraints import ConstraintSpec
    from tests.test_structured_engine import chars_text

    patterns = [r"\((x|y|z){1,5}\)", r"[0-9]{2}:[0-9]{2}", r"[a-c]{3,6}(,[0-9]{1,3}){2}\."]
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    requests = [([3 + i, 9, 4], greedy, ConstraintSpec.regex(p)) for i, p in enumerate(patterns)]
    settings = dict(max_slots=4, max_len=48, page_tokens=16, prefill_chunk=16, max_prefill_rows=2, batch_invariant=True)
    results = []
    for _ in range(2):  # the first engine compiles and stores every bucket, the second loads them
        engine = Engine(tiny, **settings)
        engine.warmup()
        ids = [engine.add_request(p, q, constraint=c) for p, q, c in requests]
        done = engine.run()
        results.append([done[i] for i in ids])
    assert engine.executables.loaded == len(engine.buckets()) and engine.zero_overhead
    for compiled, loaded, pattern in zip(*results, patterns, strict=True):
        assert loaded.token_ids == compiled.token_ids
        assert loaded.finish_reason == "stop" and re.fullmatch(pattern, chars_text(loaded.token_ids))


def test_a_mesh_engine_stores_and_loads_its_sharded_steps(model, first, traced):
    """dp=2,ep=2 (tests/conftest.py's emulated devices): the sharded steps go to the cache under keys of their
    own (the weights' and cache's shardings), and a second mesh engine loads them without tracing and decodes
    the single-device engine's tokens."""
    mesh = Engine(model, mesh="dp=2,ep=2", **SETTINGS)
    assert mesh.executables.load(next(iter(first[0].compiled))) is None
    assert [out.token_ids for out in mesh.generate(PROMPTS, GREEDY)] == first[1]
    assert mesh.executables.stored == len(mesh.compiled) >= 2 and traced
    traced.clear()
    again = Engine(model, mesh="dp=2,ep=2", **SETTINGS)
    assert [out.token_ids for out in again.generate(PROMPTS, GREEDY)] == first[1]
    assert traced == [] and again.executables.loaded == len(again.compiled) == len(mesh.compiled)
