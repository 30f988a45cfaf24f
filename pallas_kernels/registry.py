"""Operations the model calls by name, each with a pure-jnp reference and a Pallas kernel of the same signature.

The choice is made when a function is traced: `use(...)` forces `reference` or `pallas` (the `--kernels`
flag), otherwise the environment variable `JAXSEEK_KERNELS` if set (e.g. for the benchmark scripts), otherwise
the platform decides: NVIDIA GPUs run the Pallas kernels, CPU and Ascend the references.
Pallas on CPU runs in interpret mode (tests). Set the choice before compiling: jitted functions keep what
they were traced with.
"""

import contextlib
import os
from collections.abc import Callable

import jax

from pallas_kernels import fp4_experts, hyper, moe, paged_attention, quant_linear, sparse_attention

IMPLEMENTATIONS = ("reference", "pallas")
_chosen: list[str] = []
_wrappers: list[tuple[str, Callable[[Callable], Callable]]] = []


def ops() -> dict[str, tuple[Callable, Callable]]:
    """Every operation: name -> (reference, pallas)."""
    return {**sparse_attention.OPS, **paged_attention.OPS, **moe.OPS, **hyper.OPS, **quant_linear.OPS,
            **fp4_experts.OPS}


def default_implementation() -> str:
    """What runs when nothing is forced: `JAXSEEK_KERNELS` if set, else what the platform runs (Pallas on an
    NVIDIA GPU, the references elsewhere)."""
    if os.environ.get("JAXSEEK_KERNELS"):
        return _check(os.environ["JAXSEEK_KERNELS"])
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def implementation() -> str:
    """The implementation that functions traced now will use."""
    return _chosen[-1] if _chosen else default_implementation()


def _check(impl: str) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"kernels must be one of {IMPLEMENTATIONS}, got {impl!r}")
    return impl


def set_implementation(impl: str | None) -> None:
    """Force `reference` or `pallas` from now on (None: back to the platform default)."""
    _chosen.clear()
    if impl is not None:
        _chosen.append(_check(impl))


@contextlib.contextmanager
def use(impl: str):
    """Force `reference` or `pallas` for functions traced inside this block."""
    _chosen.append(_check(impl))
    try:
        yield
    finally:
        _chosen.pop()


@contextlib.contextmanager
def wrap(name: str, wrapper: Callable[[Callable], Callable]):
    """Functions traced inside this block call `wrapper(implementation)` for operation `name` (e.g. the
    implementation run per device of a mesh, `sharding.context_parallel`)."""
    op(name)  # an unknown name fails here
    _wrappers.append((name, wrapper))
    try:
        yield
    finally:
        _wrappers.pop()


def op(name: str) -> Callable:
    """The implementation of operation `name` chosen for the current trace (wrapped by active `wrap`s)."""
    table = ops()
    if name not in table:
        raise KeyError(f"no kernel operation {name!r}; known: {sorted(table)}")
    chosen = table[name][IMPLEMENTATIONS.index(implementation())]
    for wrapped, wrapper in _wrappers:
        if wrapped == name:
            chosen = wrapper(chosen)
    return chosen
