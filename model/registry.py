"""Operations the model calls by name, each with three implementations of one signature: the pure-jnp reference
(the math, `pallas_kernels`), the Pallas kernel (`pallas_kernels`) and the XLA:CPU form (`xla_cpu`: the reference
where XLA:CPU needs no other), and the one value that says how functions traced now compute them
(`TraceChoices`).

The implementation is chosen when a function is traced: `use(...)` forces one (the `--kernels` flag), otherwise
the environment variable `JAXSEEK_KERNELS` if set (e.g. for the benchmark scripts), otherwise the platform
decides: NVIDIA GPUs run the Pallas kernels, the CPU the XLA:CPU forms, other platforms (Ascend) the references.
Pallas off a GPU runs in interpret mode (tests). Set the choice before compiling: jitted functions keep what
they were traced with.
"""

import contextlib
import dataclasses
import os
from collections.abc import Callable

import jax

from pallas_kernels import fp4_experts, hyper, moe, paged_attention, quant_linear, sparse_attention
from xla_cpu import fp4_experts as cpu_fp4_experts, linear as cpu_linear, moe as cpu_moe

IMPLEMENTATIONS = ("reference", "pallas", "xla_cpu")


@dataclasses.dataclass(frozen=True)
class TraceChoices:
    """Everything outside a traced function's arguments that changes what it computes, in one value: the
    implementation forced for every operation (None: `default_implementation()`), wrappers of single operations
    (name, wrapper: `op(name)` is `wrapper(implementation)`, e.g. the per-device form of a mesh,
    `sharding.context_parallel`), and how MoE layers run their routed experts (`experts`: a
    `model.moe.ExpertDispatch`, e.g. split over a mesh's `ep` axis; None: the local `routed_experts` op).

    The choices in force are the innermost `tracing(...)` block's, else the process's (`set_implementation`)."""

    kernels: str | None = None
    wrappers: tuple[tuple[str, Callable[[Callable], Callable]], ...] = ()
    experts: Callable | None = None


_active: list[TraceChoices] = [TraceChoices()]  # [the process's, then one per open `tracing` block, innermost last]


def choices() -> TraceChoices:
    """The choices functions traced now are traced with."""
    return _active[-1]


@contextlib.contextmanager
def tracing(**changes):
    """Trace the functions traced inside this block with `choices()` changed by `changes` (TraceChoices
    fields)."""
    _active.append(dataclasses.replace(choices(), **changes))
    try:
        yield _active[-1]
    finally:
        _active.pop()


def ops() -> dict[str, tuple[Callable, Callable, Callable]]:
    """Every operation: name -> (reference, pallas, xla_cpu)."""
    paired = {**sparse_attention.OPS, **paged_attention.OPS, **moe.OPS, **hyper.OPS, **quant_linear.OPS,
              **fp4_experts.OPS}
    cpu = {**cpu_moe.OPS, **cpu_linear.OPS, **cpu_fp4_experts.OPS}
    return {name: (reference, pallas, cpu.get(name, reference)) for name, (reference, pallas) in paired.items()}


def default_implementation() -> str:
    """What runs when nothing is forced: `JAXSEEK_KERNELS` if set, else what the platform runs (Pallas on an
    NVIDIA GPU, the XLA:CPU forms on the CPU, the references elsewhere)."""
    if os.environ.get("JAXSEEK_KERNELS"):
        return _check(os.environ["JAXSEEK_KERNELS"])
    platform = (jax.config.jax_platforms or jax.default_backend()).split(",")[0]  # as chosen, e.g. a plugin's
    return {"gpu": "pallas", "cuda": "pallas", "cpu": "xla_cpu"}.get(platform, "reference")


def implementation() -> str:
    """The implementation that functions traced now will use."""
    return choices().kernels or default_implementation()


def runs_host_forms() -> bool:
    """Whether functions traced now run the XLA:CPU forms on the CPU backend: the forms that read weights held in
    host memory as `xla_cpu` holds them (transposed, per-expert views)."""
    return jax.default_backend() == "cpu" and implementation() == "xla_cpu"


def _check(impl: str) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"kernels must be one of {IMPLEMENTATIONS}, got {impl!r}")
    return impl


def set_implementation(impl: str | None) -> None:
    """Force an implementation (`IMPLEMENTATIONS`) for this process from now on (None: back to the platform default)."""
    _active[0] = dataclasses.replace(_active[0], kernels=None if impl is None else _check(impl))


def use(impl: str):
    """Force an implementation for functions traced inside this block (a `tracing` block)."""
    return tracing(kernels=_check(impl))


def wrap(name: str, wrapper: Callable[[Callable], Callable]):
    """Functions traced inside this block call `wrapper(implementation)` for operation `name` (a `tracing`
    block)."""
    op(name)  # an unknown name fails here
    return tracing(wrappers=choices().wrappers + ((name, wrapper),))


def op(name: str) -> Callable:
    """The implementation of operation `name` chosen for the current trace (wrapped by active `wrap`s)."""
    table = ops()
    if name not in table:
        raise KeyError(f"no kernel operation {name!r}; known: {sorted(table)}")
    chosen = table[name][IMPLEMENTATIONS.index(implementation())]
    for wrapped, wrapper in choices().wrappers:
        if wrapped == name:
            chosen = wrapper(chosen)
    return chosen
