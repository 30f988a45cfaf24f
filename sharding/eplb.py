"""Expert-parallel load balancing: which logical expert each physical expert slot holds (DeepSeek's EPLB).

Given per-layer expert loads, `rebalance_experts` replicates the busiest experts into the redundant physical
slots and packs the slots onto devices so that every device carries about the same load. Two policies, with
deepseek-ai/EPLB's semantics and results:

- hierarchical (when the expert groups divide evenly over the nodes; meant for prefill): pack whole expert
  groups onto nodes (keeping group-limited routing node-local), replicate inside each node, then pack each
  node's slots onto its devices;
- global (otherwise; meant for decode): the same with one group and one node.

Packing is greedy longest-processing-time with a cardinality constraint: items in descending load, each to
the lightest pack that still has room (ties: the lower pack). Replication repeatedly gives one more slot to
the expert with the largest load per replica (ties: the lower expert). Pure host-side numpy.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Float, Int, Real


def balanced_packing(weight: Float[np.ndarray, "n items"], num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """(pack of each item, its rank inside the pack) per row: `items / num_packs` items per pack."""
    rows, items = weight.shape
    per_pack = items // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(items), (rows, items)).copy(), np.zeros((rows, items), np.int64)
    pack = np.full((rows, items), -1, np.int64)
    rank = np.full((rows, items), -1, np.int64)
    for r in range(rows):
        load, filled = np.zeros(num_packs), np.zeros(num_packs, np.int64)
        for item in np.argsort(-weight[r], kind="stable"):
            open_packs = np.flatnonzero(filled < per_pack)
            p = open_packs[np.argmin(load[open_packs])]
            pack[r, item], rank[r, item] = p, filled[p]
            load[p] += weight[r, item]
            filled[p] += 1
    return pack, rank


def replicate_experts(weight: Float[np.ndarray, "n experts"], num_slots: int):
    """(slot -> expert, replica rank of each slot, replicas per expert): the first slots hold each expert once,
    every further slot replicates the expert with the largest load per replica."""
    rows, experts = weight.shape
    slot_expert = np.broadcast_to(np.arange(num_slots), (rows, num_slots)).copy()
    slot_rank = np.zeros((rows, num_slots), np.int64)
    count = np.ones((rows, experts), np.int64)
    every = np.arange(rows)
    for slot in range(experts, num_slots):
        busiest = np.argmax(weight / count, axis=1)
        slot_expert[:, slot], slot_rank[:, slot] = busiest, count[every, busiest]
        count[every, busiest] += 1
    return slot_expert, slot_rank, count


def _inverse(perm: Int[np.ndarray, "n k"]) -> Int[np.ndarray, "n k"]:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _hierarchical(weight: np.ndarray, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int):
    layers, experts = weight.shape
    group_size, groups_per_node = experts // num_groups, num_groups // num_nodes
    slots_per_gpu, experts_per_node = num_slots // num_gpus, experts // num_nodes
    # 1. groups onto nodes; renumber experts node-major ("m" ids)
    group_pack, group_rank = balanced_packing(weight.reshape(layers, num_groups, group_size).sum(-1), num_nodes)
    first = (group_pack * groups_per_node + group_rank) * group_size
    log2m = (first[:, :, None] + np.arange(group_size)).reshape(layers, experts)
    m2log = _inverse(log2m)
    # 2. replicate inside each node (rows: layer x node)
    node_load = np.take_along_axis(weight, m2log, axis=1).reshape(layers * num_nodes, experts_per_node)
    slot_m, slot_rank, m_count = replicate_experts(node_load, num_slots // num_nodes)
    # 3. each node's slots onto its devices
    slot_load = np.take_along_axis(node_load / m_count, slot_m, axis=1)
    gpu, rank_on_gpu = balanced_packing(slot_load, num_gpus // num_nodes)
    placed = _inverse(gpu * slots_per_gpu + rank_on_gpu)  # physical position -> node-local slot
    phys_m = np.take_along_axis(slot_m, placed, axis=1).reshape(layers, num_nodes, -1)
    phys_m = (phys_m + (np.arange(num_nodes) * experts_per_node)[None, :, None]).reshape(layers, -1)
    phy2log = np.take_along_axis(m2log, phys_m, axis=1)
    phy_rank = np.take_along_axis(slot_rank, placed, axis=1).reshape(layers, -1)
    logcnt = np.take_along_axis(m_count.reshape(layers, -1), log2m, axis=1)
    return phy2log, phy_rank, logcnt


def rebalance_experts(
    weight: Real[np.ndarray, "layers experts"], num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Int[np.ndarray, "layers replicas"], Int[np.ndarray, "layers experts maxcnt"], Int[np.ndarray, "layers experts"]]:
    """(phy2log, log2phy, logcnt): the logical expert of every physical slot (slot s lives on device
    s // (num_replicas / num_gpus)), each expert's slots (-1 padded), and its replica count."""
    weight = np.asarray(weight, np.float64)
    layers, experts = weight.shape
    for name, value, of in (("num_replicas", num_replicas, num_gpus), ("num_gpus", num_gpus, num_nodes),
                            ("num_experts", experts, num_groups)):
        if value <= 0 or of <= 0 or value % of:
            raise ValueError(f"{name}={value} must be a positive multiple of {of}")
    if num_replicas < experts:
        raise ValueError(f"num_replicas={num_replicas} cannot hold {experts} experts")
    if num_groups % num_nodes == 0:
        phy2log, phy_rank, logcnt = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phy_rank, logcnt = _hierarchical(weight, num_replicas, 1, 1, num_gpus)
    log2phy = np.full((layers, experts, int(logcnt.max())), -1, np.int64)
    layer = np.broadcast_to(np.arange(layers)[:, None], phy2log.shape)
    log2phy[layer, phy2log, phy_rank] = np.broadcast_to(np.arange(num_replicas), phy2log.shape)
    return phy2log, log2phy, logcnt


def balancedness(weight: Float[np.ndarray, "layers experts"], phy2log: np.ndarray, logcnt: np.ndarray,
                 num_gpus: int) -> float:
    """Mean over max tokens per device, summed over layers (1.0 = perfect), each replica taking an equal share
    of its expert's load (vLLM's `balancedness`)."""
    weight = np.asarray(weight, np.float64)
    share = np.take_along_axis(weight / logcnt, phy2log, axis=1)  # per physical slot
    per_gpu = share.reshape(weight.shape[0], num_gpus, -1).sum(-1)
    return float(per_gpu.mean(axis=1).sum() / per_gpu.max(axis=1).sum())


class ExpertLoadWindow:
    """Per-expert token counts of each MoE layer over the last `window` steps: the load that periodic
    rebalancing feeds to `rebalance_experts` (DeepInfer keeps 100 steps, vLLM 1000)."""

    def __init__(self, num_layers: int, num_experts: int, window: int):
        if min(num_layers, num_experts, window) < 1:
            raise ValueError(f"need num_layers, num_experts, window >= 1; got {num_layers}, {num_experts}, {window}")
        self.counts = np.zeros((window, num_layers, num_experts), np.int64)
        self.steps = 0

    def record(self, ids: Int[np.ndarray, "layers t k"]) -> None:
        """Count one step's routed experts (the gate's ids of every MoE layer); the oldest step drops out."""
        ids = np.asarray(ids)
        layers, experts = self.counts.shape[1:]
        if ids.ndim != 3 or ids.shape[0] != layers or (ids.size and not 0 <= ids.min() <= ids.max() < experts):
            raise ValueError(f"ids must be [{layers} layers, tokens, k] expert ids in [0, {experts}), got "
                             f"shape {ids.shape}")
        self.add(np.stack([np.bincount(row.ravel(), minlength=experts) for row in ids]))

    def add(self, counts: Int[np.ndarray, "layers experts"]) -> None:
        """Count one step's tokens per expert and layer; the oldest step drops out."""
        counts = np.asarray(counts)
        if counts.shape != self.counts.shape[1:] or (counts < 0).any():
            raise ValueError(f"counts must be non-negative [{self.counts.shape[1]} layers, {self.counts.shape[2]} "
                             f"experts], got shape {counts.shape}")
        self.counts[self.steps % len(self.counts)] = counts
        self.steps += 1

    def load(self) -> Float[np.ndarray, "layers experts"]:
        """Tokens per expert and layer summed over the window."""
        return self.counts.sum(axis=0).astype(np.float64)

    def rebalance(self, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
        """`rebalance_experts` on the window's load: (phy2log, log2phy, logcnt)."""
        return rebalance_experts(self.load(), num_replicas, num_groups, num_nodes, num_gpus)
