"""EPLB while serving: replicated experts in every MoE layer, load statistics, and rebalancing between steps.

`ExpertBalancer` turns a model into its expert-parallel form on a mesh with `redundant_slots` extra
physical expert slots per MoE layer. Each layer gets its own maps (`model.moe.ExpertMap`: each expert's
slots and replica count) and its routed-expert weights stacked per physical slot, split over `ep`. Every
`step` records how many (token, expert) pairs each slot served; `rebalance` feeds the window's per-expert
load to `sharding.eplb.rebalance_experts` and moves the weights into the new slots (a gather from the
slots that hold each expert now, which XLA turns into transfers between the `ep` shards). Replicas hold
identical weights, so a rebalance changes which device computes a pair, never the result.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Float, Int

from model.api import Model
from model.moe import ExpertMap
from sharding.eplb import ExpertLoadWindow, rebalance_experts
from sharding.expert_parallel import expert_parallel
from sharding.mesh import batch_sharded, place, shard_model


class ExpertSlots:
    """A model's EPLB placement on `mesh`: its MoE layers' maps and slot-stacked weights (`model`, sharded),
    the per-expert load window, and `record` / `rebalance` / `balancedness`. `ExpertBalancer` serves it as a
    whole-model step; the engine (`sharding.engine_dp`) runs it inside its compiled step.

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
        self.slot_loads: list[np.ndarray] = []  # [layers, slots] per step since the last rebalance
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
        by_slot = NamedSharding(self.mesh, P("ep"))
        replicated = NamedSharding(self.mesh, P())
        for i, blk in enumerate(module.layers):
            experts = blk.ffn.experts
            source = phy2log[i] if moved_from is None else moved_from[i][phy2log[i], 0]
            for name in ("w1", "w2", "w3"):
                moved = _take_slots(getattr(experts, name)[...], jnp.asarray(source, jnp.int32), by_slot)
                setattr(experts, name, nnx.Param(moved))
            experts.log2phy = ExpertMap(jax.device_put(log2phy[i], replicated))
            experts.logcnt = ExpertMap(jax.device_put(logcnt[i], replicated))
        self.model = Model(module, tokenizer=self.model.tokenizer, engram=self.model.engram,
                           drafter=self.model.drafter)
        self.phy2log, self.log2phy, self.logcnt = phy2log, log2phy, logcnt

    def record(self, loads: Int[np.ndarray, "layers slots"]) -> None:
        """One step's (token, expert) pairs per physical slot and layer: kept for `balancedness`, and added to
        the window per logical expert."""
        self.slot_loads.append(loads)
        logical = np.zeros((loads.shape[0], self.experts), np.int64)
        for layer in range(loads.shape[0]):
            np.add.at(logical[layer], self.phy2log[layer], loads[layer])
        self.window.add(logical)

    def rebalance(self) -> None:
        """New maps from the window's load; expert weights move to their new slots."""
        self._install(self._maps(self.window.load()), moved_from=self.log2phy)
        self.slot_loads = []

    def balancedness(self) -> float:
        """Mean over max (token, expert) pairs per `ep` shard since the last rebalance, summed over layers
        (1.0 = every shard served as many pairs)."""
        if not self.slot_loads:
            raise ValueError("no step has run since the last rebalance")
        per_shard = np.sum(self.slot_loads, axis=0).reshape(-1, self.ep, self.slots // self.ep).sum(-1)
        return float(per_shard.mean(axis=1).sum() / per_shard.max(axis=1).sum())


class ExpertBalancer(ExpertSlots):
    """A model served with EPLB on `mesh` (see the module docstring): `init_cache`, `step`, `rebalance`."""

    def __init__(self, model: Model, mesh: Mesh, redundant_slots: int, window: int = 100, num_groups: int = 1,
                 num_nodes: int = 1):
        super().__init__(model, mesh, redundant_slots, window, num_groups, num_nodes)
        self._engram = model.engram
        self._forward = jax.jit(self._loaded_forward(), donate_argnums=2)

    def _loaded_forward(self):
        """`(params, tokens, cache, *engram_rows) -> (logits, cache, slot loads [layers, slots])`."""
        graphdef, has_engram = self.model.graphdef, self._engram is not None

        def forward(params, tokens, cache, *rows):
            module = nnx.merge(graphdef, params)
            out, sown = nnx.capture(module, nnx.Intermediate)(tokens, cache, *([tuple(rows)] if has_engram else []))
            loads = [sown["layers"][i]["ffn"]["experts"]["slot_load"].get_value()[0]
                     for i in range(len(module.layers))]
            return *out[:2], jnp.stack(loads)

        return forward

    def init_cache(self, batch: int, max_len: int) -> dict:
        """An empty cache with its sequences split over the attention ranks."""
        cache = self.model.init_cache(batch, max_len)
        return place(cache, batch_sharded(self.mesh, cache))

    def step(self, tokens: Int[np.ndarray, "b c"], cache: dict):
        """`Model.step` on the mesh (the cache is donated) that also records the step's expert load."""
        tokens = np.asarray(self.model._check_tokens(tokens))
        rows = ()
        if self._engram is not None:
            rows, history = self._engram.lookup(tokens, np.asarray(cache["engram_history"]))
        tokens, rows = place((tokens, tuple(rows)), batch_sharded(self.mesh, (tokens, tuple(rows))))
        with expert_parallel(self.mesh) if self.ep > 1 else contextlib.nullcontext():
            logits, cache, loads = self._forward(self.model.params, tokens, cache, *rows)
        if self._engram is not None:
            cache = {**cache, "engram_history": jnp.asarray(history, jnp.int32)}
        self.record(np.asarray(loads))
        return logits, cache


def _rows(weights, source):
    return weights[source]


def _take_slots(weights, source: Int[jax.Array, " slots"], sharding: NamedSharding):
    """weights[source] laid out over `ep` by slot (the transfers between shards a rebalance needs)."""
    return jax.jit(_rows, out_shardings=sharding)(weights, source)
