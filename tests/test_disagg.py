"""Prefill / decode disaggregation: a prefill engine in a separate process hands each request's cache state to the
decode engine here; tokens, logprobs and finish reasons equal the single engine's, over prompts longer than the
sliding window and a page, greedy and seeded sampling with penalties, and a request that ends at its first
token. A prefill process killed mid-prompt leaves its requests to the decode engine, which finishes them alike.
V4.1's asymmetric split (the prefill part alone prefills each prompt's head) equals a single engine too."""

import contextlib
import re

import jax
import jax.numpy as jnp
import pytest

from model import load_model
from serving.structured.constraints import ConstraintSpec
from serving.core.engine import Engine
from serving.base.sampling import SamplingParams

# the engine tests/test_server.py and the router's replicas run, so the persistent compile cache serves all three
ENGINE = dict(max_slots=2, max_len=96, prefill_chunk=8, batch_invariant=True, num_top_logprobs=5)
TEXTS = ["ROMEO:\n", "KING HENRY:\nOnce more unto the breach, dear friends, once more; Or close the wall up with our "
         "English dead. In peace there's nothing so becomes a man As modest stillness and humility: But when the blast "
         "of war blows in our ears, Then imitate the action of the tiger;",
         "HAMLET:\nTo be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
         "JULIET:\nO Romeo, Romeo, wherefore art thou"]
PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, seed=1, logprobs=2),
          SamplingParams(max_tokens=10, temperature=1.0, seed=2),
          SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.5,
                         seed=3),
          SamplingParams(max_tokens=1, temperature=1.0, seed=4)]


@pytest.fixture(scope="module")
def setup():
    model = load_model()
    engine = Engine(model, detokenize=model.tokenizer.decode, **ENGINE)
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    assert max(map(len, prompts)) > max(model.config.sliding_window, engine.layout.page_tokens)
    return model, engine, prompts, engine.generate(prompts, PARAMS)


def clobber(engine):
    """Fill every slot's and page's state with garbage, so only what a hand-off installs can be right."""
    def junk(x):
        return jnp.full_like(x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.full_like(x, 3)

    engine.cache = jax.tree.map(junk, engine.cache)


def same(a, b):
    assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
    assert (a.logprobs is None) == (b.logprobs is None)
    for x, y in zip(a.logprobs or [], b.logprobs or []):
        assert x.token == y.token and x.logprob == pytest.approx(y.logprob, abs=1e-5)


def handed_off(engine, prompt, params, request_id=None):
    """The hand-off of a request `engine` (zero-overhead scheduling off, or batch-invariant) ran to its first
    token; its slot, pages and id are free again, as the prefill process leaves them."""
    rid = engine.add_request(prompt, params, request_id)
    while not engine.requests[rid].output:
        engine.step()
    state = engine.export_slot(rid)
    engine.cancel(rid)
    engine.run()
    engine.requests.pop(rid)
    return state


def test_handoff_within_a_process_continues_exactly(setup):
    """Export after the first token from one engine, import into another slot state of the same engine."""
    model, engine, prompts, reference = setup
    state = handed_off(engine, prompts[2], PARAMS[2])
    clobber(engine)
    state.request_id = "moved"
    assert engine.import_slot(state)
    [out] = engine.run().values()
    same(out, reference[2])
    free = engine.scheduler.pages
    assert len(free.free) == engine.layout.num_pages and not free.owned


@pytest.fixture(scope="module")
def pd_server(setup):
    """A server whose engine prefills in a spawned process (its HTTP app not started yet)."""
    from serving.api.server import Server, ServerConfig

    with spawn_env():
        server = Server(setup[0], ServerConfig(model_name="bundled", disaggregate=True), **ENGINE)
    yield server
    server.engine.close()


@contextlib.contextmanager
def spawn_env():
    """conftest's JAX settings, for a spawned prefill process."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in (("JAX_NUM_CPU_DEVICES", "8"), ("JAX_DEFAULT_MATMUL_PRECISION", "highest"),
                            ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")):
            env.setenv(name, value)
        yield


def test_prefill_process_hands_off_to_decode_engine(setup, pd_server):
    _, _, prompts, reference = setup
    pd = pd_server.engine
    clobber(pd.engine)
    ids = [pd.add_request(p, q) for p, q in zip(prompts, PARAMS)]
    with pytest.raises(ValueError, match="exceeds the engine's max_len"):  # refused by the prefill engine
        pd.add_request(prompts[1], SamplingParams(max_tokens=40))
    dropped = [pd.add_request(prompts[0], SamplingParams(max_tokens=20)) for _ in range(2)]
    pd.cancel(dropped[0])  # still in the prefill process
    results = {}
    while pd.has_work:
        for output in pd.step():
            results[output.request_id] = output
        if dropped[1] in pd.requests and dropped[1] not in results:
            pd.cancel(dropped[1])  # decoding here
    for rid, expected in zip(ids, reference):
        same(results[rid], expected)
    assert dropped[0] not in results and results[dropped[1]].finish_reason == "cancelled"
    assert pd.handoff_bytes > 0 and not pd.in_prefill and not pd.cancelled
    assert pd.scheduler.pages.idle() == pd.layout.num_pages


def test_constrained_request_across_the_handoff(setup, pd_server):
    """The prefill process samples the first token under the constraint; the decode engine rebuilds the grammar
    state and continues as a single engine does."""
    model, engine, prompts, _ = setup
    spec, params = ConstraintSpec.regex("[A-Z][a-z]+(, [a-z]+)* [a-z]+[.!?]"), SamplingParams(max_tokens=14, seed=5)
    rid = engine.add_request(prompts[0], params, constraint=spec)
    expected = engine.run()[rid]
    pd = pd_server.engine
    rid = pd.add_request(prompts[0], params, constraint=spec)
    [out] = pd.run().values()
    same(out, expected)
    assert out.finish_reason == "stop" and re.fullmatch("[A-Z][a-z]+(, [a-z]+)* [a-z]+[.!?]", out.text)
    with pytest.raises(ValueError, match="regex"):  # refused by the prefill engine's compiler
        pd.add_request(prompts[0], params, constraint=ConstraintSpec.regex("(unclosed"))


def test_server_with_a_prefill_process(setup, pd_server):
    """`jaxseek serve --disaggregate`: the same texts over HTTP, streamed or not."""
    import dataclasses

    import openai

    from serving.api.server import serve_in_thread

    _, _, prompts, reference = setup
    url, stop = serve_in_thread(pd_server.app)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    default = SamplingParams()
    try:
        for prompt, params, expected in list(zip(prompts, PARAMS, reference))[:3]:
            fields = {k: v for k, v in dataclasses.asdict(params).items() if v != getattr(default, k)}
            fields.pop("logprobs", None)
            r = client.completions.create(model="bundled", prompt=prompt, extra_body=fields)
            assert r.choices[0].text == expected.text
            chunks = client.completions.create(model="bundled", prompt=prompt, stream=True, extra_body=fields)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    finally:
        stop()  # the app's shutdown stops the engine loop and the prefill process
    assert not pd_server.engine.process.is_alive()


def test_a_killed_prefill_process_leaves_its_requests_to_the_decode_engine(setup):
    """The prefill process killed while it prefills the two long prompts (many chunks each, so no hand-off is on
    its way): each still finishes with the single engine's tokens, logprobs and text, prefilled by the decode
    engine instead, and so do the requests sent after; no page stays taken."""
    from serving.api.disagg import DisaggregatedEngine

    model, _, prompts, reference = setup
    with spawn_env():
        pd = DisaggregatedEngine(Engine(model, detokenize=model.tokenizer.decode, **ENGINE),
                                 compile_cache=jax.config.jax_compilation_cache_dir)
    killed_mid_prompt(pd, pd.process.kill, prompts, reference)
    assert pd.failure.startswith("the prefill process exited")


def killed_mid_prompt(pd, kill, prompts, reference) -> None:
    """`kill` the prefill side of `pd` while it prefills the two long prompts (many chunks each, so no hand-off is
    on its way): each finishes with the single engine's output, prefilled by the decode engine instead, and so do
    the requests sent after; no page stays taken. Closes `pd`."""
    try:
        long = [1, 2]
        ids = [pd.add_request(prompts[i], PARAMS[i]) for i in long]
        kill()
        results = pd.run()
        assert pd.retried == 2
        later = [pd.add_request(prompts[i], PARAMS[i]) for i in (0, 3)]
        results |= pd.run()
        for rid, i in zip(ids + later, long + [0, 3]):
            same(results[rid], reference[i])
        assert pd.scheduler.pages.idle() == pd.layout.num_pages and not pd.in_prefill
    finally:
        pd.close()


def test_a_prefill_process_that_cannot_start_says_why(setup, tmp_path):
    from serving.api.disagg import DisaggregatedEngine

    model = setup[0]
    with spawn_env(), pytest.raises(RuntimeError, match="the prefill process did not start: .*Error: .*missing"):
        DisaggregatedEngine(Engine(model, **ENGINE), model_path=tmp_path / "missing")


def test_prefill_and_decode_on_meshes_of_different_shapes(setup):
    """Prefill on dp=2 (each rank holds every expert), decode on dp=2,ep=2 (experts split over the ranks): a
    hand-off leaves a rank of the prefill mesh for the decode engine's least loaded rank; tokens, logprobs and text
    are the single engine's, and a malformed prefill mesh is refused before any process starts."""
    from serving.api.disagg import DisaggregatedEngine

    model, _, prompts, reference = setup
    decode = Engine(model, detokenize=model.tokenizer.decode, mesh="dp=2,ep=2", **ENGINE)
    with pytest.raises(ValueError, match="unknown mesh axis 'dq'"):
        DisaggregatedEngine(decode, prefill_mesh="dq=2")
    with spawn_env():
        pd = DisaggregatedEngine(decode, compile_cache=jax.config.jax_compilation_cache_dir, prefill_mesh="dp=2")
    try:
        ids = [pd.add_request(p, q) for p, q in zip(prompts, PARAMS)]
        results = pd.run()
        for rid, expected in zip(ids, reference):
            same(results[rid], expected)
        assert pd.prefill_layout == "2 attention rank(s), experts over 1 shard(s)"
        assert pd.handoff_bytes > 0 and pd.failure is None
        assert pd.scheduler.pages.idle() == pd.layout.num_pages
    finally:
        pd.close()


# V4.1's asymmetric split: the decode engine prefills each prompt's last `keep` tokens through every layer
ASYMMETRIC = dict(max_slots=2, max_len=96, prefill_chunk=8, num_top_logprobs=5, speculation="fixed")
KEEP = 40  # the bundled model's ring is 32 + 6 backtracking slots: prompts of 41 tokens or more are split


@pytest.fixture(scope="module")
def asymmetric(setup):
    """A single engine on one device with bounded replay of KEEP tokens and DSpark (no prefix cache: a clobbered
    cache holds no prefix), and its outputs."""
    from model.replay import Replay

    model, _, prompts, _ = setup
    engine = Engine(model, detokenize=model.tokenizer.decode, replay=Replay("compact", KEEP), prefix_cache=False,
                    **ASYMMETRIC)
    prompts = [prompts[0], prompts[1], prompts[2] + prompts[1][:30], prompts[3]]
    assert [len(p) > KEEP for p in prompts] == [False, True, True, False]
    return engine, prompts, engine.generate(prompts, PARAMS)


def test_a_partial_handoff_continues_as_a_single_engine(setup, asymmetric):
    """The prefill part alone (`load_model(part="prefill")`) prefills a prompt's head; its layers' state, imported
    into a clobbered engine, prefills the tail through every layer and decodes the single engine's tokens,
    logprobs and text. A state of another layout is refused."""
    import dataclasses

    model = setup[0]
    engine, prompts, reference = asymmetric
    part = load_model(part="prefill")
    assert part.config.num_hidden_layers == model.config.n_prefill_layer < model.config.num_hidden_layers
    assert part.drafter is None
    prefill = Engine(part, zero_overhead=False, backtrack=engine.layout.ring - model.config.sliding_window,
                     max_slots=2, max_len=96, prefill_chunk=8)
    head = prompts[1][:len(prompts[1]) - KEEP]
    state = handed_off(prefill, head, SamplingParams(max_tokens=2, ignore_eos=True))
    state = dataclasses.replace(state, request_id="tail", prompt=prompts[1], params=PARAMS[1], output=[],
                                logprobs=[], slot={})
    assert state.partial and state.computed == len(head)
    swapped = dataclasses.replace(state, request_id="swapped", layers=state.layers[::-1])
    with pytest.raises(ValueError, match="not laid out as this engine's first 3"):
        engine.import_slot(swapped)
    clobber(engine)
    assert engine.import_slot(state)
    same(engine.run()["tail"], reference[1])
    assert engine.scheduler.pages.idle() == engine.layout.num_pages


def test_asymmetric_split_across_meshes(setup, asymmetric):
    """`--pd-split asymmetric`, prefill on dp=2 (the prefill part, its prefix cache on), decode on dp=2,ep=2 with
    DSpark: every request equals the single engine's (two are split, one is too short and one asks for prompt
    logprobs: both prefill on the decode side). The prefill process holds fewer weight bytes than the whole model
    and hands over less. Then the prefill process is killed with two split prompts in it: the decode engine
    prefills them whole, with the same outputs."""
    import dataclasses

    from model.replay import Replay
    from serving.api.disagg import DisaggregatedEngine
    from serving.api.server import Server, ServerConfig

    model = setup[0]
    engine, prompts, reference = asymmetric
    with pytest.raises(ValueError, match="needs --disaggregate"):
        Server(model, ServerConfig(pd_split="asymmetric"))
    decode = Engine(model, detokenize=model.tokenizer.decode, mesh="dp=2,ep=2", replay=Replay("compact", KEEP),
                    **ASYMMETRIC)
    with pytest.raises(ValueError, match="must be one of"):
        DisaggregatedEngine(decode, split="sideways")
    with spawn_env():
        pd = DisaggregatedEngine(decode, compile_cache=jax.config.jax_compilation_cache_dir, prefill_mesh="dp=2",
                                 split="asymmetric")
    try:
        with pytest.raises(ValueError, match="exceeds the engine's max_len"):  # refused here: the head would fit
            pd.add_request(prompts[1], SamplingParams(max_tokens=40))
        scored = dataclasses.replace(PARAMS[0], prompt_logprobs=2)
        rid = engine.add_request(prompts[2], scored)
        expected_scored = engine.run()[rid]
        ids = [pd.add_request(p, q) for p, q in zip(prompts, PARAMS)] + [pd.add_request(prompts[2], scored)]
        assert len(pd.in_prefill) == 2  # the short prompt and the scored one went to the decode engine
        results = pd.run()
        for rid, expected in zip(ids, reference + [expected_scored]):
            same(results[rid], expected)
        for x, y in zip(results[ids[-1]].prompt_logprobs[1:], expected_scored.prompt_logprobs[1:], strict=True):
            assert x.token == y.token and x.logprob == pytest.approx(y.logprob, abs=1e-5)
        whole = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
        assert 0 < pd.prefill_weight_bytes < whole and pd.handoff_bytes > 0
        assert pd.scheduler.pages.idle() == pd.layout.num_pages
        late = [pd.add_request(prompts[i], PARAMS[i]) for i in (1, 2)]
        pd.process.kill()
        results = pd.run()
        # a head of 4 chunks may have been handed over before the kill: at least the other is taken over
        assert pd.failure.startswith("the prefill process exited") and pd.retried in (1, 2)
        for rid, i in zip(late, (1, 2)):
            same(results[rid], reference[i])
        assert pd.scheduler.pages.idle() == pd.layout.num_pages
    finally:
        pd.close()
