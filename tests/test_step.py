"""The compiled step's verify buckets against the plain model: a verify row [last token, drafts] takes its
tokens and start from the slot on the device, is sampled at every position with the drafts before a position
counted as its outputs, commits the accepted drafts and the final token, and the next step continues from
the right position."""

import jax
import numpy as np
import pytest

from model.initialize import init_model
from model.dspark import init_drafter
from serving.base.kv_cache import CacheLayout, PageAllocator, init_engine_cache
from serving.base.sampling import SamplingBatch, SamplingParams
from serving.core.step import COUNTED, PROMPT, DrafterSpec, build_step_halves, compile_halves, empty_batch
from tests.test_dspark import CONFIG, TARGET

PENALTY = -2.0  # a frequency *bonus*: drafted tokens win the later positions, so miscounting shows
REF_LEN = 16  # the reference forward's one padded length (the model is causal)


def full_logits(model, sequence: list[int]) -> np.ndarray:
    """The full-sequence forward's logits [len(sequence), V], run padded to REF_LEN (one compilation)."""
    padded = np.zeros((1, REF_LEN), np.int32)
    padded[0, :len(sequence)] = sequence
    return np.asarray(model.logits(padded))[0, :len(sequence)]


@pytest.fixture(scope="module")
def setup():
    model = init_model(TARGET, seed=2)
    drafter = init_drafter(TARGET, CONFIG, seed=4)
    layout = CacheLayout.for_model(TARGET, max_slots=2, max_len=64, page_tokens=16, backtrack=CONFIG.block_size + 1)
    module, draft_module = model.module(), drafter.module()
    empty = module.init_cache(1, layout.pages_per_slot * layout.page_tokens, layout.ring)["layers"]
    spec = DrafterSpec(drafter.graphdef, jax.tree.structure(drafter.params), draft_module.init_state(1),
                       CONFIG.target_layer_ids)
    halves = build_step_halves(model.graphdef, jax.tree.structure(model.params), empty, 2, True,
                               spec)
    step = jax.jit(halves.step, donate_argnums=1, static_argnums=3)
    pages = PageAllocator(layout)
    pages.grow(0, layout.max_len)
    weights = (jax.tree.leaves(model.params), jax.tree.leaves(drafter.params))
    return model, layout, step, weights, pages.table(0), init_engine_cache(module, layout, draft_module), halves


def copied(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def _row(layout, table, width, tokens, kinds, start, params, caps=0, **flags):
    batch = empty_batch(layout, 1, width)
    n = len(tokens)
    batch.tokens[0, :n], batch.kinds[0, :n] = tokens, kinds
    batch.slots[0], batch.starts[0], batch.counts[0], batch.block_tables[0] = 0, start, n, table
    batch.sample[0], batch.caps[0], batch.budget[...] = True, caps, caps
    batch.reset[0], batch.from_prev[0] = flags.get("reset", False), flags.get("from_prev", False)
    return batch._replace(sampling=SamplingBatch.from_params([params], 1))


@pytest.mark.parametrize("caps", [0, 1, 3])
def test_verify_row_checks_its_drafts_against_the_penalised_argmax(setup, caps):
    model, layout, step, weights, table, fresh, _ = setup
    cache = copied(fresh)
    prompt = np.random.default_rng(caps).integers(0, TARGET.vocab_size, 11).tolist()
    params = SamplingParams(temperature=0.0, frequency_penalty=PENALTY, seed=0)
    out, cache = step(weights, cache, _row(layout, table, 16, prompt, [PROMPT] * 11, 0, params, reset=True), 1)
    first, drafts = int(out.tokens[0, 0]), np.asarray(out.next_drafts[0]).tolist()
    out, cache = step(weights, cache, _row(layout, table, 4, [0], [COUNTED], 0, params, caps, from_prev=True), 4)

    block = [first] + drafts[:caps]
    logits = full_logits(model, prompt + block)[11:]
    np.testing.assert_allclose(np.asarray(out.logits[0, :caps + 1]), logits, rtol=1e-4, atol=1e-4)
    counts = np.zeros((caps + 1, TARGET.vocab_size))
    counts[:, first] += 1
    for j in range(caps + 1):
        counts[j, drafts[:j]] += 1  # drafts at row positions 1..j precede position j's token
    argmax = np.argmax(logits - PENALTY * counts, axis=-1)
    accepted = 0
    while accepted < caps and drafts[accepted] == argmax[accepted]:
        accepted += 1
    assert int(out.accepted[0]) == accepted and int(out.verified[0]) == caps
    emitted = drafts[:accepted] + [int(argmax[accepted])]
    assert np.asarray(out.tokens[0, :accepted + 1]).tolist() == emitted

    # the next decode row starts after the committed tokens, with them counted as outputs
    out, cache = step(weights, cache, _row(layout, table, 1, [0], [COUNTED], 0, params, from_prev=True), 1)
    sequence = prompt + [first] + emitted
    expected = full_logits(model, sequence)[-1]
    np.testing.assert_allclose(np.asarray(out.logits[0, 0]), expected, rtol=1e-4, atol=1e-4)
    outputs = np.bincount([first] + emitted, minlength=TARGET.vocab_size)
    assert int(out.tokens[0, 0]) == int(np.argmax(expected - PENALTY * outputs))


def test_the_step_in_halves_is_the_step_in_one(setup):
    """The engine runs decode / verify buckets as a forward half and a decide half, filling token masks in
    between: a masked, sampled, penalised verify row gives the one-function step's outputs and cache, bit for
    bit."""
    model, layout, step, weights, table, fresh, halves = setup
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5, seed=7)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, TARGET.vocab_size, 9).tolist()
    _, cache = step(weights, copied(fresh), _row(layout, table, 16, prompt, [PROMPT] * 9, 0, params, reset=True), 1)
    batch = _row(layout, table, 4, [0], [COUNTED], 0, params, 3, from_prev=True)
    masks = rng.integers(-2**31, 2**31, batch.bitmask.shape, dtype=np.int64).astype(np.int32)  # half the tokens
    batch = batch._replace(bitmask=masks)
    one, one_cache = step(weights, copied(cache), batch, 4)
    two, two_cache = compile_halves(halves, weights, cache, batch, 4)(weights, copied(cache), batch)
    assert int(one.accepted[0]) < 3  # rejection under the mask: the residual draw and the drafter both ran
    caches = [(jax.tree_util.keystr(path), a, b) for (path, a), b in
              zip(jax.tree_util.tree_leaves_with_path(one_cache), jax.tree.leaves(two_cache))]
    for name, a, b in [*zip(one._fields, one, two), *caches]:
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
