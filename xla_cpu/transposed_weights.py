"""Float weights held as their transpose, the layout XLA:CPU multiplies fastest.

A checkpoint stores a linear map as W [out, in] (and a routed-expert stack as [E, out, in]); the model computes
x W^T. On the CPU backend, XLA runs a product of several rows through W^T [in, out] up to twice as fast as through
W [out, in] (docs/benchmarks.md, "The XLA:CPU forms"). `TransposedWeight` holds W^T and says it is W: its `shape` is W's,
so code that reads shapes is unchanged, and the XLA:CPU forms of `dot_f32` and the routed experts contract it in its own layout
(`model.host_layout` puts a model's weights in this form; the checkpoint layout comes back with `logical`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from xla_cpu.expert_views import ExpertViews


HELD_KEY = "t"  # the key path entry of a TransposedWeight's array in a pytree (`GetAttrKey` of its field)


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True)
class TransposedWeight:
    """A weight W [..., o, i] held as `t` = W^T [..., i, o] (the last two axes swapped); inside a CPU engine's
    layer program, a transposed expert stack may come as its per-expert views (`ExpertViews` of [i, o] arrays)."""

    t: Array | ExpertViews

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.t.shape[:-2], self.t.shape[-1], self.t.shape[-2])

    @property
    def dtype(self):
        return self.t.dtype

    @property
    def ndim(self) -> int:
        return len(self.t.shape)

    def __getitem__(self, key):
        """`w[...]` is `w` (the read an `nnx.Variable` holding it makes); `w[e]` indexes the leading (expert)
        axes, giving expert e's weight, still transposed."""
        if key is Ellipsis:
            return self
        keys = key if isinstance(key, tuple) else (key,)
        if Ellipsis in keys or len(keys) > self.ndim - 2:
            raise TypeError(f"a TransposedWeight of shape {self.shape} takes `...` alone or indices of its leading "
                            f"(stack) axes, not {key!r}")
        return TransposedWeight(self.t[key])

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey(HELD_KEY), self.t),), None

    def tree_flatten(self):
        return (self.t,), None

    @classmethod
    def tree_unflatten(cls, _, leaves):
        """Any leaf, as pytree maps make (shapes, shardings, leaf indices), not only an array."""
        held = object.__new__(cls)
        object.__setattr__(held, HELD_KEY, leaves[0])
        return held


def transposed(w: Float[Array, "*e o i"]) -> TransposedWeight:
    """W in the transposed layout (a new array; W itself is left as it is)."""
    return TransposedWeight(jnp.swapaxes(w, -1, -2))


def logical(w) -> Array:
    """The weight in the checkpoint's layout [..., o, i] (a transposed copy of a `TransposedWeight`; anything else
    as it is)."""
    return jnp.swapaxes(w.t, -1, -2) if isinstance(w, TransposedWeight) else w
