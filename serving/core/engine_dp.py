"""Attention data parallelism inside the serving engine, with expert parallelism and EPLB over the same mesh.

`Engine(model, mesh="dp=4,ep=2")` splits the request slots and the page pool over the attention ranks, each with
a cache of its own, and runs the single-device step inside `jax.shard_map`: as one program, or as layer programs
(`serving.core.layer_programs`), each a `shard_map` program; the routed experts are split over `ep` and rebalanced by
EPLB. With `cp` > 1 (`mesh="cp=2,dp=2"`) each rank's slots, cache and step are replicated over its context ranks, and
a prefill step splits its chunk over them: each context rank computes the attention cores and the indexer for its
zigzag share of the chunk's queries (`sharding.context_parallel.rank_context_parallel`) and the routed experts for a
1/cp share of the tokens; decode steps run whole on every context rank. See docs/sharding.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from model import moe, registry
from model.api import Model
from model.dspark import Drafter
from model.host_layout import checkpoint_layout
from serving.base.kv_cache import CacheLayout, EngineCache, PageAllocator, init_engine_cache
from serving.core.layer_programs import LayeredHalves, LayerPlan, Lowering, compile_layered, layer_program_names
from serving.prefix.prefix_admission import PrefixAdmission
from serving.prefix.prefix_ranks import RankedPrefix, RankPages
from serving.base.request import Request
from serving.core.scheduler import Scheduler
from serving.core.step import StepBatch, StepHalves, StepOutput, decide_inputs, empty_batch
from sharding.context_parallel import rank_context_parallel
from sharding.expert_balance import ExpertSlots, shard_balancedness
from sharding.expert_parallel import TOKEN_AXES, local_pairs
from sharding.mesh import MeshSpec, logical_spec, make_mesh, param_shardings, place, shard_model
from sharding.multihost import put, to_host

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
        self.reclaims: list = [None] * ranks  # each rank's prefix cache frees that rank's pages

    def reclaim_for(self, slot: int, pages: int) -> None:
        evict = self.reclaims[rank_of(slot, self.slots_per_rank)]
        if evict is not None:
            evict(pages)

    def free_pages(self, slot: int) -> list[int]:
        return self.pools[rank_of(slot, self.slots_per_rank)]

    def home(self, page: int) -> list[int]:
        return self.pools[rank_of(page, self.pages_per_rank)]


class DataParallelScheduler(Scheduler):
    """The scheduler of a data-parallel engine: a new request goes to the rank, among those with a free slot,
    with the least pending prefill plus uncached prompt tokens (its prompt less what that rank's prefix cache
    would spare it, `PrefixAdmission.cached_tokens`); ties go to the fewest running requests, then the most free
    pages, then the lower rank. A hand-off (`take_handoff`: its tokens computed elsewhere, none to prefill) goes
    to the least loaded such rank with free pages for them, if any has."""

    def __init__(self, layout: CacheLayout, *args, ranks: int, **kwargs):
        super().__init__(layout, *args, pages=ShardedPages(layout, ranks), **kwargs)
        self.ranks = ranks

    def take_slot(self, request: Request) -> int:
        per_rank = self.pages.slots_per_rank
        running = np.bincount([self.rank(r) for r in self.running], minlength=self.ranks)
        pending = np.zeros(self.ranks, np.int64)
        for r in self.running:
            if r.prefilling:
                pending[self.rank(r)] += len(r.sequence) - r.computed
        fresh = self.prefix is not None and not request.computed
        cached = self.prefix.cached_tokens(request.prompt) if fresh else [0] * self.ranks
        uncached = np.maximum(len(request.prompt) - request.computed - np.asarray(cached), 0)
        open_ranks = {rank_of(s, per_rank) for s in self.free_slots}
        need = -(-request.computed // self.layout.page_tokens)
        open_ranks = {d for d in open_ranks if need <= len(self.pages.pools[d])} or open_ranks  # else reclaim
        rank = min(open_ranks, key=lambda d: (pending[d] + uncached[d], running[d], -len(self.pages.pools[d]), d))
        slot = min(s for s in self.free_slots if rank_of(s, per_rank) == rank)
        self.free_slots.remove(slot)
        return slot

    def prefix_cache(self, build: Callable[[PageAllocator, int], PrefixAdmission]) -> RankedPrefix:
        return RankedPrefix([build(RankPages(self.pages, d), self.ranks) for d in range(self.ranks)], self.rank)

    def competes(self, victim: Request, request: Request) -> bool:
        return self.rank(victim) == self.rank(request)

    def rank(self, request: Request) -> int:
        return rank_of(request.slot, self.pages.slots_per_rank)


class DataParallel:
    """The engine's data-parallel layout on a mesh (see the module docstring): a placement
    (`serving.core.placement`), built by `Engine(mesh=...)`."""

    layer_programs = True  # a forward half may run as a chain of layer programs, each a shard_map program
    masks_during_forward = False  # one program: constrained rows' masks are filled before the step

    def __init__(self, mesh: Mesh | MeshSpec | str, model: Model, layout: CacheLayout, *,
                 redundant_experts: int = 0, eplb_every: int = 0, eplb_window: int = 100):
        if isinstance(mesh, str):
            mesh = MeshSpec.parse(mesh)
        if isinstance(mesh, MeshSpec):
            mesh = make_mesh(mesh)
        if not isinstance(mesh, Mesh) or set(mesh.axis_names) != {"cp", "dp", "ep"}:
            raise ValueError(f"mesh must be a MeshSpec string like 'dp=4,ep=2', a MeshSpec or a "
                             f"sharding.mesh.make_mesh mesh, got {mesh!r}")
        model = checkpoint_layout(model)  # weights a CPU engine held transposed are placed as the checkpoint has them
        self.mesh, self.ranks, self.ep = mesh, mesh.shape["dp"] * mesh.shape["ep"], mesh.shape["ep"]
        self.cp = mesh.shape["cp"]  # context ranks: replicas of each rank that split its prefill chunks
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
        if model.drafter is not None:  # a DSpark drafter, placed by the same rules (its experts over `ep`)
            self.model.drafter = Drafter(nnx.merge(model.drafter.graphdef, place(
                model.drafter.params, param_shardings(model.drafter.params, mesh))))
        # pairs per slot of each step, per rank (arrays [ranks, layers, slots] in layer order): dispatched this
        # iteration, and before it
        self._loads: list[list[jax.Array]] = []
        self._previous: list[list[jax.Array]] = []
        self._static_load: np.ndarray | None = None  # without EPLB: pairs per expert since the start
        self._steps_since = 0  # steps recorded since the last rebalance

    # ---- construction -------------------------------------------------------------------------------------
    def scheduler(self, layout: CacheLayout, *args, **kwargs) -> DataParallelScheduler:
        """The engine's scheduler over the whole (global) `layout`: `Scheduler`'s arguments."""
        return DataParallelScheduler(layout, *args, ranks=self.ranks, **kwargs)

    def cache_slot(self, slot: int) -> int:
        """Where the scheduler's (global) `slot` lies in the cache: each rank's slots, its scratch slot last,
        follow the previous rank's."""
        return slot + slot // self.layout.max_slots

    def cache_pages(self, pages: Int[np.ndarray, " p"]) -> Int[np.ndarray, " p"]:
        """Where the scheduler's (global) `pages` lie in the cache: each rank's pages, its scratch page last,
        follow the previous rank's."""
        return pages + pages // self.layout.num_pages

    def init_cache(self, module, drafter=None) -> EngineCache:
        """Every rank's empty cache, stacked on the leading (slot or page) axis and split over the ranks."""
        def stacked():
            local = init_engine_cache(module, self.layout, drafter)
            return jax.tree.map(lambda leaf: jnp.concatenate([leaf] * self.ranks), local)

        specs = _cache_specs(jax.eval_shape(stacked))
        return jax.jit(stacked, out_shardings=jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs))()

    # ---- compilation --------------------------------------------------------------------------------------
    def compile(self, halves: StepHalves, plan: LayerPlan | None, weights: tuple, cache: EngineCache,
                bucket: tuple[int, int, int, int], engram_shapes=()) -> list:
        """The step of `bucket` (rows per rank, width, verify length, context pages) over the mesh, ahead of time:
        one `shard_map` program, or under `plan` each layer program and the decide half a `shard_map` program of
        its own (`_sharded`); then the gather of its outputs (`wrap` makes them a step called as the
        single-device one is). A prefill bucket splits its chunk over the context ranks (`cp` > 1)."""
        rows, width, verify_len, pages = bucket
        split = self.cp > 1 and verify_len == 1 and width > 1
        batch = empty_batch(self.layout, rows * self.ranks, width, engram_shapes, verify_len, pages)
        batch = batch._replace(budget=np.zeros(self.ranks, np.int32))  # each rank's verify budget
        if plan is None:
            def step(weights, cache, batch):
                return halves.step(weights, cache, batch._replace(budget=batch.budget[0]), verify_len)

            counted = self.model.config.num_hidden_layers if self.ep > 1 else None
            executables = [self._sharded(step, (1,), (weights, cache, batch), counted, split)]
        else:
            executables = compile_layered(halves, plan, weights, cache, batch, verify_len, _MeshLowering(self, split),
                                          viewed=False)
        # the outputs in the batch's row order, whole on every process (a multi-process job reads them on each)
        outputs, replicated = executables[-1].out_info[0], NamedSharding(self.mesh, P())
        order = jax.ShapeDtypeStruct((rows * self.ranks,), jnp.int32, sharding=replicated)
        gather = jax.jit(_in_order, out_shardings=replicated).lower(outputs, order)
        return executables + [gather.compile()]

    def _sharded(self, fn: Callable, donated: tuple[int, ...], args: tuple, counted: int | None,
                 split: bool = False):
        """`fn`, a program of one rank's arrays, compiled over the mesh for `args` (arrays or their shapes) inside
        one `shard_map`: each leaf split as `_spec_of` says (replicated over `cp`), its MoE layers run by
        `_RankExperts`. `counted`: how many MoE layers it counts the pairs per expert slot of, returned as a last
        output [ranks, counted, slots] (None: no count). `split`: its chunk's work is split over the context ranks
        (a prefill step's). A scalar output is one decision for every rank: it comes out replicated."""
        shaped = self.shaped(args)
        specs = jax.tree.map(lambda x: x.sharding.spec, shaped)
        slots = self.model.config.n_routed_experts if self.experts is None else self.experts.slots
        structure: list = []

        def body(*local):
            experts = _RankExperts(self.ep, counted or 0, slots, self.cp if split else 1)
            with moe.expert_dispatch(experts), (rank_context_parallel(self.cp) if split else contextlib.nullcontext()):
                out = fn(*local)
            if counted is not None:
                out = (*out, experts.loads[...][None])
            leaves, tree = jax.tree.flatten(out)
            structure[:] = [tree, [np.ndim(x) == 0 for x in leaves]]
            return [x for x in leaves if np.ndim(x)], [x for x in leaves if not np.ndim(x)]

        # split outputs over the ranks, scalars (the same on every rank) replicated: nothing is gathered
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=(RANKS, P()), check_vma=False)

        def program(*args):
            split, scalar = (iter(part) for part in mapped(*args))
            tree, scalars = structure
            return jax.tree.unflatten(tree, [next(scalar) if is_scalar else next(split) for is_scalar in scalars])

        return jax.jit(program, donate_argnums=donated).lower(*shaped).compile()

    def shaped(self, tree):
        """The shapes a mesh program is compiled for, of a tree of arrays (or their shapes): each leaf placed on
        the mesh as `_spec_of` says."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                                           sharding=NamedSharding(self.mesh, _spec_of(x))), tree)

    def wrap(self, executables: list, halves: StepHalves, plan: LayerPlan | None, bucket: tuple[int, int, int, int]):
        """The step of `bucket` from what `compile` returned (or the executable cache loaded), called as a
        single-device step is: the batch laid out over the ranks, the outputs gathered into its row order."""
        *programs, gather = executables
        if plan is None:
            return _OneProgram(self, bucket[0], programs[0], gather)
        return _LayeredExecutable(self, bucket[0], programs, gather, plan, halves.head_leaves)

    # ---- batches ------------------------------------------------------------------------------------------
    def place(self, built: StepBatch, per_rank: int) -> tuple[StepBatch, Int[np.ndarray, " rows"]]:
        """`built` (a batch as the single-device engine builds it: global slot and page ids, padding rows on the
        global scratch slot, its verify budget one for all ranks or one per rank) laid out rank by rank,
        `per_rank` rows each, with rank-local slot and page ids; and the placed row of each of `built`'s real
        rows. A rank's padding rows copy `built`'s first padding row (an all-padding batch, as profiling runs,
        pads every rank alike) on that rank's scratch slot and page."""
        sp, pp, scratch = self.layout.max_slots, self.layout.num_pages, self.global_layout.scratch_slot
        slots = np.asarray(built.slots)
        real, padding = np.flatnonzero(slots != scratch), np.flatnonzero(slots == scratch)
        ranks = slots[real] // sp
        taken = np.zeros(self.ranks, np.int32)
        order = np.zeros(len(real), np.int32)
        for i, d in enumerate(ranks):
            order[i] = d * per_rank + taken[d]
            taken[d] += 1
        if taken.max(initial=0) > per_rank:
            raise ValueError(f"a rank has {taken.max()} rows, more than the bucket's {per_rank}")
        total = per_rank * self.ranks
        engram = [leaf.shape[2:] for leaf in built.engram_rows]
        out = empty_batch(self.layout, total, built.tokens.shape[1], engram, built.bitmask.shape[1],
                          built.block_tables.shape[1])

        def put(target, source):
            if isinstance(source, jax.Array) or np.ndim(source) == 0:
                return target  # an all-allowed bitmask kept on the device, or a per-step scalar
            source = np.asarray(source)
            target = np.repeat(source[padding[:1]], total, axis=0) if len(padding) else np.array(target)
            target[order] = source[real]
            return target

        scalars = {"budget": np.zeros((), np.int32), "draft": built.draft}
        out = jax.tree.map(put, out._replace(**scalars), built._replace(**scalars))
        out = out._replace(budget=np.broadcast_to(np.asarray(built.budget, np.int32), (self.ranks,)).copy())
        rank = np.arange(total) // per_rank
        held = np.zeros(total, bool)  # the placed rows of real ones; every other row pads on its rank's scratch
        held[order] = True
        unpaged = ~held[:, None] | (out.block_tables == self.global_layout.scratch_page)
        out = out._replace(slots=np.where(held, out.slots - rank * sp, sp).astype(np.int32),
                           block_tables=np.where(unpaged, pp, out.block_tables - rank[:, None] * pp).astype(np.int32))
        return out, order

    # ---- EPLB ---------------------------------------------------------------------------------------------
    def _record(self, steps: list[list[jax.Array]]) -> None:
        """Move the pair counts of dispatched steps (each step's: arrays [ranks, layers, slots] in layer order) to
        the host: into EPLB's window, or summed for the metric."""
        for parts in steps:
            loads = np.concatenate([to_host(part) for part in parts], axis=1).sum(axis=0)
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
            weights = (jax.tree.leaves(self.model.params), weights[1])  # a drafter's experts are not rebalanced
            stats["eplb_rebalances"] += 1
        balance = self.balancedness()
        if balance is not None:
            stats["eplb_balancedness"] = balance
        return weights

    def rebalance(self) -> None:
        """EPLB on the load window now (the moved weights are `model`'s). Every dispatched step is recorded first
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
    """One compiled bucket of `rows` rows per rank: called as a single-device step is, with the batch the engine
    built (`DataParallel.place` lays it out over the ranks, placed as the programs take it);
    returns the outputs in the batch's row order. `run` runs the placed batch."""

    def __init__(self, owner: DataParallel, rows: int, gather):
        self.owner, self.rows, self.gather = owner, rows, gather
        self.batch_shardings = None  # as the programs were compiled for (`DataParallel.shaped`), on the first call

    def run(self, weights: tuple, cache: EngineCache, batch: StepBatch) -> tuple[StepOutput, EngineCache, list]:
        """(outputs, cache, the expert loads counted: arrays [ranks, layers, slots]) of the placed `batch`."""
        raise NotImplementedError

    def __call__(self, weights: tuple, cache: EngineCache, batch: StepBatch):
        placed, placed_rows = self.owner.place(batch, self.rows)
        if self.batch_shardings is None:
            self.batch_shardings = jax.tree.map(lambda x: x.sharding, self.owner.shaped(placed))
        outputs, cache, loads = self.run(weights, cache, put(placed, self.batch_shardings))
        if loads:
            self.owner._loads.append(loads)
        order = np.zeros(self.rows * self.owner.ranks, np.int32)
        order[:len(placed_rows)] = placed_rows
        return self.gather(outputs, put(order, self.gather.input_shardings[0][1])), cache


class _OneProgram(_Executable):
    """One compiled bucket as one `shard_map` program (with experts over `ep`, it returns every layer's expert
    loads last)."""

    def __init__(self, owner: DataParallel, rows: int, step, gather):
        super().__init__(owner, rows, gather)
        self.step = step

    def run(self, weights: tuple, cache: EngineCache, batch: StepBatch) -> tuple[StepOutput, EngineCache, list]:
        if self.owner.ep == 1:
            return *self.step(weights, cache, batch), []
        outputs, cache, loads = self.step(weights, cache, batch)
        return outputs, cache, [loads]


class _LayeredExecutable(_Executable):
    """One compiled bucket as layer programs (`serving.core.layer_programs`), each a `shard_map` program over the
    mesh: with experts over `ep`, each layer program returns its layer's expert loads as well, which the chain
    does not see."""

    def __init__(self, owner: DataParallel, rows: int, programs: list, gather, plan: LayerPlan,
                 head_leaves: tuple[int, ...]):
        super().__init__(owner, rows, gather)
        self.loads: list[jax.Array] = []
        programs = [_Counted(p, self.loads) if _counts_loads(name, owner.ep) else p
                    for name, p in zip([*layer_program_names(plan), "decide"], programs, strict=True)]
        self.halves = LayeredHalves(programs, plan, head_leaves, viewed=False)

    def run(self, weights: tuple, cache: EngineCache, batch: StepBatch) -> tuple[StepOutput, EngineCache, list]:
        outputs, cache = self.halves(weights, cache, batch)
        loads, self.loads[:] = list(self.loads), []
        return outputs, cache, loads


def _counts_loads(name, ep: int) -> bool:
    """Whether the mesh program `name` (`LayerPlan.program`) returns its layer's expert loads: a layer program,
    with experts split over `ep`."""
    return isinstance(name, int) and ep > 1


class _Counted:
    """A layer program over the mesh called as the chain calls it: its last output, the layer's expert loads,
    goes to `loads`."""

    def __init__(self, program, loads: list):
        self.program, self.loads = program, loads

    def __call__(self, *args):
        *out, loads = self.program(*args)
        self.loads.append(loads)
        return tuple(out)


class _MeshLowering(Lowering):
    """Layer programs and the decide half compiled over the mesh (`DataParallel._sharded`): the layer programs
    count their layer's expert loads (experts over `ep`) and, when `split`, split their chunk over the context
    ranks; the embed program takes its rank's verify budget."""

    def __init__(self, owner: DataParallel, split: bool):
        self.owner, self.split = owner, split

    def abstract(self, tree):
        return self.owner.shaped(tree)

    def compile(self, name, fn: Callable, donated: tuple[int, ...], args: tuple):
        if name == "embed":
            embed = fn
            fn = lambda leaves, cache, batch: embed(leaves, cache, batch._replace(budget=batch.budget[0]))  # noqa: E731
        return self.owner._sharded(fn, donated, args, 1 if _counts_loads(name, self.owner.ep) else None,
                                   self.split)

    def out_info(self, name, compiled):
        info = compiled.out_info
        return info[:-1] if _counts_loads(name, self.owner.ep) else info

    def decide(self, halves: StepHalves, weights: tuple, cache: EngineCache, batch: StepBatch, fwd_info,
               verify_len: int):
        args = decide_inputs(halves, weights, cache, batch, fwd_info)
        return self.owner._sharded(functools.partial(halves.decide, verify_len=verify_len), (1,), args, None)


def _in_order(outputs: StepOutput, order: Int[Array, " rows"]) -> StepOutput:
    return jax.tree.map(lambda x: x[order] if x.ndim else x, outputs)


class _RankExperts(moe.ExpertDispatch):
    """The registry's routed-experts op (`op`: float or FP4 experts) inside a mesh step's shard_map: with experts
    over `ep` (`n_shards` > 1), this rank's pairs go to their expert shards by all-to-all over `ep`
    (`sharding.expert_parallel`) and the first `layers` MoE layers traced add their count of pairs per physical
    slot to `loads` [layers, slots], the i-th traced to row i (a drafter's, traced after the target's, are not
    counted); with `ep` = 1 each rank runs its pairs on its own experts. `loads` is a mutable array, so a layer
    traced inside control flow (V4.1's compact replay runs under `lax.cond`) counts its pairs from there. A
    decision one rank's data makes for a `lax.cond` is taken for every rank (`any_rank`). Every rank runs the
    same number of tokens, so its first token's index in the whole batch is rank x tokens: replicas share a busy
    expert's tokens across the ranks as in one batch. With `cp` > 1 context ranks (a prefill step split over
    them), each computes the experts of a contiguous 1/cp of the tokens and the results are gathered over `cp`;
    the pairs are counted for all of them."""

    def __init__(self, n_shards: int, layers: int, slots: int, cp: int = 1):
        self.n_shards, self.traced, self.cp = n_shards, 0, cp
        self.loads = jax.new_ref(jnp.zeros((layers, slots), jnp.int32))

    def first_token(self, tokens: int):
        return jax.lax.axis_index(TOKEN_AXES) * tokens

    def any_rank(self, pred: Bool[Array, ""]) -> Bool[Array, ""]:
        """Whether any rank's `pred` holds (`model.moe.any_rank`)."""
        return jax.lax.psum(pred.astype(jnp.int32), TOKEN_AXES) > 0

    def __call__(self, x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"],
                 *stacks_and_limit, op: str = "routed_experts") -> Float[Array, "t d"]:
        *stacks, limit = stacks_and_limit
        if self.n_shards > 1:
            layer, self.traced = self.traced, self.traced + 1
            if layer < self.loads.shape[0]:
                self.loads[layer] = self.loads[layer] + jnp.zeros(self.loads.shape[1], jnp.int32).at[
                    ids.reshape(-1)].add(1)
        tokens = x.shape[0]
        if self.cp == 1 or tokens % self.cp:
            return self._pairs(x, ids, weights, stacks, limit, op)
        share = tokens // self.cp
        part = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=jax.lax.axis_index("cp") * share,
                                 slice_size=share)
        out = self._pairs(part(x), part(ids), part(weights), stacks, limit, op)
        return jax.lax.all_gather(out, "cp", axis=0, tiled=True)

    def _pairs(self, x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"], stacks: list,
               limit, op: str) -> Float[Array, "t d"]:
        """This rank's `op` on its pairs: its own experts, or over `ep` by all-to-all."""
        if self.n_shards == 1:
            return registry.op(op)(x, ids, weights, *stacks, limit)
        return local_pairs(x, ids, weights.astype(jnp.float32), *stacks, limit=limit, axis="ep",
                           n_shards=self.n_shards, op=op)


def _spec_of(leaf) -> P:
    """How a step program's argument leaf splits over the mesh: a placed array (weights, cache) or a program's
    output as it is placed, a scalar replicated, any other leaf (the host's batch) on its leading axis over the
    attention ranks. Every leaf of an engine cache and a batch leads with its slot, row or page."""
    if np.ndim(leaf) == 0:
        return P()
    sharding = getattr(leaf, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else RANKS


def _cache_specs(cache: EngineCache) -> EngineCache:
    """PartitionSpecs of an engine cache's leaves from their logical axes (slots and pages over the ranks)."""
    return jax.tree.map(lambda axes: logical_spec(*axes), cache.axes(), is_leaf=lambda x: isinstance(x, tuple))
