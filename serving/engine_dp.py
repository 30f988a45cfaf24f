"""Attention data parallelism inside the serving engine, with expert parallelism and EPLB over the same mesh.

`Engine(model, mesh="dp=4,ep=2")` splits the request slots and the page pool over the attention ranks, each with
a cache of its own, and runs the single-device step inside one `jax.shard_map`; the routed experts are split
over `ep` and rebalanced by EPLB. See docs/sharding.md.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from model import moe
from model.api import Model
from model.host_layout import checkpoint_layout
from model.layer_stack import is_stacked
from serving.kv_cache import CacheLayout, PageAllocator, cache_axes, init_engine_cache
from serving.request import Request
from serving.scheduler import Scheduler
from serving.step import StepBatch, StepOutput, empty_batch
from sharding.expert_balance import ExpertSlots, shard_balancedness
from sharding.expert_parallel import TOKEN_AXES, local_pairs
from sharding.mesh import MeshSpec, logical_spec, make_mesh, param_shardings, shard_model

RANKS = logical_spec("batch")  # a leading axis split over the attention ranks


def rank_of(index: int, per_rank: int) -> int:
    """The rank owning global slot / page `index` when each rank owns `per_rank` consecutive ones."""
    return index // per_rank


class ShardedPages(PageAllocator):
    """A page pool split into one range per rank: a slot takes pages only from its own rank's range."""

    def __init__(self, layout: CacheLayout, ranks: int):
        super().__init__(layout)
        self.slots_per_rank, self.pages_per_rank = layout.max_slots // ranks, layout.num_pages // ranks
        self.pools = [list(range((d + 1) * self.pages_per_rank - 1, d * self.pages_per_rank - 1, -1))
                      for d in range(ranks)]
        del self.free  # one free list per rank: code reading a single pool must not run here

    def free_pages(self, slot: int) -> list[int]:
        return self.pools[rank_of(slot, self.slots_per_rank)]

    def home(self, page: int) -> list[int]:
        return self.pools[rank_of(page, self.pages_per_rank)]


class DataParallelScheduler(Scheduler):
    """The scheduler of a data-parallel engine: a new request goes to the rank with the fewest running
    requests that has a free slot (ties: the most free pages, then the lower rank)."""

    def __init__(self, layout: CacheLayout, *args, ranks: int, **kwargs):
        super().__init__(layout, *args, pages=ShardedPages(layout, ranks), **kwargs)
        self.ranks = ranks

    def take_slot(self) -> int:
        per_rank = self.pages.slots_per_rank
        running = np.bincount([rank_of(r.slot, per_rank) for r in self.running], minlength=self.ranks)
        open_ranks = {rank_of(s, per_rank) for s in self.free_slots}
        rank = min(open_ranks, key=lambda d: (running[d], -len(self.pages.pools[d]), d))
        slot = min(s for s in self.free_slots if rank_of(s, per_rank) == rank)
        self.free_slots.remove(slot)
        return slot

    def competes(self, victim: Request, request: Request) -> bool:
        per_rank = self.pages.slots_per_rank
        return rank_of(victim.slot, per_rank) == rank_of(request.slot, per_rank)


@dataclasses.dataclass
class _Placed:
    """A step's inputs laid out for the ranks, and where each scheduled row sits in the global batch."""

    batch: StepBatch
    order: Int[np.ndarray, " rows"]


class DataParallel:
    """The engine's data-parallel layout on a mesh (see the module docstring). Built by `Engine(mesh=...)`."""

    def __init__(self, mesh: Mesh | MeshSpec | str, model: Model, layout: CacheLayout, *,
                 redundant_experts: int = 0, eplb_every: int = 0, eplb_window: int = 100):
        if isinstance(mesh, str):
            mesh = MeshSpec.parse(mesh)
        if isinstance(mesh, MeshSpec):
            mesh = make_mesh(mesh)
        if not isinstance(mesh, Mesh) or set(mesh.axis_names) != {"cp", "dp", "ep"}:
            raise ValueError(f"mesh must be a MeshSpec string like 'dp=4,ep=2', a MeshSpec or a "
                             f"sharding.mesh.make_mesh mesh, got {mesh!r}")
        if is_stacked(model):
            raise ValueError("a model with stacked layers (model.layer_stack, --scan-layers) runs on one device; "
                             "give the mesh engine the model as loaded")
        model = checkpoint_layout(model)  # weights a CPU engine held transposed are placed as the checkpoint has them
        if mesh.shape["cp"] != 1:
            raise ValueError("the engine splits requests, not sequences: its mesh must have cp=1")
        self.mesh, self.ranks, self.ep = mesh, mesh.shape["dp"] * mesh.shape["ep"], mesh.shape["ep"]
        if layout.max_slots % self.ranks or layout.num_pages % self.ranks:
            raise ValueError(f"max_slots={layout.max_slots} and num_pages={layout.num_pages} must divide over the "
                             f"{self.ranks} attention ranks of the mesh")
        self.global_layout = layout
        self.layout = dataclasses.replace(layout, max_slots=layout.max_slots // self.ranks,
                                          num_pages=layout.num_pages // self.ranks)  # one rank's cache
        if self.layout.pages_per_slot > self.layout.num_pages:
            raise ValueError(f"a rank's {self.layout.num_pages} pages cannot hold one request of max_len="
                             f"{layout.max_len}; give the engine more pages")
        for name, value in (("redundant_experts", redundant_experts), ("eplb_every", eplb_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if (eplb_every or redundant_experts) and self.ep == 1:
            raise ValueError("EPLB (eplb_every, redundant_experts) needs experts split over a mesh with ep > 1")
        self.eplb_every = eplb_every
        self.experts = None
        if self.ep > 1 and (eplb_every or redundant_experts):
            self.experts = ExpertSlots(model, mesh, redundant_experts, eplb_window)
            self.model = self.experts.model
        else:
            self.model = shard_model(model, mesh)
        # pairs per slot of each step, per rank [ranks, layers, slots]: dispatched this iteration, and before it
        self._loads: list[jax.Array] = []
        self._previous: list[jax.Array] = []
        self._static_load: np.ndarray | None = None  # without EPLB: pairs per expert since the start
        self._steps_since = 0  # steps recorded since the last rebalance

    # ---- construction -------------------------------------------------------------------------------------
    def scheduler(self, layout: CacheLayout, *args, **kwargs) -> DataParallelScheduler:
        """The engine's scheduler over the whole (global) `layout`: `Scheduler`'s arguments."""
        return DataParallelScheduler(layout, *args, ranks=self.ranks, **kwargs)

    def init_cache(self, module, drafter=None) -> dict:
        """Every rank's empty cache, stacked on the leading (slot or page) axis and split over the ranks."""
        def stacked():
            local = init_engine_cache(module, self.layout, drafter)
            return jax.tree.map(lambda leaf: jnp.concatenate([leaf] * self.ranks), local)

        specs = _cache_specs(jax.eval_shape(stacked))
        return jax.jit(stacked, out_shardings=jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs))()

    def weights(self) -> tuple[list, list]:
        """The step's weights: the target's parameter leaves placed by the rules (experts over `ep`)."""
        return jax.tree.leaves(self.model.params), []

    def _param_specs(self) -> list[P]:
        return [s.spec for s in jax.tree.leaves(param_shardings(self.model.params, self.mesh))]

    # ---- compilation --------------------------------------------------------------------------------------
    def compile(self, step_fn, weights: tuple, cache: dict, rows: int, width: int, verify_len: int,
                engram_shapes=()):
        """The step of bucket (`rows` per rank, `width`, `verify_len`) as one shard_map over the mesh, ahead of
        time; its call takes a `_Placed` batch and returns (outputs in scheduled-row order, cache)."""
        batch = empty_batch(self.layout, rows * self.ranks, width, engram_shapes, verify_len)
        specs = (self._param_specs(), []), _cache_specs(cache), _batch_specs(batch)
        counting = self.ep > 1

        def body(weights, cache, batch):
            loads: list = []
            with moe.expert_dispatch(_RankExperts(loads, self.ep)) if counting else contextlib.nullcontext():
                out, cache = step_fn(weights, cache, batch, verify_len)
            per_slot = jnp.stack(loads)[None] if counting else jnp.zeros((1, 0, 0), jnp.int32)
            return out, cache, per_slot

        out_specs = (_output_specs(), specs[1], RANKS)
        sharded = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=out_specs, check_vma=False)

        def shaped(x, spec):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=NamedSharding(self.mesh, spec))

        args = jax.tree.map(shaped, (weights, cache, batch), specs)
        step = jax.jit(sharded, donate_argnums=1).lower(*args).compile()
        gather = jax.jit(_in_order).lower(step.out_info[0], jax.ShapeDtypeStruct((rows * self.ranks,), jnp.int32))
        return _Executable(self, step, gather.compile(), jax.tree.map(lambda a: a.sharding, args[2]))

    # ---- batches ------------------------------------------------------------------------------------------
    def place(self, built: StepBatch, rows: list, per_rank: int, width: int, verify_len: int,
              engram_shapes=()) -> _Placed:
        """The batch the engine built for `rows` (scheduled order, global slot and page ids) laid out rank by
        rank, `per_rank` rows each, with rank-local slot and page ids; padding rows use each rank's scratch."""
        sp, pp = self.layout.max_slots, self.layout.num_pages
        ranks = [rank_of(row.request.slot, sp) for row in rows]
        taken = [0] * self.ranks
        order = np.zeros(len(rows), np.int32)
        for i, d in enumerate(ranks):
            order[i] = d * per_rank + taken[d]
            taken[d] += 1
        out = empty_batch(self.layout, per_rank * self.ranks, width, engram_shapes, verify_len)

        def put(target, source):
            if isinstance(source, jax.Array) or np.ndim(source) == 0:
                return target  # an all-allowed bitmask kept on the device, or a per-step scalar
            target = np.array(target)
            target[order] = np.asarray(source)[:len(rows)]
            return target

        scalars = {"budget": built.budget, "draft": built.draft}
        out = jax.tree.map(put, out._replace(**scalars), built._replace(**scalars))
        rank = np.asarray(ranks, np.int32)
        out.slots[order] = out.slots[order] - rank * sp
        tables = out.block_tables[order]
        out.block_tables[order] = np.where(tables == self.global_layout.scratch_page, pp, tables - rank[:, None] * pp)
        return _Placed(out, order)

    def rows_per_rank(self, rows: list) -> int:
        """The most rows any one rank runs in a step of `rows`."""
        sp = self.layout.max_slots
        return int(np.bincount([rank_of(r.request.slot, sp) for r in rows], minlength=self.ranks).max())

    # ---- EPLB ---------------------------------------------------------------------------------------------
    def _record(self, steps: list[jax.Array]) -> None:
        """Move the pair counts of dispatched steps to the host: into EPLB's window, or summed for the metric."""
        for per_rank in steps:
            loads = np.asarray(per_rank).sum(axis=0)
            if self.experts is not None:
                self.experts.record(loads)
            else:
                self._static_load = loads if self._static_load is None else self._static_load + loads
            self._steps_since += 1

    def after_step(self, weights: tuple, stats: dict) -> tuple:
        """After an iteration's dispatch: record the loads of the previous iteration's steps (which the engine
        reads next anyway, so nothing waits), rebalance every `eplb_every` recorded steps (new weights: the
        moved experts and their maps; no recompilation), and refresh `stats["eplb_balancedness"]`."""
        if self.ep == 1:
            return weights
        self._record(self._previous)
        self._previous, self._loads = self._loads, []
        stats.setdefault("eplb_rebalances", 0)
        if self.eplb_every and self._steps_since >= self.eplb_every:
            self.rebalance()
            weights = self.weights()
            stats["eplb_rebalances"] += 1
        balance = self.balancedness()
        if balance is not None:
            stats["eplb_balancedness"] = balance
        return weights

    def rebalance(self) -> None:
        """EPLB on the load window now; the engine takes `weights()`. Every dispatched step is recorded first
        (its counts are per slot of the placement it ran with), which waits for the steps in flight."""
        if self.experts is None:
            raise ValueError("rebalancing needs EPLB (Engine(..., eplb_every=N or redundant_experts=R))")
        self._record(self._previous + self._loads)
        self._previous, self._loads = [], []
        self.experts.rebalance()
        self.model = self.experts.model
        self._steps_since = 0

    def balancedness(self) -> float | None:
        """Mean over max (token, expert) pairs per `ep` shard, summed over layers, under the current placement
        (None before any step was recorded). Padding tokens of a bucket are counted too."""
        if self.experts is not None:
            return self.experts.balancedness() if self.experts.recorded else None
        return None if self._static_load is None else shard_balancedness(self._static_load, self.ep)


class _Executable:
    """One compiled bucket: runs the sharded step, returns its outputs in scheduled-row order."""

    def __init__(self, owner: DataParallel, step, gather, batch_shardings):
        self.owner, self.step, self.gather, self.batch_shardings = owner, step, gather, batch_shardings

    def __call__(self, weights: tuple, cache: dict, placed: _Placed):
        batch = jax.device_put(placed.batch, self.batch_shardings)
        outputs, cache, loads = self.step(weights, cache, batch)
        if self.owner.ep > 1:
            self.owner._loads.append(loads)
        order = np.zeros(batch.slots.shape[0], np.int32)
        order[:len(placed.order)] = placed.order
        return self.gather(outputs, order), cache


def _in_order(outputs: StepOutput, order: Int[Array, " rows"]) -> StepOutput:
    return jax.tree.map(lambda x: x[order] if x.ndim else x, outputs)


class _RankExperts:
    """`pallas_kernels.moe.routed_experts_reference` (or the registry's `op`: FP4 experts) inside the step's shard_map: this rank's pairs go to their expert shards by
    all-to-all over `ep` (`sharding.expert_parallel`) and their count per physical slot is appended to `loads`
    (one entry per MoE layer). Every rank runs the same number of tokens, so its first token's index in the
    whole batch is rank x tokens: replicas share a busy expert's tokens across the ranks as in one batch."""

    def __init__(self, loads: list, n_shards: int):
        self.loads, self.n_shards = loads, n_shards

    def first_token(self, tokens: int):
        return jax.lax.axis_index(TOKEN_AXES) * tokens

    def __call__(self, x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"],
                 *stacks_and_limit, op: str = "routed_experts") -> Float[Array, "t d"]:
        *stacks, limit = stacks_and_limit
        slots = stacks[0].shape[0] * self.n_shards
        self.loads.append(jnp.zeros((slots,), jnp.int32).at[ids.reshape(-1)].add(1))
        return local_pairs(x, ids, weights.astype(jnp.float32), *stacks, limit=limit, axis="ep",
                           n_shards=self.n_shards, op=op)


def _cache_specs(cache: dict) -> dict:
    """PartitionSpecs of an engine cache's leaves from their logical axes (slots and pages over the ranks)."""
    return jax.tree.map(lambda axes: logical_spec(*axes), cache_axes(cache), is_leaf=lambda x: isinstance(x, tuple))


def _batch_specs(batch: StepBatch) -> StepBatch:
    """Row-leading leaves split over the ranks, the per-step scalars (verify budget, draft flag) replicated."""
    return jax.tree.map(lambda leaf: RANKS if np.ndim(leaf) else P(), batch)


def _output_specs() -> StepOutput:
    return StepOutput(*[RANKS] * (len(StepOutput._fields) - 1), P())

