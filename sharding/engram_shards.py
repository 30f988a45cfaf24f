"""Engram tables with their rows split over every device of a mesh, read by an owner gather.

Each device owns one contiguous range of rows (the table's logical `table_rows` axis, `EngramTable.axes`,
under `sharding.mesh.RULES`; the table is padded to a multiple of the device count). A lookup gives every
device all the indices; each reads the rows it owns, writes zeros elsewhere, and one sum over the devices
assembles the rows (exact: every element has one non-zero term). This is SGLang's `lookup=collective` mode;
the HBM each device spends on the table is 1/devices of it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float32, Int, Shaped

from model.engram import EngramTable, _checked_table, dequantize_rows
from sharding.mesh import RULES, logical_spec

ROW_AXES = RULES[EngramTable.axes[0]]  # the mesh axes a table's rows are split over
TABLE = logical_spec(*EngramTable.axes)


class ShardedEngramTable(EngramTable):
    """One Engram layer's table (FP8 rows + UE8M0 scales, or float32 rows) split by rows over `mesh`."""

    def __init__(self, weight: Shaped[np.ndarray, "rows d"], scale: Shaped[np.ndarray, "rows blocks"] | None,
                 mesh: Mesh):
        weight, scale = _checked_table(np.asarray(weight), None if scale is None else np.asarray(scale))
        self.num_rows, self.head_dim = weight.shape
        n = int(np.prod([mesh.shape[a] for a in ROW_AXES]))
        pad = ((0, -self.num_rows % n), (0, 0))
        rows = NamedSharding(mesh, TABLE)
        self.weight = jax.device_put(np.pad(weight, pad), rows)
        self.scale = None if scale is None else jax.device_put(np.pad(scale, pad), rows)
        self.mesh, self.rows_per_device = mesh, self.weight.shape[0] // n

    def gather(self, indices: Int[Array, "*idx"] | Int[np.ndarray, "*idx"]) -> Float32[Array, "*idx d"]:
        indices = jax.device_put(jnp.asarray(indices, jnp.int32), NamedSharding(self.mesh, P()))
        return _owner_gather(self.mesh, self.rows_per_device, self.weight, self.scale, indices)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _owner_gather(mesh: Mesh, rows_per_device: int, weight, scale, indices):
    def local(weight, scale, indices):
        offset = jax.lax.axis_index(ROW_AXES) * rows_per_device
        own = (indices >= offset) & (indices < offset + rows_per_device)
        at = jnp.where(own, indices - offset, 0)
        rows = dequantize_rows(jnp.take(weight, at, axis=0),
                               None if scale is None else jnp.take(scale, at, axis=0))
        return jax.lax.psum(jnp.where(own[..., None], rows, 0.0), ROW_AXES)

    return jax.shard_map(local, mesh=mesh, in_specs=(TABLE, None if scale is None else TABLE, P()),
                         out_specs=P())(weight, scale, indices)


def shard_engram(memory, config, mesh: Mesh):
    """An `EngramMemory` like `memory` (same canonical map, hashing) whose tables are split over `mesh`."""
    from model.engram import EngramMemory

    tables = [ShardedEngramTable(np.asarray(t.weight), None if t.scale is None else np.asarray(t.scale), mesh)
              for t in memory.tables]
    return EngramMemory(config, memory.token_map, tables)
