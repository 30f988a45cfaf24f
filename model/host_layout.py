"""A model's weights in the layout the CPU backend multiplies fastest, and back to the checkpoint's.

On XLA:CPU a batched decode step spends most of its time multiplying several rows through [out, in] weights:
the routed experts' and the linear maps'. The same products through the transposed weights [in, out] run 1.4-2x
as fast (`xla_cpu.transposed_weights`). `host_layout` holds a model's fp32 linear maps and routed-expert
stacks transposed, in place; the model computes the same function (`dot_f32` and the expert ops read either
layout). `checkpoint_layout` gives the model back in the checkpoint's layout, for what stores, quantizes or
shards the weights.
"""

import jax
from flax import nnx

from model import registry
from model.api import Model
from model.linear import Linear
from xla_cpu.transposed_weights import TransposedWeight, logical, transposed

EXPERT_STACKS = frozenset({"w1", "w2", "w3"})
KEPT = frozenset({"head"})  # linear maps others read directly (a DSpark drafter reads the vocabulary head)


def unsupported_here() -> str | None:
    """Why this process cannot run a model in the host layout (None: it can): the layout is the CPU backend's,
    read by its XLA:CPU forms (`xla_cpu`)."""
    if not registry.runs_host_forms():
        return f"this process runs {jax.default_backend()} with {registry.implementation()} kernels"
    return None


def _linear_weights(model: Model) -> set[tuple]:
    """The parameter paths of the model's float linear maps (`Linear`, not FP8) but those named in `KEPT`."""
    return {(*path, "weight") for path, node in nnx.iter_graph(model.module())
            if type(node) is Linear and path[-1] not in KEPT}


def _held_transposed(path: tuple, value, linears: set[tuple]) -> bool:
    """Whether the host layout holds this fp32 parameter transposed: a linear map's weight, a routed-expert stack."""
    if isinstance(value, TransposedWeight) or value.dtype != jax.numpy.float32:
        return False
    return path in linears or (len(path) >= 2 and path[-2] == "experts" and path[-1] in EXPERT_STACKS)


def host_layout(model: Model) -> int:
    """Hold `model`'s fp32 linear maps (but the vocabulary head) and routed-expert stacks transposed, in place:
    each weight is replaced as it is converted, so the model never holds one twice. Returns how many weights
    changed (0 when already done)."""
    linears, changed = _linear_weights(model), 0
    for path, var in nnx.to_flat_state(model.params):
        value = var.get_value()
        if _held_transposed(tuple(path), value, linears):
            var.set_value(transposed(value))
            changed += 1
    return changed


def has_host_layout(model: Model) -> bool:
    """Whether any of `model`'s weights is held transposed."""
    return any(isinstance(var.get_value(), TransposedWeight) for _, var in nnx.to_flat_state(model.params))


def checkpoint_layout(model: Model) -> Model:
    """`model` with every transposed weight in the checkpoint layout again: a new `Model` (sharing the other
    arrays; `model` is unchanged), or `model` itself when it holds none."""
    if not has_host_layout(model):
        return model
    params = jax.tree.map(logical, model.params, is_leaf=lambda x: isinstance(x, TransposedWeight))
    return Model(nnx.merge(model.graphdef, params), tokenizer=model.tokenizer, engram=model.engram,
                 drafter=model.drafter)
