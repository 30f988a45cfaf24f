"""Logical axis names of the model's arrays, attached where each parameter and cache leaf is created.

A parameter's NNX metadata `out_sharding` names one logical axis per dimension (flax 0.12's form; the
older `sharding_names` is deprecated). The model only names axes: `sharding.mesh.RULES` maps each name to
mesh axes, so the same module places itself on any mesh. Names and what they index:

- `expert`: the routed-expert bank (or its physical EPLB slots), split over `ep`;
- `batch`: request rows of a cache or batch; `seq`: tokens of a sequence; `pages`: an engine's page pool;
- `table_rows`: rows of an Engram table, split over every device;
- `vocab`, `embed` (hidden size), `mlp` (an expert's intermediate size), `out` / `in` (a linear map's
  output and input features), `router` (the router's per-expert scores, needed whole by every token),
  `topk` (a token's routed slots), `replica` (an expert's replica slots), `heads` (attention heads),
  `norm` (a norm's gains), `window` (a compressor's window positions), `hc` (mHC streams and their mixing
  weights), `hc_scale` (mHC scales): replicated today.

Eager sharding is off: a model is built without a mesh and placed afterwards (`sharding.mesh.shard_model`).
"""

from __future__ import annotations

import jax
from flax import nnx


def param(value: jax.Array | jax.ShapeDtypeStruct, *axes: str | None, variable: type[nnx.Variable] = nnx.Param) -> nnx.Variable:
    """`value` as a `variable` (an `nnx.Param` unless given) carrying one logical axis name per dimension."""
    if len(axes) != len(value.shape):
        raise ValueError(f"a parameter of shape {value.shape} needs {len(value.shape)} logical axes, got {axes}")
    return variable(value, out_sharding=axes, eager_sharding=False)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axes a parameter was created with (its `out_sharding` metadata); refuses one without them."""
    axes = variable.get_metadata().get("out_sharding")
    if axes is None or len(axes) != len(variable.shape):
        raise ValueError(f"a {type(variable).__name__} of shape {variable.shape} carries logical axes {axes}; "
                         f"create it with model.axes.param")
    return tuple(axes)


def batch_axes(leaf) -> tuple[str | None, ...]:
    """Logical axes of a batch-first array (a cache leaf, a token block): rows over `batch`; scalars none."""
    return ("batch",) + (None,) * (len(leaf.shape) - 1) if leaf.shape else ()
