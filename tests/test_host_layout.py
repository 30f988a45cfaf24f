"""The CPU host layout (`model.host_layout`): an engine with `host_layout=True` holds the model's linear maps and
expert stacks transposed, in place, and still gives the tokens and logits of the same model in the checkpoint
layout (its full forward: the reference); the checkpoint tensors come back unchanged; settings it cannot serve
are refused."""

import dataclasses

import numpy as np
import pytest

from model.checkpoint import to_native
from model.config import preset
from model.host_layout import checkpoint_layout, has_host_layout, host_layout
from model import registry
from serving.core.engine import Engine
from serving.base.engine_config import EngineConfig
from serving.base.sampling import SamplingParams
from tests.helpers import assert_full_forward_tokens, assert_views_alias_their_stacks, random_model
from tests.typecheck import unchecked

CONFIG = dataclasses.replace(preset("tiny"), num_hidden_layers=6, compress_ratios=(0, 4, 16, 4, 16, 0, 0))
PROMPTS = [np.random.default_rng(4).integers(0, CONFIG.vocab_size, n).tolist() for n in (7, 30)]


def test_an_engine_on_the_host_layout_gives_the_checkpoint_layouts_tokens():
    """Two rows (7 and 30 prompt tokens, chunks of 16): the short row decodes alone for a step (a one-row bucket,
    whose transposed stacks come as per-expert views aliasing them), then both decode together (every token
    through every expert). Tokens and logits equal the unconverted model's full forward."""
    reference, held = random_model(CONFIG, seed=5, noise=0.05), random_model(CONFIG, seed=5, noise=0.05)
    engine = Engine(held, max_slots=2, max_len=64, page_tokens=16, prefill_chunk=16, return_logits=True,
                    host_layout=True)
    assert has_host_layout(held) and host_layout(held) == 0  # done once, in place
    assert len(engine.layer_plan.experts) == 3 * CONFIG.num_hidden_layers
    outputs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    viewed = [compiled.layered for compiled in engine.compiled.values() if compiled.layered.viewed]
    assert viewed
    assert_views_alias_their_stacks(engine.layer_plan, viewed[0])
    assert_full_forward_tokens(outputs, reference, PROMPTS, 6)
    expected, got = to_native(reference), to_native(held)
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert not has_host_layout(checkpoint_layout(held)) and has_host_layout(held)


def test_settings_the_host_layout_cannot_serve_are_refused():
    model = random_model(CONFIG, seed=5)
    with registry.use("pallas"), pytest.raises(ValueError, match="host_layout=True is the CPU backend's"):
        Engine(model, max_slots=1, max_len=64, host_layout=True)
    assert not has_host_layout(model)  # refused before anything changed
    with registry.use("pallas"):
        assert not EngineConfig().uses_host_layout  # the default: only where it applies
    with pytest.raises(ValueError, match="host_layout=True is for a single-device CPU engine"):
        EngineConfig(mesh="dp=2", host_layout=True)
    with unchecked(), pytest.raises(ValueError, match="host_layout must be True, False or None"):
        EngineConfig(host_layout="yes")
