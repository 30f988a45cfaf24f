"""Sharded parameter checkpoints (orbax) that restore onto a different mesh.

`save_params` writes a model's parameters as they are sharded (every device its own shards);
`restore_params` reads them straight into the placement the rules give on another mesh (e.g. saved on
dp=8,ep=4, served on ep=2), each device reading only its shards, never a full copy.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from sharding.mesh import check_divisible, param_shardings


def save_params(model, path: str | Path) -> None:
    """Write `model.params` (any sharding) as an orbax checkpoint directory `path` (must not exist)."""
    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"checkpoint directory {path} already exists")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, nnx.to_pure_dict(model.params))


def restore_params(path: str | Path, config, mesh, dtype: str = "float32"):
    """A Model of `config` whose parameters are read from `path` onto `mesh` by the sharding rules."""
    from model.api import Model, abstract_model

    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    shapes = abstract_model(config, dtype)
    shardings = param_shardings(shapes.params, mesh)
    check_divisible(shapes.params, shardings)
    target = jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
                          nnx.to_pure_dict(shapes.params), nnx.to_pure_dict(shardings))
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, target)
    params = shapes.params
    nnx.replace_by_pure_dict(params, restored)
    return Model(nnx.merge(shapes.graphdef, params))
