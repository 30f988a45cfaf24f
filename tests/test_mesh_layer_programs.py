"""Layer programs on a mesh (`serving.core.layer_programs` lowered by `serving.core.engine_dp`: each program and the decide half
a `shard_map` program of its own) against the single-device engine, on emulated CPU devices (tests/conftest.py):
V4.1 with compact replay, prompt logprobs and EPLB over `ep`; V4 with the prefix cache, a host tier and MTP
speculation, its expert loads counted layer by layer; DSpark with structured outputs on `dp` alone. Greedy tokens
are compared exactly, logits within 1e-5."""

import dataclasses
import re

import numpy as np
import pytest

from model.config import preset
from model.replay import Replay
from serving.core.engine import Engine
from serving.core.layer_programs import layer_program_names
from serving.base.sampling import SamplingParams
from tests.helpers import random_model
from tests.test_engine_mesh import ENGINE, GREEDY, V41, same_outputs
from tests.test_structured_engine import tiny  # noqa: F401  (a fixture: V4.1 with a DSpark drafter)

RNG = np.random.default_rng(11)


def test_v41_layer_programs_on_dp_and_ep_with_eplb_equal_one_device():
    """dp=2,ep=2, compact replay past its keep, an idle rank in some steps (the replay layers' `lax.cond`, whose
    branch holds an all-to-all, is taken by both ranks), EPLB moving experts between steps: tokens, logits and
    prompt logprobs are the single-device engine's one program. Each bucket is embed, 6 kinds, enter, leave,
    head and decide, then the gather."""
    model = random_model(V41, seed=3, noise=0.05)
    prompts = [RNG.integers(0, V41.vocab_size, n).tolist() for n in (5, 40, 9)]
    scored = dataclasses.replace(GREEDY, prompt_logprobs=0)
    params = [GREEDY, scored, GREEDY]
    config = ENGINE | dict(max_len=64, replay=Replay("compact", 12))
    single = Engine(model, layer_programs=False, **config).generate(prompts, params)
    engine = Engine(model, mesh="dp=2,ep=2", layer_programs=True, redundant_experts=2, eplb_every=3, **config)
    outputs = engine.generate(prompts, params)
    same_outputs(outputs, single)
    got, want = ([e.logprob for e in o.prompt_logprobs[1:]] for o in (outputs[1], single[1]))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert engine.layer_plan.split == 4 and engine.stats["eplb_rebalances"] >= 1
    names = layer_program_names(engine.layer_plan)
    assert names[-3:] == ["enter", "leave", "head"] and len(names) == 10
    for compiled in engine.compiled.values():
        assert len(compiled.halves.executables) == len(names) + 1


def test_v4_layer_programs_with_prefix_cache_and_mtp_on_a_mesh_equal_one_plain_device():
    """dp=2,ep=2 with the prefix cache (a hit from a host tier) and fixed speculation by V4's MTP drafter: the
    tokens and logits of a single plain device. Each layer program counts its layer's (token, expert) pairs:
    every V4 layer routes the step's every token, so each layer's count is the same total, top-k per token."""
    v4 = preset("tiny")
    model = random_model(v4, seed=5, noise=0.05)
    shared = RNG.integers(0, v4.vocab_size, 32).tolist()
    prompts = [shared + RNG.integers(0, v4.vocab_size, n).tolist() for n in (4, 3)]
    single = Engine(model, **ENGINE).generate(prompts, GREEDY)
    engine = Engine(model, mesh="dp=2,ep=2", layer_programs=True, prefix_cache=True, host_pages=4,
                    speculation="fixed", num_drafts=1, **ENGINE)
    first = engine.generate(prompts[:1], GREEDY)
    assert engine.scheduler.prefix.ranks[0].evict(2) == 2  # to rank 0's host tier
    outputs = first + engine.generate(prompts[1:], GREEDY)
    same_outputs(outputs, single)
    assert engine.prefix_cache_metrics()["host_restored"] == 2
    assert engine.speculation_metrics()["verified_per_step"] > 0
    placement = engine.placement
    placement._record(placement._previous + placement._loads)  # the steps not recorded yet
    loads = placement._static_load
    assert loads.shape == (v4.num_hidden_layers, v4.n_routed_experts)
    per_layer = loads.sum(axis=1)
    assert per_layer[0] > 0 and (per_layer == per_layer[0]).all() and per_layer[0] % v4.num_experts_per_tok == 0


def test_dspark_and_structured_outputs_as_layer_programs_on_dp_equal_one_device(tiny):  # noqa: F811
    """dp=2 (experts whole on each rank) with DSpark under a cost table where verifying pays and regex-constrained
    rows beside an unconstrained one: the tokens are the single-device DSpark engine's, drafts are verified and
    each constrained output matches its pattern."""
    from serving.structured.constraints import ConstraintSpec
    from serving.speculation.verify_plan import CostTable
    from tests.test_structured_engine import chars_text

    patterns = [r"[a-c]{3,6}(,[0-9]{1,3}){2}\.", r"[0-9]{2}:[0-9]{2}"]
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    requests = [(RNG.integers(0, tiny.config.vocab_size, 7).tolist(), greedy, ConstraintSpec.regex(p))
                for p in patterns] + [([5, 6, 7], GREEDY, None)]
    config = dict(max_slots=4, max_len=48, page_tokens=16, prefill_chunk=16, max_prefill_rows=2, batch_invariant=True,
                  speculation="dspark", verify_widths=(2, 4), num_drafts=3)
    results = []
    for mesh in (None, "dp=2"):
        engine = Engine(tiny, mesh=mesh, layer_programs=mesh is not None, **config)
        engine.speculation.costs = CostTable({(r, w): 1.0 if w < 2 else 1.6 for r in engine.decode_rows
                                              for w in (0, 1) + engine.speculation.verify_widths}, window=0)
        ids = [engine.add_request(p, q, constraint=c) for p, q, c in requests]
        done = engine.run()
        results.append([done[i] for i in ids])
    assert engine.layer_plan is not None
    for single, meshed in zip(*results, strict=True):
        assert meshed.token_ids == single.token_ids and meshed.finish_reason == single.finish_reason
    for pattern, out in zip(patterns, results[1]):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, chars_text(out.token_ids))
    assert engine.speculation_metrics()["verified_per_step"] > 0
