"""Model size and cache figures read off the real parameter and cache shapes (abstract evaluation, no memory)."""

import math
from pathlib import Path

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


def param_counts(model, config) -> dict:
    """Parameters of the main stack (total, and active per token: routed experts count k/E of theirs) and of
    the MTP blocks, of a float model."""
    counts = {"total": 0, "active": 0.0, "mtp": 0}
    k_over_e = config.num_experts_per_tok / config.n_routed_experts
    for path, var in nnx.to_flat_state(model.params):
        size = math.prod(var.shape)
        if path[0] == "mtp":
            counts["mtp"] += size
            continue
        counts["total"] += size
        counts["active"] += size * k_over_e if len(path) >= 2 and path[-2] == "experts" else size
    return counts


def resident_bytes(model) -> int:
    """Bytes of a model's parameter arrays as they sit in memory (the sum over its arrays: FP8 values, packed
    FP4 bytes and their scales as they are); an abstract model's shapes give the same figure."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(model.params))


def param_bytes_by_format(config, path=None) -> dict[str, int]:
    """`param_bytes_<format>` for every resident format (`model.checkpoint.WEIGHTS`): of the checkpoint at
    `path` as `load_model` would hold it when that directory holds weights, else of the config as DeepSeek
    ships it (`layout_for`)."""
    from model.checkpoint import WEIGHTS, checkpoint_model, layout_for

    if path is not None and not (Path(path).is_dir() and any(Path(path).glob("*.safetensors"))):
        path = None
    return {f"param_bytes_{w}": resident_bytes(checkpoint_model(path, w) if path else
                                               layout_for(config, w).model(config)) for w in WEIGHTS}


def model_stats(config: ModelConfig, path=None) -> dict:
    """Parameter counts (total, active per token, MTP), parameter bytes per resident format (of the checkpoint
    at `path` when given) and cache bytes per token / per sequence."""
    model = abstract_model(config, "bfloat16")
    counts = param_counts(model, config)
    period = math.lcm(*(r for r in config.compress_ratios if r), config.sliding_window)
    n = period * max(1, min(4096, config.max_position_embeddings // 2) // period)
    elems_1, bytes_1 = _cache_elements(model, n)
    elems_2, bytes_2 = _cache_elements(model, 2 * n)
    per_token_elems = (elems_2 - elems_1) / n
    return {
        "params_total": counts["total"],
        "params_active_per_token": int(round(counts["active"])),
        "params_mtp": counts["mtp"],
        **param_bytes_by_format(config, path),
        "kv_elements_per_token": per_token_elems,
        "kv_bytes_per_token": (bytes_2 - bytes_1) / n,
        "kv_bytes_per_token_bf16": 2 * per_token_elems,
        "kv_fixed_bytes_per_sequence": bytes_1 - (bytes_2 - bytes_1),
    }


# Storage formats of the V4.1 reference caches (bytes per element, scales included): FP4 latents with an
# e4m3 scale per 16, FP4 index keys with a UE8M0 scale per 32, FP8 window KV with a UE8M0 scale per 32.
V41_LATENT_BYTES = 0.5 + 1 / 16
V41_INDEX_KEY_BYTES = 0.5 + 1 / 32
V41_WINDOW_BYTES = 1 + 1 / 32


def v41_stats(config) -> dict:
    """V4.1 figures: backbone and Engram parameters, shared global KV bytes per token (as the reference
    stores it), and the per-layer sliding-window cost, all read off real shapes."""
    model = abstract_model(config, "bfloat16")
    counts = param_counts(model, config)
    backbone, active = counts["total"], counts["active"]
    engram = sum(config.engram_num_embeddings) * config.engram_head_dim
    n = math.lcm(*(r for r in config.compress_ratios if r)) * 1024

    def global_bytes(length: int) -> float:
        layers = jax.eval_shape(lambda: model.module().init_cache(1, length)["layers"])
        per_entry = {"entries": V41_LATENT_BYTES, "index_keys": V41_INDEX_KEY_BYTES}
        return sum(state[name].pages.shape[1] * state[name].pages.shape[2] * size
                   for state in layers for name, size in per_entry.items() if name in state)

    ring = jax.eval_shape(lambda: model.module().init_cache(1, 8)["layers"][0]["ring_kv"])
    swa_layer = ring.shape[1] * ring.shape[2] * V41_WINDOW_BYTES
    return {
        "params_backbone": backbone,
        "params_engram": engram,
        "params_total": backbone + engram,
        "params_active_per_token": int(round(active)),
        "kv_bytes_per_token_global": (global_bytes(2 * n) - global_bytes(n)) / n,
        "swa_bytes_per_layer_per_sequence": swa_layer,
        "swa_bytes_per_sequence": swa_layer * config.num_hidden_layers,
        "n_prefill_layer": config.n_prefill_layer,
    }
