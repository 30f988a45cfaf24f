"""A decode step's weight products alone: the least time this machine's XLA takes for the matrix products a
step of `rows` rows needs (`model.step_cost`'s FLOPs), in the layout and the forms the engine multiplies them
(`dot_f32`), and nothing else.

Against the roofline it is the ceiling of a step that multiplies these weights in these forms: the step's
attention, norms, routing and state writes only add to it. Each weight is multiplied once, one after the other
(each product's input scaled by a scalar taken from the one before, as a layer's products depend on each other):
a matrix by every row; a routed-expert stack, for `rows * k` (row, expert) pairs, by one row through each of the
first `rows * k` experts when they are fewer than the experts, otherwise by `rows * k / E` rows through every
expert in one batched product (uniform routing, the pairs' FLOPs exactly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from benchmarks.roofline import call_seconds
from model.api import Model
from model.step_cost import weight_role
from xla_cpu.linear import dot_f32


def step_weights(model: Model, rows: int) -> tuple[list, tuple[int, ...]]:
    """The weights a decode step of `rows` rows multiplies, as the products program takes them, and how many rows
    go through each: each matrix (`rows`), and per routed-expert stack either the experts used, when the pairs
    are fewer than its experts (one row each), or the stack (`rows * k / E` rows through every expert)."""
    config = model.config
    pairs, n_exp = rows * config.num_experts_per_tok, config.n_routed_experts
    weights, counts = [], []
    for path, var in nnx.to_flat_state(model.params):
        value = var.get_value()
        role = weight_role(tuple(path), value.shape, value.dtype)
        if role == "matrix":
            weights.append(value)
            counts.append(rows)
        elif role == "experts" and pairs < n_exp:
            weights.extend(value[e] for e in range(pairs))
            counts.extend([1] * pairs)
        elif role == "experts":
            weights.append(value)
            counts.append(pairs // n_exp)
    return weights, tuple(counts)


def _products(x0: Float[Array, "r i"], weights: list, counts: tuple[int, ...]) -> Float[Array, ""]:
    """Every weight's product with its count of rows, in turn; a scalar depending on all of them. A 3-D weight
    (an expert stack, a grouped map [g, o, i]) takes its rows through each of its g matrices."""
    s = jnp.float32(1)
    for w, n in zip(weights, counts, strict=True):
        x = x0[:n, : w.shape[-1]]
        if len(w.shape) == 3:
            x = jnp.broadcast_to(x[:, None], (n, w.shape[0], w.shape[-1]))
        y = dot_f32(x * s, w)
        s = 1 + 1e-9 * y.reshape(-1)[0]
    return s


class StepProducts:
    """The weight products of `model`'s decode steps, one compiled program per row count."""

    def __init__(self, model: Model):
        self.model = model
        self._programs: dict[int, tuple] = {}

    def program(self, rows: int) -> tuple:
        """(jitted products program, its arguments) for `rows` rows."""
        if rows not in self._programs:
            weights, counts = step_weights(self.model, rows)
            width = max(w.shape[-1] for w in weights)
            x0 = jnp.asarray(np.random.default_rng(0).normal(size=(max(counts), width)), jnp.float32)
            run = jax.jit(lambda x, ws: _products(x, ws, counts))
            self._programs[rows] = (run, (x0, weights))
        return self._programs[rows]

    def seconds(self, rows: int, repeats: int = 20) -> float:
        """The least time of `repeats` runs of the products of a `rows`-row step (interference only adds)."""
        run, args = self.program(rows)
        return min(call_seconds(run, *args, repeats=repeats))

    def flops(self, rows: int) -> float:
        """The FLOPs XLA counts in the compiled products program of `rows` rows."""
        run, args = self.program(rows)
        return float(run.lower(*args).compile().cost_analysis()["flops"])
