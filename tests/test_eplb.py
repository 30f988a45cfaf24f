"""EPLB: deepseek-ai/EPLB's published example reproduced exactly, and balance gains on a skewed load."""

import numpy as np
import pytest

from sharding.eplb import balanced_packing, balancedness, rebalance_experts

# deepseek-ai/EPLB README: 2 layers x 12 experts, 16 physical slots, 4 groups, 2 nodes, 8 GPUs
README_WEIGHT = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = np.array([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                           [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


def test_readme_example_is_reproduced_exactly():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    np.testing.assert_array_equal(phy2log, README_PHY2LOG)
    np.testing.assert_array_equal(logcnt.sum(axis=1), [16, 16])
    for layer in range(2):  # log2phy inverts phy2log
        for expert in range(12):
            slots = log2phy[layer, expert, :logcnt[layer, expert]]
            assert (phy2log[layer, slots] == expert).all() and (log2phy[layer, expert, logcnt[layer, expert]:] == -1).all()


@pytest.mark.parametrize("groups, nodes", [(4, 2), (3, 2)])  # hierarchical; global (3 groups over 2 nodes)
def test_replication_improves_balance_on_a_skewed_load(groups, nodes):
    rng = np.random.default_rng(0)
    weight = rng.zipf(1.5, (4, 24)).astype(float) * 10  # heavy-tailed expert loads
    phy2log, _, logcnt = rebalance_experts(weight, 32, groups, nodes, 8)
    plain = rebalance_experts(weight, 24, groups, nodes, 8)  # no redundant slots
    gained, base = balancedness(weight, phy2log, logcnt, 8), balancedness(weight, plain[0], plain[2], 8)
    print(f"balancedness {groups} groups / {nodes} nodes: {base:.3f} without replicas, {gained:.3f} with 8")
    assert gained > base and 0 < gained <= 1
    assert (np.sort(phy2log, axis=1)[:, :24] >= 0).all() and all(
        set(row) == set(range(24)) for row in phy2log)  # every expert keeps at least one slot


def test_packing_respects_capacity_and_balances():
    weight = np.array([[9.0, 8, 7, 6, 5, 4]])
    pack, rank = balanced_packing(weight, 2)
    assert np.bincount(pack[0]).tolist() == [3, 3]
    loads = [weight[0, pack[0] == p].sum() for p in range(2)]
    assert abs(loads[0] - loads[1]) <= 3 and sorted(rank[0, pack[0] == 0]) == [0, 1, 2]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="num_replicas=15 must be a positive multiple of 8"):
        rebalance_experts(README_WEIGHT, 15, 4, 2, 8)
    with pytest.raises(ValueError, match="cannot hold 12 experts"):
        rebalance_experts(README_WEIGHT, 8, 4, 2, 8)
