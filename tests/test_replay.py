"""Bounded decoder replay in prefill (`model.replay`): mask == compact, the exactness rule against a full
prefill, chunked prefill with a prompt end, keep validation, and the bundled model's state after replay.

The reference is always the full prefill (replay off) of the same model: replay must match it exactly where
the rule in `model.replay` says it is exact (a replay layer at depth d is exact at kept positions
p >= F + d (W - 1); the rings when keep >= `exact_keep`), and must differ where the window was cut. `mask` runs
the prompt as one chunk (one start for the batch); `compact`, its reference's equal, runs it in three chunks
with per-row starts and the prompt end (the engine's path), so one comparison covers both and the chunking.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from model.initialize import init_model
from model.checkpoint import load_model
from model.config import preset
from model.replay import Replay, exact_keep
from tests.helpers import random_model
from tests.typecheck import unchecked

# tiny-v41 cut to 6 layers (compiles faster): 0 sliding, 1-2 a ratio-2 encoder group, 3 the ratio-1 decoder KV
# source (the last layer run on every token), 4-5 replay layers (5 re-indexes inside 3's candidate pool)
TINY = dataclasses.replace(preset("tiny-v41"), num_hidden_layers=6, compress_ratios=(0, 2, 2, 1, 1, 1),
                           kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5), candidate_source_layer_id=3)
W, SPLIT, N = TINY.sliding_window, TINY.n_prefill_layer, TINY.num_hidden_layers
TOKENS = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 63)).astype(np.int32)
KEEP = exact_keep(TINY, W)  # 8 + 1 * 7 = 15: kept positions 48..62
FLOOR = TOKENS.shape[1] - KEEP
CHUNKS = ((0, 21), (21, 42), (42, 63))  # one shape: two chunks before the floor, one straddling it
TAPPED = tuple(range(SPLIT - 1, N))  # the last KV source (the replay layers' input) and every replay layer


@pytest.fixture(scope="module")
def tiny():
    return random_model(TINY, seed=3, noise=0.05)


def forward(model, tokens, replay=None, cache=None, prompt_end=None):
    """(logits, cache, taps of TAPPED [b, c, len(TAPPED), hidden]) of one chunk from `cache` (default empty)."""
    cache = model.init_cache(*TOKENS.shape) if cache is None else cache
    rows, history = model.engram.lookup(tokens, np.asarray(cache["engram_history"]))
    logits, cache, taps = _jitted(model.graphdef, replay)(model.params, tokens, cache, rows, prompt_end)
    return np.asarray(logits), {**cache, "engram_history": history}, np.asarray(taps).reshape(
        *tokens.shape, len(TAPPED), -1)


@functools.cache
def _jitted(graphdef, replay):
    def run(params, tokens, cache, rows, prompt_end):
        return nnx.merge(graphdef, params)(tokens, cache, rows, collect=TAPPED, replay=replay, prompt_end=prompt_end)
    return jax.jit(run)


def chunked(model, replay):
    """`forward` over CHUNKS, each row at its own start with the prompt's end: logits and taps of every chunk
    joined, and the cache after the last."""
    cache, end, parts = model.init_cache(*TOKENS.shape), np.full(2, TOKENS.shape[1], np.int32), []
    cache["pos"] = np.zeros(2, np.int32)
    for a, b in CHUNKS:
        logits, cache, taps = forward(model, TOKENS[:, a:b], replay, cache, end)
        parts.append((logits, taps))
    return np.concatenate([p[0] for p in parts], 1), cache, np.concatenate([p[1] for p in parts], 1)


@pytest.fixture(scope="module")
def runs(tiny):
    return {"off": forward(tiny, TOKENS), "mask": forward(tiny, TOKENS, Replay("mask", KEEP)),
            "compact": chunked(tiny, Replay("compact", KEEP))}


def close(a, b, atol=1e-5):
    return np.allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=0)


def test_mask_and_chunked_compact_agree_on_every_row_and_state(runs):
    (mask_logits, mask_cache, mask_taps), (logits, cache, taps) = runs["mask"], runs["compact"]
    assert close(mask_logits, logits) and close(mask_taps, taps)
    for a, b in zip(jax.tree.leaves(mask_cache["layers"]), jax.tree.leaves(cache["layers"])):
        assert close(a, b)


@pytest.mark.parametrize("mode", ["mask", "compact"])
def test_replay_is_exact_where_the_window_was_not_cut(runs, mode):
    (off_logits, off_cache, off_taps), (logits, cache, taps) = runs["off"], runs[mode]
    assert close(taps[:, :, 0], off_taps[:, :, 0])  # the last KV source runs on every token
    for depth in range(1, N - SPLIT + 1):
        exact_from = FLOOR + depth * (W - 1)
        assert close(taps[:, exact_from:, depth], off_taps[:, exact_from:, depth])
        assert not close(taps[:, FLOOR, depth], off_taps[:, FLOOR, depth], 1e-3)  # its window lost keys
        assert close(taps[:, :FLOOR, depth], taps[:, :FLOOR, 0])  # tokens before the floor skip the layer
    assert close(logits[:, -1], off_logits[:, -1])  # keep = exact_keep: the last position is exact
    for a, b in zip(jax.tree.leaves(cache["layers"]), jax.tree.leaves(off_cache["layers"])):
        assert close(a, b)  # every ring and encoder state, so decode continues as after a full prefill


def test_exact_keep_of_the_released_model():
    # 19 replay layers (21..39), window 128: ring + 18 * 127
    assert exact_keep(preset("v41-flash"), 128 + 6) == 134 + 18 * 127
    assert exact_keep(preset("tiny-v41"), W) == 8 + 2 * 7 and exact_keep(TINY, W) == 15


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "fast"}, "replay mode 'fast' is not one of"),
    ({"keep": 0}, "positive integer"),
    ({"keep": 1.5}, "positive integer"),
])
def test_bad_replay_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Replay(**kwargs)


def test_keep_must_cover_window_and_backtracking(tiny):
    with pytest.raises(ValueError, match=r"keep=7 must be >= window \+ backtracking = 8 \+ 0 = 8"):
        tiny.logits(TOKENS, replay=Replay("compact", 7))
    cache = tiny.init_cache(*TOKENS.shape)
    cache["layers"] = tiny.module().init_cache(*TOKENS.shape, ring=W + 4)["layers"]
    with pytest.raises(ValueError, match=r"keep=10 must be >= window \+ backtracking = 8 \+ 4 = 12"):
        tiny.step(TOKENS, cache, replay=Replay("mask", 10))
    with pytest.raises(ValueError, match="replay must be a model.replay.Replay, got 'compact'"), unchecked():
        tiny.logits(TOKENS, replay="compact")
    with pytest.raises(ValueError, match="needs a causal encoder-decoder"):
        init_model(preset("tiny")).logits(TOKENS[:, :4], replay=Replay("mask"))


# ---- the bundled model: one replay layer (3), window 32 --------------------------------------------------

PROMPTS, PROMPT_LEN = 8, 400


def test_bundled_model_continues_alike_after_replay():
    """Replay's prefill leaves every cache leaf as a full prefill does (to 1e-4), so decode, greedy or sampled,
    continues alike from there for any number of tokens (measured: 8 prompts x 16 greedy tokens all agree)."""
    model = load_model()
    text = (__import__("pathlib").Path(__file__).parent / "data" / "heldout_slice.txt").read_text(encoding="utf-8")
    ids = np.asarray(model.tokenizer.encode(text), np.int32)
    prompts = np.stack([ids[i * 190:i * 190 + PROMPT_LEN] for i in range(PROMPTS)])
    (off_prefill, off_cache), (on_prefill, on_cache) = (
        model.step(prompts, model.init_cache(PROMPTS, PROMPT_LEN + 16), replay=replay)
        for replay in (None, Replay("compact")))
    off_prefill, on_prefill = np.asarray(off_prefill), np.asarray(on_prefill)
    floor = PROMPT_LEN - Replay().keep
    assert np.abs(on_prefill[:, floor] - off_prefill[:, floor]).max() > 1e-2  # the cut window shows
    # one replay layer: exact from floor + W - 1 on, and its ring holds exact keys, so decode is too
    exact = floor + model.config.sliding_window - 1
    assert np.abs(on_prefill[:, exact:] - off_prefill[:, exact:]).max() < 1e-4
    for on, off in zip(jax.tree.leaves(on_cache), jax.tree.leaves(off_cache)):
        assert np.abs(np.asarray(on, np.float64) - np.asarray(off, np.float64)).max() < 1e-4
