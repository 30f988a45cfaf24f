"""This machine's roofline, measured: the GEMM peak at a decode step's matmul shapes and the streaming read
bandwidth, each the best of repeated timed calls (interference only ever adds time)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig


def call_seconds(jitted, *args, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of the jitted `jitted`, after one warm-up call (which compiles)."""
    jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    return times


def best_seconds(fn, *args, repeats: int = 20) -> float:
    """The fastest of `repeats` calls of the jitted `fn` after one warm-up call."""
    return min(call_seconds(jax.jit(fn), *args, repeats=repeats))


def step_matmul_shapes(config: ModelConfig, rows: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of a decode step's large matmuls for `rows` rows: expert and shared-expert projections,
    attention projections, the vocabulary head."""
    d, inter = config.hidden_size, config.moe_intermediate_size
    per_token_experts = max(1, rows * config.num_experts_per_tok // config.n_routed_experts)
    return [(per_token_experts, d, inter), (per_token_experts, inter, d), (rows, d, inter),
            (rows, d, config.num_attention_heads * config.head_dim), (rows, d, config.vocab_size)]


def gemm_peak(shapes: list[tuple[int, int, int]], repeats: int = 20) -> float:
    """FLOP/s of the fastest fp32 GEMM among `shapes` (operands resident: the best the step's shapes reach)."""
    rng = np.random.default_rng(0)
    best = 0.0
    for m, k, n in shapes:
        a, b = (jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in ((m, k), (k, n)))
        best = max(best, 2 * m * k * n / best_seconds(jnp.dot, a, b, repeats=repeats))
    return best


def read_bandwidth(megabytes: int = 256, repeats: int = 10) -> float:
    """Bytes/s of summing an fp32 array far larger than the caches (one streaming read)."""
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    return x.nbytes / best_seconds(jnp.sum, x, repeats=repeats)


def measure(config: ModelConfig, rows: tuple[int, ...]) -> dict[str, float]:
    """{"gemm_flops_per_s_b{r}"} per row count and {"read_bytes_per_s"}."""
    out = {f"gemm_flops_per_s_b{r}": gemm_peak(step_matmul_shapes(config, r)) for r in rows}
    return out | {"read_bytes_per_s": read_bandwidth()}
