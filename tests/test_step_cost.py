"""The work a decode step needs (`model.step_cost`), against figures computed by hand for the tiny preset:
layers (sliding, CSA ratio 4, HCA ratio 16, CSA ratio 4), window 8, 4 heads of 32, indexer 16 heads of 16,
top-4, 2 of 4 experts."""

import pytest

from model.config import preset
from model.step_cost import attention_cost, expected_experts_hit, weight_cost

TINY = preset("tiny")


def test_attention_cost_by_hand():
    # position 40: 41 tokens, window 8; CSA: 10 visible entries, 4 picked; HCA: 2 visible entries
    flops = 4 * 4 * 32 * 8 + 2 * (2 * 16 * 16 * 10 + 4 * 4 * 32 * 12) + 4 * 4 * 32 * 10
    state = 8 * 32 * 4 + 2 * (10 * 16 * 4 + 12 * 32 * 4) + 10 * 32 * 4
    assert attention_cost(TINY, 2, 40) == {"flops": 2 * flops, "bytes": 2 * state}


def test_experts_hit_and_weights_per_row():
    assert expected_experts_hit(TINY, 1) == 2 and expected_experts_hit(TINY, 64) == pytest.approx(4)
    one, two = weight_cost(TINY, 1), weight_cost(TINY, 2)
    assert two["flops"] == 2 * one["flops"]
    # a second row reads one more embedding row and, in expectation, 1 / 2 more of each layer's experts
    expert_bytes = 3 * 64 * 32 * 4  # w1, w2, w3 of one expert, fp32
    embed_row = 64 * 4
    layers_with_experts = TINY.num_hidden_layers
    extra_hash_row = 2 * 4 * TINY.num_hash_layers  # tid2eid: k int32 per token in each hash layer
    assert two["bytes"] - one["bytes"] == pytest.approx(
        embed_row + extra_hash_row + layers_with_experts * (expected_experts_hit(TINY, 2) - 2) * expert_bytes)


def test_v41_attention_cost_by_hand():
    """tiny-v41 at position 40 (41 tokens, window 8, 4 heads of 32, indexer 16 heads of 16, top-6): layers 0-1
    sliding; the ratio-2 encoder (sources 2 and 4 index their 20 visible keys, layer 3 reuses layer 2's picks);
    the ratio-1 decoder (layer 5, the candidate source, scores all 41 keys; re-index layer 7 only the pool's
    3 blocks x 4 positions; layers 6 and 8 reuse). Every compressed layer attends its window and 6 picks."""
    config = preset("tiny-v41")
    keys, scored = 2 * 8 + 7 * (8 + 6), 20 + 20 + 41 + 12
    flops = 4 * 4 * 32 * keys + 2 * 16 * 16 * scored
    state = keys * 32 * 4 + scored * 16 * 4
    assert attention_cost(config, 3, 40) == {"flops": 3 * flops, "bytes": 3 * state}


@pytest.mark.parametrize("layout", ["checkpoint", "host"])
def test_step_products_do_the_counted_flops(layout):
    """The benchmark's program of a step's weight products alone (`benchmarks.step_products`) does the FLOPs
    `weight_cost` counts, as XLA counts them in the compiled program (its few scalar ops aside): one row
    through two of the four experts of each stack, 16 rows as 8 through every expert."""
    from benchmarks.step_products import StepProducts
    from model.host_layout import host_layout
    from model.initialize import init_model

    model = init_model(TINY, seed=0)
    if layout == "host":
        assert host_layout(model)
    products = StepProducts(model)
    for rows in (1, 16):
        assert products.flops(rows) == pytest.approx(weight_cost(TINY, rows)["flops"], rel=0.03)
