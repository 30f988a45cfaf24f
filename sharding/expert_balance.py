"""EPLB while serving: replicated experts in every MoE layer, load statistics, and rebalancing between steps.

`ExpertSlots` gives a model `redundant_slots` extra physical expert slots per MoE layer on a mesh. Each layer
gets its own placement (`model.moe.ExpertReplicas`: each expert's slots and replica count) and its routed-expert weights
(float, or stored FP4 codes and their scales) stacked per physical slot, split over `ep`. The data-parallel engine (`serving.core.engine_dp`) runs it: its
compiled step counts the (token, expert) pairs each slot served and `record` takes them; `rebalance` feeds
the window's per-expert load to `sharding.eplb.rebalance_experts` and moves the weights into the new slots (a
gather from the slots that hold each expert now, which XLA turns into transfers between the `ep` shards).
Replicas hold identical weights, so a rebalance changes which device computes a pair, never the result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Float, Int

from model.api import Model
from model.axes import logical_axes, param
from model.moe import ExpertMap, ExpertReplicas
from sharding.eplb import ExpertLoadWindow, rebalance_experts
from sharding.mesh import logical_spec, shard_model


class ExpertSlots:
    """A model's EPLB placement on `mesh`: its MoE layers' maps and slot-stacked weights (`model`, sharded),
    the per-expert load window, and `record` / `rebalance` / `balancedness`.

    `window` steps of load feed each rebalance (DeepInfer keeps 100); `num_groups` / `num_nodes` choose
    EPLB's hierarchical policy when the expert groups divide over the nodes (else the global one)."""

    def __init__(self, model: Model, mesh: Mesh, redundant_slots: int, window: int = 100, num_groups: int = 1,
                 num_nodes: int = 1):
        config = model.config
        self.ep, self.experts = mesh.shape["ep"], config.n_routed_experts
        self.slots = self.experts + redundant_slots
        if redundant_slots < 0 or self.slots % self.ep:
            raise ValueError(f"{self.experts} experts + {redundant_slots} redundant slots must be a multiple of "
                             f"ep={self.ep} (and redundant_slots >= 0)")
        self.mesh, self.num_groups, self.num_nodes = mesh, num_groups, num_nodes
        self.max_replicas = redundant_slots + 1  # fixed map shapes: a rebalance never recompiles the step
        layers = config.num_hidden_layers
        self.window = ExpertLoadWindow(layers, self.experts, window)
        self.slot_load = np.zeros((layers, self.slots), np.int64)  # pairs per slot since the last rebalance
        self.recorded = 0  # steps in `slot_load`
        self.model = shard_model(model, mesh)
        self._install(self._maps(np.ones((layers, self.experts))), moved_from=None)

    def _maps(self, load: Float[np.ndarray, "layers experts"]):
        """EPLB's (phy2log, log2phy padded to `max_replicas`, logcnt) for a load."""
        phy2log, log2phy, logcnt = rebalance_experts(load, self.slots, self.num_groups, self.num_nodes, self.ep)
        padded = np.full((*log2phy.shape[:2], self.max_replicas), -1, np.int32)
        padded[:, :, :log2phy.shape[2]] = log2phy
        return phy2log, padded, logcnt.astype(np.int32)

    def _install(self, maps, moved_from) -> None:
        """Set every MoE layer's maps and its slot-stacked weights: gathered from the logical experts (first
        placement) or from the slots holding each expert under the previous maps (`moved_from` log2phy)."""
        phy2log, log2phy, logcnt = maps
        module = self.model.module()
        for i, blk in enumerate(module.layers):
            experts = blk.ffn.experts
            source = jnp.asarray(phy2log[i] if moved_from is None else moved_from[i][phy2log[i], 0], jnp.int32)
            for name in experts.stacked()[1]:
                axes = logical_axes(getattr(experts, name))  # `expert` first: the slots split over `ep`
                moved = _take_slots(getattr(experts, name)[...], source, NamedSharding(self.mesh, logical_spec(*axes)))
                setattr(experts, name, param(moved, *axes))
            experts.replicas = ExpertReplicas(_expert_map(log2phy[i], self.mesh, "router", "replica"),
                                              _expert_map(logcnt[i], self.mesh, "router"))
        self.model = Model(module, tokenizer=self.model.tokenizer, engram=self.model.engram,
                           drafter=self.model.drafter)
        self.phy2log, self.log2phy, self.logcnt = phy2log, log2phy, logcnt

    def record(self, loads: Int[np.ndarray, "layers slots"]) -> None:
        """One step's (token, expert) pairs per physical slot and layer: kept for `balancedness`, and added to
        the window per logical expert."""
        self.slot_load += loads
        self.recorded += 1
        logical = np.zeros((loads.shape[0], self.experts), np.int64)
        for layer in range(loads.shape[0]):
            np.add.at(logical[layer], self.phy2log[layer], loads[layer])
        self.window.add(logical)

    def rebalance(self) -> None:
        """New maps from the window's load; expert weights move to their new slots."""
        self._install(self._maps(self.window.load()), moved_from=self.log2phy)
        self.slot_load[...], self.recorded = 0, 0

    def balancedness(self) -> float:
        """Mean over max (token, expert) pairs per `ep` shard since the last rebalance, summed over layers
        (1.0 = every shard served as many pairs)."""
        if not self.recorded:
            raise ValueError("no step has run since the last rebalance")
        return shard_balancedness(self.slot_load, self.ep)


def shard_balancedness(slot_load: Int[np.ndarray, "layers slots"], shards: int) -> float:
    """Mean over max pairs per shard (slots split into `shards` consecutive groups), summed over layers."""
    per_shard = slot_load.reshape(slot_load.shape[0], shards, -1).sum(-1)
    return float(per_shard.mean(axis=1).sum() / max(per_shard.max(axis=1).sum(), 1))


def _expert_map(table: Int[np.ndarray, "experts *r"], mesh: Mesh, *axes: str) -> ExpertMap:
    """An EPLB table on `mesh` as an `ExpertMap` carrying its logical `axes` (replicated: every shard reads it)."""
    return param(jax.device_put(table, NamedSharding(mesh, logical_spec(*axes))), *axes, variable=ExpertMap)


def _rows(weights, source):
    return weights[source]


def _take_slots(weights, source: Int[jax.Array, " slots"], sharding: NamedSharding):
    """weights[source] laid out over `ep` by slot (the transfers between shards a rebalance needs)."""
    return jax.jit(_rows, out_shardings=sharding)(weights, source)
