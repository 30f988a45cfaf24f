"""Model size and cache figures read off the real parameter and cache shapes (abstract evaluation, no memory)."""

import math

import jax
import numpy as np
from flax import nnx

from model.api import abstract_model
from model.config import ModelConfig


def _cache_elements(model, length: int) -> tuple[int, int]:
    """(elements, bytes) of the main layers' reference cache for one sequence of `length` tokens."""
    shapes = jax.eval_shape(lambda: model.module().init_cache(1, length)["layers"])
    leaves = jax.tree.leaves(shapes)
    return (sum(math.prod(x.shape) for x in leaves),
            sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves))


def model_stats(config: ModelConfig, dtype: str = "bfloat16") -> dict:
    """Parameter counts (total, active per token, MTP) and cache bytes per token / per sequence."""
    model = abstract_model(config, dtype)
    total = active = mtp = param_bytes = 0
    k_over_e = config.num_experts_per_tok / config.n_routed_experts
    for path, var in nnx.to_flat_state(model.params):
        size = math.prod(var.shape)
        param_bytes += size * np.dtype(var.dtype).itemsize
        if path[0] == "mtp":
            mtp += size
            continue
        total += size
        routed = len(path) >= 2 and path[-2] == "experts"
        active += size * k_over_e if routed else size
    period = math.lcm(*(r for r in config.compress_ratios if r), config.sliding_window)
    n = period * max(1, min(4096, config.max_position_embeddings // 2) // period)
    elems_1, bytes_1 = _cache_elements(model, n)
    elems_2, bytes_2 = _cache_elements(model, 2 * n)
    per_token_elems = (elems_2 - elems_1) / n
    return {
        "params_total": total,
        "params_active_per_token": int(round(active)),
        "params_mtp": mtp,
        "param_bytes": param_bytes,
        "kv_elements_per_token": per_token_elems,
        "kv_bytes_per_token": (bytes_2 - bytes_1) / n,
        "kv_bytes_per_token_bf16": 2 * per_token_elems,
        "kv_fixed_bytes_per_sequence": bytes_1 - (bytes_2 - bytes_1),
    }
