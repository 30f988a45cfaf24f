"""Where an engine's requests, cache and compiled steps live: one device (`OneDevice`, a mesh of one rank) or a
mesh (`serving.core.engine_dp.DataParallel`: attention data parallelism, experts over `ep`). The engine holds one and
never asks which: the placement makes the scheduler and the cache, compiles each bucket's step and wraps it so
that every step is called alike (`executable(weights, cache, batch)`, the batch as the engine built it, the
outputs in its row order), and runs what follows a step (EPLB). Its flags say what its steps support: layer
programs, storage in the executable cache, decode steps in halves (token masks filled while the forward runs).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int

from serving.base.engine_config import EngineConfig
from serving.core.engine_dp import DataParallel
from serving.base.kv_cache import CacheLayout, EngineCache, init_engine_cache
from serving.core.layer_programs import LayeredHalves, LayerPlan, compile_layered
from serving.core.scheduler import Scheduler
from serving.core.step import CompiledHalves, StepHalves, compile_halves, compile_step, empty_batch


class OneDevice:
    """The engine on one device: a mesh of one rank (the interface `DataParallel` shares)."""

    ranks = 1
    ep = 1  # expert shards: every expert on the one device
    layer_programs = True  # a forward half may run as a chain of layer programs (`serving.core.layer_programs`)
    masks_during_forward = True  # a decode bucket runs in halves: constrained rows' masks fill during its forward

    def __init__(self, model, layout: CacheLayout):
        self.model, self.layout = model, layout

    def scheduler(self, layout: CacheLayout, *args, **kwargs) -> Scheduler:
        """The engine's scheduler over `layout`: `Scheduler`'s arguments."""
        return Scheduler(layout, *args, **kwargs)

    def cache_slot(self, slot: int) -> int:
        """Where the scheduler's `slot` lies in the cache: there."""
        return slot

    def cache_pages(self, pages: Int[np.ndarray, " p"]) -> Int[np.ndarray, " p"]:
        """Where the scheduler's `pages` lie in the cache: there."""
        return pages

    def init_cache(self, module, drafter=None) -> EngineCache:
        """The engine's empty cache (`serving.base.kv_cache.init_engine_cache`)."""
        return init_engine_cache(module, self.layout, drafter)

    def compile(self, halves: StepHalves, plan: LayerPlan | None, weights: tuple, cache: EngineCache,
                bucket: tuple[int, int, int, int], engram_shapes=()) -> list:
        """The compiled programs of `bucket` (what the executable cache stores): layer programs under `plan`, a
        decode / verify bucket's two halves, or a prefill bucket's one step."""
        rows, width, verify_len, pages = bucket
        batch = empty_batch(self.layout, rows, width, engram_shapes, verify_len, pages)
        if plan is not None:
            return compile_layered(halves, plan, weights, cache, batch, verify_len)
        if width == verify_len:  # in halves, for masks filled during the forward
            return compile_halves(halves, weights, cache, batch, verify_len).executables
        return [compile_step(halves.step, weights, cache, batch, verify_len)]

    def wrap(self, executables: list, halves: StepHalves, plan: LayerPlan | None, bucket: tuple[int, int, int, int]):
        """The step of `bucket` from its `compile`d (or stored) programs."""
        rows, width, verify_len, _ = bucket
        if plan is not None:
            return LayeredHalves(executables, plan, halves.head_leaves, plan.viewed(rows, width))
        return CompiledHalves(executables, halves.head_leaves) if width == verify_len else executables[0]

    def after_step(self, weights: tuple, stats: dict) -> tuple:
        """Nothing follows a step on one device: the step's weights stay."""
        return weights


def placement_for(config: EngineConfig, model, layout: CacheLayout) -> OneDevice | DataParallel:
    """The placement `config.mesh` asks for (None: one device), over the engine's whole `layout`."""
    if config.mesh is None:
        return OneDevice(model, layout)
    return DataParallel(config.mesh, model, layout, redundant_experts=config.redundant_experts,
                        eplb_every=config.eplb_every, eplb_window=config.eplb_window)
