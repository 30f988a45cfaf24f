"""Per-expert views of a stacked expert weight, for decode on the CPU backend.

A decode step of a token or two reads only its chosen experts. With the experts stacked as one [E, ...] array,
taking expert `e` is a dynamic slice, and XLA:CPU copies it before the matmul reads it (docs/benchmarks.md, "The
XLA:CPU forms"). `ExpertViews` holds one array per expert instead,
each an alias of its slice of the stack (`expert_views`: no copy, no second home for the weights), so a switch
over the experts multiplies by the chosen one where it lies.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jaxtyping import Array, Float


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ExpertViews:
    """A stacked expert weight [E, ...] as its E experts' arrays (`parts`)."""

    parts: tuple[Array, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    @property
    def dtype(self):
        return self.parts[0].dtype

    def __getitem__(self, key):
        """`views[...]` is the views (the read an `nnx.Variable` holding them makes)."""
        if key is not Ellipsis:
            raise TypeError(f"ExpertViews take no index but `...` (got {key!r}); pick an expert with `parts`")
        return self

    def tree_flatten(self):
        return self.parts, None

    @classmethod
    def tree_unflatten(cls, _, parts):
        return cls(tuple(parts))


def expert_views(stack: Float[Array, "e *rest"]) -> tuple[Array, ...]:
    """The E arrays aliasing the experts of `stack`, a weight held in this host's memory (the CPU backend): each
    a view of its expert's bytes, so the stack must outlive them (the views hold a reference to it)."""
    if stack.devices() != {jax.devices("cpu")[0]}:
        raise ValueError(f"expert views alias host memory: the stack lives on {stack.devices()}, not the CPU")
    host = np.asarray(stack)  # the stack's own buffer, no copy
    return tuple(jax.device_put(host[e], may_alias=True) for e in range(host.shape[0]))

