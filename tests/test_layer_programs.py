"""Layer programs (`serving.core.layer_programs`): layers of one structure share a compiled program (kinds as by hand),
a bucket compiles the embedding, one program per kind, the head and the decide half whatever the depth, and the
engine's tokens and logits equal the model's full forward (the reference; tests/test_engine.py checks the same
for the tiny model's default engine, which runs layer programs). Models and settings it does not cover run as one
program, and asking for it there is refused by name."""

import dataclasses

import numpy as np
import pytest

from model.config import preset
from model.replay import Replay
from serving.core.engine import Engine
from serving.base.engine_config import EngineConfig
from serving.core.layer_programs import LayerPlan
from serving.base.sampling import SamplingParams
from tests.helpers import assert_full_forward_tokens, assert_views_alias_their_stacks, random_model
from tests.typecheck import unchecked

# a sliding hash layer, (CSA, HCA) twice, a sliding layer; MTP: one sliding layer
CONFIG = dataclasses.replace(preset("tiny"), num_hidden_layers=6, compress_ratios=(0, 4, 16, 4, 16, 0, 0))
PROMPTS = [np.random.default_rng(4).integers(0, CONFIG.vocab_size, n).tolist() for n in (7, 30)]


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=5, noise=0.05)


def test_layers_of_one_structure_share_a_program_and_the_engine_gives_the_models_tokens(model):
    engine = Engine(model, max_slots=2, max_len=64, page_tokens=16, prefill_chunk=16, batch_invariant=True,
                    return_logits=True)
    # the hash-routed sliding layer 0 and the plain sliding layer 5 differ (a routing table against a gate bias)
    assert engine.layer_plan is not None and engine.layer_plan.kinds == (0, 1, 2, 1, 2, 5)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = engine.generate(PROMPTS, greedy)
    for bucket, compiled in engine.compiled.items():  # embed, 4 kinds, head, decide
        assert len(compiled.executables) == 7, bucket
    assert_full_forward_tokens(outputs, model, PROMPTS, 6)


def test_one_row_decode_reads_the_chosen_experts_where_they_lie(model):
    """A one-row decode bucket (2 pairs, fewer than the 4 experts) passes each layer's expert stacks as views that
    alias the stack, expert by expert (no copy); prefill buckets keep the stacks. Tokens and logits still equal
    the model's full forward."""
    engine = Engine(model, max_slots=1, max_len=64, page_tokens=16, prefill_chunk=16, return_logits=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = engine.generate(PROMPTS, greedy)
    viewed = {bucket for bucket, compiled in engine.compiled.items() if compiled.layered.viewed}
    assert viewed and viewed == {bucket for bucket in engine.compiled if bucket[1] == 1}
    assert len(engine.layer_plan.experts) == 3 * CONFIG.num_hidden_layers  # w1, w2, w3 of every layer
    assert_views_alias_their_stacks(engine.layer_plan, engine.compiled[min(viewed)].layered)
    assert_full_forward_tokens(outputs, model, PROMPTS, 6)


def test_v41_layer_programs_give_the_one_program_steps_numbers():
    """V4.1 (KV and index sources read by later layers, the candidate pool, Engram, mHC `pre` weights): chunked
    prefill past compact replay's keep, then decode, and prompt logprobs through the replay layers, equal the
    same engine compiled as one program. The two ratio-1 replay layers that read layer 3's pools and picks share
    a program."""
    config = dataclasses.replace(preset("tiny-v41"), num_hidden_layers=7, compress_ratios=(0, 2, 2, 1, 1, 1, 1),
                                 kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5),
                                 candidate_source_layer_id=3)
    model = random_model(config, seed=3, noise=0.05)
    prompts = [np.random.default_rng(6).integers(0, config.vocab_size, n).tolist() for n in (40, 21)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    params = [greedy, dataclasses.replace(greedy, prompt_logprobs=0)]
    outputs = []
    for layer_programs in (True, False):
        engine = Engine(model, max_slots=2, max_len=64, page_tokens=16, prefill_chunk=16, batch_invariant=True,
                        return_logits=True, replay=Replay("compact", 12), layer_programs=layer_programs)
        outputs.append(engine.generate(prompts, params))
        if layer_programs:
            assert engine.layer_plan.kinds == (0, 1, 2, 3, 4, 5, 4) and engine.layer_plan.split == 4
            for compiled in engine.compiled.values():  # embed, 6 kinds, enter, leave, head, decide
                assert len(compiled.executables) == 11
    for layered, one in zip(*outputs, strict=True):
        assert layered.token_ids == one.token_ids
        np.testing.assert_allclose(np.stack(layered.logits), np.stack(one.logits), atol=1e-5, rtol=0)
    scored, reference = outputs[0][1].prompt_logprobs, outputs[1][1].prompt_logprobs
    assert scored[0] is None and len(scored) == len(prompts[1])
    np.testing.assert_allclose([entry.logprob for entry in scored[1:]], [entry.logprob for entry in reference[1:]],
                               atol=1e-5, rtol=0)


def test_models_it_does_not_cover_run_as_one_program(model):
    assert Engine(model, max_slots=2, max_len=64, layer_programs=False).layer_plan is None
    shallow = random_model(dataclasses.replace(preset("tiny-v41"), num_hidden_layers=6,
                                               compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layer_ids=(1, 3),
                                               index_source_layer_ids=(1, 3, 5), candidate_source_layer_id=3))
    assert Engine(shallow, max_slots=2, max_len=64).layer_plan is None  # where layer programs do not pay
    assert Engine(shallow, max_slots=2, max_len=64, layer_programs=True).layer_plan is not None
    # on a mesh below 16 layers, V4 too; from 16 layers they pay there (docs/benchmarks.md)
    assert Engine(model, max_slots=2, max_len=64, mesh="dp=2").layer_plan is None
    deep = random_model(dataclasses.replace(CONFIG, num_hidden_layers=16, compress_ratios=(0,) + (4, 16) * 7 + (0, 0)))
    assert LayerPlan.unpaid(deep, ranks=2) is None and LayerPlan.unpaid(model, ranks=2) is not None
    with unchecked(), pytest.raises(ValueError, match="layer_programs must be"):
        EngineConfig(layer_programs="yes")
