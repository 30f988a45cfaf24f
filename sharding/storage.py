"""Bytes of parameters and cache entries in their serving storage formats, read off real (abstract) shapes.

A KV format (`KV_FORMATS`: `v4`, `v41`, `v32`, `bf16`, `reference`) says how each kind of cache row is stored
(`RowStorage`); the byte figures follow from the model's own `init_cache` shapes, evaluated abstractly.
`MLAConfig` is the V3.2 MLA + DSA accounting preset, for comparing V4 against its predecessor.
See docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from model.paged import is_paged

# cache leaf name -> row kind; `entries` under an `indexer` state are CSA index keys (V4)
ROW_KINDS = {"entries": "latent", "index_keys": "index_key", "latent": "latent", "ring_kv": "window",
             "recent_kv": "open_window", "recent_gate": "open_window", "ring_pos": "positions"}
GROWING = ("latent", "index_key")  # row kinds with one row per r tokens (the rest are fixed per sequence)


@dataclasses.dataclass(frozen=True)
class RowStorage:
    """How one row of `dim` elements is stored: `value_bytes` per element (the RoPE dims in `rope_bytes`
    each when given), plus `scale_bytes` per `scale_block` non-RoPE elements."""

    value_bytes: float
    scale_block: int = 0
    scale_bytes: float = 0.0
    rope_bytes: float | None = None

    def row_bytes(self, dim: int, rope_dims: int) -> float:
        split = rope_dims if self.rope_bytes is not None else 0
        scales = math.ceil((dim - split) / self.scale_block) * self.scale_bytes if self.scale_block else 0.0
        return (dim - split) * self.value_bytes + split * (self.rope_bytes or 0.0) + scales


FP4_E8M0_32 = RowStorage(0.5, 32, 1)
KV_FORMATS: dict[str, dict[str, RowStorage] | None] = {
    "v4": {"latent": RowStorage(1, rope_bytes=2), "index_key": FP4_E8M0_32,
           "window": RowStorage(1, rope_bytes=2), "open_window": RowStorage(4), "positions": RowStorage(4)},
    "v41": {"latent": RowStorage(0.5, 16, 1), "index_key": FP4_E8M0_32, "window": RowStorage(1, 32, 1),
            "open_window": RowStorage(4), "positions": RowStorage(4)},
    "v32": {"latent": RowStorage(1, 128, 4, rope_bytes=2), "index_key": RowStorage(1, 128, 4)},
    "bf16": {kind: RowStorage(2) for kind in ("latent", "index_key", "window", "open_window")}
    | {"positions": RowStorage(4)},
    "reference": None,  # the arrays' own dtypes
}


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """A DeepSeek-V3.2-style cache (MLA latent + DSA index key per token and layer), for KV comparisons."""

    name: str
    num_hidden_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int

    def init_cache(self, batch: int, max_len: int) -> dict:
        """The cache rows of `batch` sequences of `max_len` tokens: per layer a latent and an index key."""
        width = self.kv_lora_rank + self.qk_rope_head_dim
        return {"layers": [{"latent": jnp.zeros((batch, max_len, width), jnp.float32),
                            "index_keys": jnp.zeros((batch, max_len, self.index_head_dim), jnp.float32)}
                           for _ in range(self.num_hidden_layers)]}


def v32() -> MLAConfig:
    """DeepSeek-V3.2-Exp: 61 layers, 512-d latent + 64 RoPE dims, 128-d indexer keys."""
    return MLAConfig("v3.2", num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)


def default_kv_format(config) -> str:
    """The storage format a config's deployment uses: v41 for V4.1, v32 for the MLA preset, else v4."""
    from model.config_v41 import V41Config

    return "v41" if isinstance(config, V41Config) else "v32" if isinstance(config, MLAConfig) else "v4"


def _row_kind(path) -> str:
    keys = [getattr(k, "key", None) for k in path]
    name = keys[-1]
    if name not in ROW_KINDS:
        raise KeyError(f"cache leaf {'/'.join(map(str, keys))} has no storage rule")
    return "index_key" if name == "entries" and "indexer" in keys else ROW_KINDS[name]


def cache_bytes(layers, config, kv_format: str) -> dict[str, float]:
    """Bytes per row kind of a cache's `layers` (arrays or ShapeDtypeStructs) stored in `kv_format`."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown KV format {kv_format!r}; choose one of {sorted(KV_FORMATS)}")
    storage = KV_FORMATS[kv_format]
    out: dict[str, float] = {}
    for path, leaf in jax.tree.leaves_with_path(layers, is_leaf=is_paged):
        kind, leaf = _row_kind(path), leaf.pages if is_paged(leaf) else leaf
        rows = math.prod(leaf.shape[:-1]) if len(leaf.shape) > 2 else leaf.shape[0]
        dim = leaf.shape[-1] if len(leaf.shape) > 2 else (leaf.shape[1] if len(leaf.shape) == 2 else 1)
        if storage is None:
            size = rows * dim * np.dtype(leaf.dtype).itemsize
        else:
            if kind not in storage:
                raise ValueError(f"KV format {kv_format!r} has no storage for {kind} rows")
            rope = config.qk_rope_head_dim if kind in ("latent", "window") else 0
            size = rows * storage[kind].row_bytes(dim, rope)
        out[kind] = out.get(kind, 0.0) + size
    return out


def kv_figures(config, kv_format: str | None = None, module=None) -> dict[str, float | str]:
    """KV bytes of one sequence, from the cache structure: per token of context (global: the growing
    compressed / shared entries and index keys), per window token (SWA rings of every layer) and fixed per
    sequence (rings, open compressor windows, positions)."""
    kv_format = kv_format or default_kv_format(config)
    if module is None:
        if isinstance(config, MLAConfig):
            module = config
        else:
            from model.api import abstract_model

            module = abstract_model(config).module()
    ratios = [r for r in getattr(config, "compress_ratios", ()) if r]
    window = getattr(config, "sliding_window", 1)
    n = math.lcm(*(ratios or [1]), window) * 64

    def at(length: int) -> dict[str, float]:
        return cache_bytes(jax.eval_shape(lambda: module.init_cache(1, length)["layers"]), config, kv_format)

    small, large = at(n), at(2 * n)
    growing = sum((large.get(k, 0.0) - small.get(k, 0.0)) / n for k in GROWING)
    fixed = sum(small.values()) - growing * n
    ring = jax.eval_shape(lambda: module.init_cache(1, 8)["layers"])
    window_bytes = cache_bytes([s for s in ring if "ring_kv" in s], config, kv_format).get("window", 0.0)
    slots = max((s["ring_kv"].shape[1] for s in ring if "ring_kv" in s), default=0)
    return {"kv_format": kv_format,
            "kv_bytes_per_token_global": growing,
            "kv_bytes_per_token_swa": window_bytes / slots if slots else 0.0,
            "kv_fixed_bytes_per_sequence": fixed}
