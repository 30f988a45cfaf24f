"""A model's weights in the layout the CPU backend multiplies fastest, and back to the checkpoint's.

On XLA:CPU a batched decode step spends most of its time in the routed experts, several rows per expert through
the expert's [out, in] weight. The same product through the transposed weight [in, out] runs about 1.4x as fast
(`pallas_kernels.transposed_weights`). `host_layout` holds every fp32 routed-expert stack of a model transposed,
in place; the model computes the same function (the expert ops read either layout). `checkpoint_layout` gives
the model back in the checkpoint's layout, for what stores, quantizes or shards the weights.
"""

import jax
from flax import nnx

from model.api import Model
from pallas_kernels.transposed_weights import TransposedWeight, logical, transposed

EXPERT_STACKS = frozenset({"w1", "w2", "w3"})


def _is_float_expert_stack(path: tuple, value) -> bool:
    return (len(path) >= 2 and path[-2] == "experts" and path[-1] in EXPERT_STACKS
            and not isinstance(value, TransposedWeight) and value.dtype == jax.numpy.float32)


def host_layout(model: Model) -> int:
    """Hold `model`'s fp32 routed-expert stacks transposed, in place: each stack is replaced as it is converted,
    so the model never holds a stack twice. Returns how many stacks changed (0 when already done)."""
    changed = 0
    for path, var in nnx.to_flat_state(model.params):
        value = var.get_value()
        if _is_float_expert_stack(path, value):
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
