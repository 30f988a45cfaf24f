"""Tile sizes and compiler settings of the Pallas kernels, per target: SM90, SM100, or interpret mode (CPU).

The kernels are written once in `pl.pallas_call` form; on NVIDIA they lower through Pallas' Triton backend
(the GPU backend that takes a grid of programs with in-kernel gathers; Mosaic GPU needs the CUDA plugin even
to lower, so nothing here could check it). A variant is a tile table plus warps / pipeline stages, picked by
the device's compute capability. Interpret mode uses small tiles so tests cross several blocks.
"""

import contextlib
import dataclasses
import functools
import os

import jax


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Block sizes of every kernel for one target."""

    attn_block_k: int        # keys per online-softmax step
    attn_decode_heads: int   # heads per program when a call has few queries (decode); prefill takes all heads
    attn_decode_splits: int  # key-list splits per query in decode (partial softmax states, combined after)
    moe_block_m: int         # sorted (token, expert) rows per tile; each tile belongs to one expert
    moe_block_n: int         # output columns per program
    moe_block_k: int         # contraction step
    hc_block_t: int          # tokens per mHC program
    hc_block_d: int          # hidden columns per step of the mHC reduction
    qlinear_block_m: int     # activation rows per FP8-weight GEMM program
    qlinear_block_n: int     # output columns per FP8-weight GEMM program
    qlinear_block_k: int     # contraction step (at most one scale block)
    num_warps: int = 4
    num_stages: int = 2


VARIANTS = {
    "interpret": Tiles(attn_block_k=2, attn_decode_heads=2, attn_decode_splits=2,
                       moe_block_m=4, moe_block_n=16, moe_block_k=16, hc_block_t=4, hc_block_d=16,
                       qlinear_block_m=4, qlinear_block_n=16, qlinear_block_k=16),
    "sm90": Tiles(attn_block_k=32, attn_decode_heads=16, attn_decode_splits=4,
                  moe_block_m=16, moe_block_n=64, moe_block_k=64, hc_block_t=16, hc_block_d=128,
                  qlinear_block_m=16, qlinear_block_n=64, qlinear_block_k=64, num_warps=4, num_stages=3),
    "sm100": Tiles(attn_block_k=64, attn_decode_heads=16, attn_decode_splits=4,
                   moe_block_m=16, moe_block_n=128, moe_block_k=64, hc_block_t=16, hc_block_d=128,
                   qlinear_block_m=16, qlinear_block_n=128, qlinear_block_k=128, num_warps=8, num_stages=3),
}
DECODE_MAX_QUERIES = 8  # calls with at most this many queries per row use the decode form (MTP: gamma + 1)


_forced: list[str] = []


def host_cores() -> int:
    """The CPU cores this process may run on (XLA:CPU's thread pool has one thread per core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compute_capability() -> tuple[int, int]:
    """(major, minor) of the first GPU."""
    return tuple(int(part) for part in jax.devices()[0].compute_capability.split("."))


@functools.cache
def _detected() -> str:
    if jax.default_backend() != "gpu":
        return "interpret"
    return "sm100" if compute_capability() >= (10, 0) else "sm90"


def variant() -> str:
    """`interpret` unless the default backend is an NVIDIA GPU; then `sm100` from compute capability 10.0 up,
    else `sm90`. `target(name)` overrides it (lowering for a GPU that is not attached)."""
    return _forced[-1] if _forced else _detected()


@contextlib.contextmanager
def target(name: str):
    """Trace the kernels for variant `name` inside this block."""
    if name not in VARIANTS:
        raise ValueError(f"unknown kernel variant {name!r}; choose one of {sorted(VARIANTS)}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def tiles() -> Tiles:
    return VARIANTS[variant()]


def call_options() -> dict:
    """Keyword arguments for `pl.pallas_call`: interpret mode off GPU, Triton warps / stages on GPU."""
    if variant() == "interpret":
        return {"interpret": True}
    from jax.experimental.pallas import triton as pltriton

    t = tiles()
    return {"compiler_params": pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)}


def fit(block: int, size: int) -> int:
    """The largest power of two <= `block` that divides `size` (tiles must divide the axis they step over)."""
    b = 1
    while b * 2 <= block and size % (b * 2) == 0:
        b *= 2
    return b


def next_pow2(size: int) -> int:
    """The smallest power of two >= `size` (Triton needs every block and value a power of two per dimension;
    a block past the array's end is masked on load and store)."""
    return 1 << max(size - 1, 0).bit_length()
