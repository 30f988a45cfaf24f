"""The work one decode step needs, counted from shapes: FLOPs and bytes of `rows` rows at a live context.

What a step must do, not what a given implementation does: every main-stack matmul once per row (routed experts
only for each row's k chosen ones), each weight read once per step (a routed expert only if some row chose it:
with uniform routing, E * (1 - (1 - k/E)^rows) experts are hit), the embedding rows looked up, and per
attention layer the keys a query reads: the sliding window, then the CSA top-k picks (scored by the indexer
over every visible index key) or every visible HCA entry. fp32 state entries. The MTP blocks do not run in a
plain decode step.

V4.1 (`V41Config`): every layer with a compression ratio attends the top-k picks of the shared entries of its
KV source; only index sources score index keys (every visible one, or only the candidate pool's positions in a
re-index layer after the candidate source), the other layers reuse the picks published before them. Engram
layers read their hashed rows (fp32 as the step receives them).
"""

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Float, Int

from model.api import abstract_model
from model.config import CSA, ModelConfig
from model.config_v41 import V41Config


def expected_experts_hit(config: ModelConfig | V41Config, rows: int) -> float:
    """Experts some row chooses, in expectation under uniform routing of `rows` rows."""
    e, k = config.n_routed_experts, config.num_experts_per_tok
    return e * (1 - (1 - k / e) ** rows)


def weight_role(path: tuple, shape: tuple[int, ...], dtype) -> str | None:
    """How a plain decode step uses the parameter at `path`: "lookup" (the embedding or an integer table: the
    rows it looks up), "experts" (a routed-expert stack: each row through its k chosen experts), "matrix"
    (every row multiplied through it), "vector" (read, no product); None for the MTP blocks, which it does not
    run."""
    if path[0] == "mtp":
        return None
    if path[0] == "embed":
        return "lookup"
    if len(path) >= 2 and path[-2] == "experts":  # packed FP4 codes and their scales too
        return "experts"
    if not jnp.issubdtype(dtype, jnp.floating):
        return "lookup"
    return "matrix" if len(shape) >= 2 else "vector"


def weight_cost(config: ModelConfig | V41Config, rows: int, dtype: str = "float32") -> dict[str, float]:
    """FLOPs and bytes of the step's weights for `rows` rows (attention over the cache excluded)."""
    flops = weight_bytes = 0.0
    e, k = config.n_routed_experts, config.num_experts_per_tok
    hit = expected_experts_hit(config, rows)
    for path, var in nnx.to_flat_state(abstract_model(config, dtype).params):
        size, itemsize = math.prod(var.shape), np.dtype(var.dtype).itemsize
        role = weight_role(tuple(path), var.shape, var.dtype)
        if role == "lookup":  # the rows read
            weight_bytes += rows * (size // var.shape[0]) * itemsize
        elif role == "experts":
            flops += 2 * rows * k * size / e
            weight_bytes += hit * size / e * itemsize
        elif role is not None:
            flops += 2 * rows * size if role == "matrix" else 0
            weight_bytes += size * itemsize
    if isinstance(config, V41Config):
        row = config.engram_lookups * config.engram_head_dim
        weight_bytes += rows * len(config.engram_layer_ids) * row * 4
    return {"flops": flops, "bytes": weight_bytes}


def compressed_reads(config: ModelConfig | V41Config, layer: int, context):
    """(compressed entries attended, index keys scored) by a query of main layer `layer` at position `context`
    (an int, or an array of positions for one figure each)."""
    ratio = config.compress_ratios[layer]
    if ratio == 0:
        return 0 * context, 0 * context
    visible = (context + 1) // ratio
    if isinstance(config, ModelConfig):
        if config.layer_kind(layer) == CSA:
            return np.minimum(config.index_topk, visible), visible
        return visible, 0 * context
    picked = np.minimum(config.index_topk, visible) if min(config.index_source_layer_ids) <= layer else 0 * context
    if layer not in config.index_source_layer_ids:
        return picked, 0 * context
    if 0 <= config.candidate_source_layer_id < layer:  # a re-index layer scores inside the candidate pool
        return picked, np.minimum(visible, config.candidate_topk_blocks * config.candidate_block_size)
    return picked, visible


@dataclasses.dataclass(frozen=True)
class RowBytes:
    """Bytes of one stored cache row of each kind a query reads: a window key, a compressed entry, an index key."""

    window: float
    latent: float
    index_key: float

    @classmethod
    def fp32(cls, config: ModelConfig | V41Config) -> "RowBytes":
        """The reference model's float32 rows."""
        return cls(4 * config.head_dim, 4 * config.head_dim, 4 * config.index_head_dim)


def attention_parts(config: ModelConfig | V41Config, positions: Int[np.ndarray, " n"], layers: range,
                    rows: RowBytes | None = None) -> dict[str, dict[str, float]]:
    """FLOPs and bytes read of `layers`' attention ("attention": window and compressed keys, K = V) and index
    scoring ("indexer") for one query at each of `positions`, summed."""
    rows = rows or RowBytes.fp32(config)
    h, hd = config.num_attention_heads, config.head_dim
    positions = np.asarray(positions, np.int64)
    parts = {"attention": {"flops": 0.0, "bytes": 0.0}, "indexer": {"flops": 0.0, "bytes": 0.0}}
    for layer in layers:
        entries, scored = compressed_reads(config, layer, positions)
        window = np.minimum(positions + 1, config.sliding_window)
        keys = float(np.sum(window + entries))
        scored = float(np.sum(scored))
        parts["attention"]["flops"] += 4 * h * hd * keys  # scores and the weighted sum
        parts["attention"]["bytes"] += float(np.sum(window)) * rows.window + float(np.sum(entries)) * rows.latent
        parts["indexer"]["flops"] += 2 * config.index_n_heads * config.index_head_dim * scored
        parts["indexer"]["bytes"] += scored * rows.index_key
    return parts


def attention_cost(config: ModelConfig | V41Config, rows: int, context: int) -> dict[str, float]:
    """FLOPs and bytes of the main layers' attention for `rows` rows whose queries sit at position `context`."""
    parts = attention_parts(config, np.array([context]), range(config.num_hidden_layers))
    return {key: rows * (parts["attention"][key] + parts["indexer"][key]) for key in ("flops", "bytes")}


@dataclasses.dataclass(frozen=True)
class WeightTable:
    """What each row costs in a step's weights, per main layer and around the layers, with the weights held in
    a storage format: dense FLOPs per row at the FP8 rate (FP8-held matrices) and at the bf16 rate (the rest),
    dense bytes read once per step, routed-expert FLOPs per row (its k experts) and bytes per expert, bytes
    looked up per token (embedding, hash-routing and Engram rows)."""

    dense_flops_fp8: Float[np.ndarray, " layers"]
    dense_flops_bf16: Float[np.ndarray, " layers"]
    dense_bytes: Float[np.ndarray, " layers"]
    dense_matrices: Int[np.ndarray, " layers"]
    expert_flops: Float[np.ndarray, " layers"]
    expert_bytes: Float[np.ndarray, " layers"]
    head_flops_fp8: float
    head_flops_bf16: float
    head_bytes: float
    head_matrices: int
    lookup_bytes_per_token: float


@functools.lru_cache(maxsize=8)
def weight_table(config: ModelConfig | V41Config, weights: str = "checkpoint") -> WeightTable:
    """The per-row weight costs of `config` with its weights held as `weights` (`model.checkpoint.WEIGHTS`):
    FLOPs from the model's matrices, bytes and the rate each runs at from the held format."""
    from model.checkpoint import layout_for
    from model.engram import SCALE_BLOCK

    n, e, k = config.num_hidden_layers, config.n_routed_experts, config.num_experts_per_tok
    table = {name: np.zeros(n) for name in ("dense_flops_fp8", "dense_flops_bf16", "dense_bytes", "dense_matrices",
                                            "expert_flops", "expert_bytes")}
    head = {"flops_fp8": 0.0, "flops_bf16": 0.0, "bytes": 0.0, "matrices": 0}
    held = {tuple(p): v for p, v in nnx.to_flat_state(layout_for(config, weights).model(config).params)}
    lookup = 0.0
    for path, var in nnx.to_flat_state(abstract_model(config, "float32").params):
        path = tuple(path)
        role = weight_role(path, var.shape, var.dtype)
        size = math.prod(var.shape)
        fp8 = path in held and jnp.issubdtype(held[path].dtype, jnp.float8_e4m3fn)
        layer = path[1] if path[0] == "layers" else None
        if role == "lookup":
            lookup += size // var.shape[0] * np.dtype(held.get(path, var).dtype).itemsize
        elif role == "experts" and path[-1] in ("w1", "w2", "w3"):
            table["expert_flops"][layer] += 2 * k * size / e
        elif role == "matrix":
            target, key = (table, "dense_flops_fp8" if fp8 else "dense_flops_bf16") if layer is not None else \
                (head, "flops_fp8" if fp8 else "flops_bf16")
            if layer is None:
                head[key] += 2 * size
                head["matrices"] += 1
            else:
                table[key][layer] += 2 * size
                table["dense_matrices"][layer] += 1
    for path, var in held.items():
        role = weight_role(path, var.shape, var.dtype)
        if role in (None, "lookup"):
            continue
        nbytes = math.prod(var.shape) * np.dtype(var.dtype).itemsize
        layer = path[1] if path[0] == "layers" else None
        if role == "experts":
            table["expert_bytes"][layer] += nbytes / var.shape[0]
        elif layer is None:
            head["bytes"] += nbytes
        else:
            table["dense_bytes"][layer] += nbytes
    if isinstance(config, V41Config):  # hashed Engram rows: FP8 with a UE8M0 scale per block when stored
        per_channel = {"float32": 4.0, "bfloat16": 2.0}.get(weights, 1 + 1 / SCALE_BLOCK)
        lookup += len(config.engram_layer_ids) * config.engram_lookups * config.engram_head_dim * per_channel
    table["dense_matrices"] = table["dense_matrices"].astype(np.int64)
    return WeightTable(**table, head_flops_fp8=head["flops_fp8"], head_flops_bf16=head["flops_bf16"],
                       head_bytes=head["bytes"], head_matrices=head["matrices"], lookup_bytes_per_token=lookup)


def decode_step_cost(config: ModelConfig | V41Config, rows: int, context: int, dtype: str = "float32"
                     ) -> dict[str, float]:
    """{"flops", "bytes"} a decode step of `rows` rows at position `context` needs (weights plus attention)."""
    w, a = weight_cost(config, rows, dtype), attention_cost(config, rows, context)
    return {"flops": w["flops"] + a["flops"], "bytes": w["bytes"] + a["bytes"]}


def roofline_seconds(cost: dict[str, float], flops_per_s: float, bytes_per_s: float) -> float:
    """The least time `cost` takes on a machine of that compute peak and read bandwidth."""
    return max(cost["flops"] / flops_per_s, cost["bytes"] / bytes_per_s)
