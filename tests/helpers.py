"""Test helpers: models whose every parameter is random (no zero sinks, biases or position biases)."""

import jax
import jax.numpy as jnp
from flax import nnx

from model.api import Model, init_model


def random_model(config, seed: int = 0, noise: float = 0.1, **init_kwargs) -> Model:
    """A model with every float parameter perturbed by `noise` (norms near 1), random hash-routing tables."""
    model = init_model(config, seed=seed, **init_kwargs)
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = []
    for key, leaf in zip(keys, leaves):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            out.append(jax.random.randint(key, leaf.shape, 0, config.n_routed_experts, leaf.dtype))
        else:
            out.append(leaf + noise * jax.random.normal(key, leaf.shape, leaf.dtype))
    return Model(nnx.merge(model.graphdef, jax.tree.unflatten(treedef, out)), engram=model.engram)
