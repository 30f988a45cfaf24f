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

import math

import numpy as np
from flax import nnx

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
    if path[0] == "embed" or not np.issubdtype(dtype, np.floating):
        return "lookup"
    if len(path) >= 2 and path[-2] == "experts":
        return "experts"
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


def compressed_reads(config: ModelConfig | V41Config, layer: int, context: int) -> tuple[int, int]:
    """(compressed entries attended, index keys scored) by a query of main layer `layer` at position `context`."""
    ratio = config.compress_ratios[layer]
    if ratio == 0:
        return 0, 0
    visible = (context + 1) // ratio
    if isinstance(config, ModelConfig):
        return (min(config.index_topk, visible), visible) if config.layer_kind(layer) == CSA else (visible, 0)
    picked = min(config.index_topk, visible) if min(config.index_source_layer_ids) <= layer else 0
    if layer not in config.index_source_layer_ids:
        return picked, 0
    if 0 <= config.candidate_source_layer_id < layer:  # a re-index layer scores inside the candidate pool
        return picked, min(visible, config.candidate_topk_blocks * config.candidate_block_size)
    return picked, visible


def attention_cost(config: ModelConfig | V41Config, rows: int, context: int) -> dict[str, float]:
    """FLOPs and bytes of the main layers' attention for `rows` rows whose queries sit at position `context`."""
    flops = state_bytes = 0.0
    h, hd, fp32 = config.num_attention_heads, config.head_dim, 4
    for layer in range(config.num_hidden_layers):
        entries, scored = compressed_reads(config, layer, context)
        keys = min(context + 1, config.sliding_window) + entries
        flops += 2 * config.index_n_heads * config.index_head_dim * scored
        state_bytes += scored * config.index_head_dim * fp32
        flops += 4 * h * hd * keys  # scores and the weighted sum, K = V
        state_bytes += keys * hd * fp32
    return {"flops": rows * flops, "bytes": rows * state_bytes}


def decode_step_cost(config: ModelConfig | V41Config, rows: int, context: int, dtype: str = "float32"
                     ) -> dict[str, float]:
    """{"flops", "bytes"} a decode step of `rows` rows at position `context` needs (weights plus attention)."""
    w, a = weight_cost(config, rows, dtype), attention_cost(config, rows, context)
    return {"flops": w["flops"] + a["flops"], "bytes": w["bytes"] + a["bytes"]}


def roofline_seconds(cost: dict[str, float], flops_per_s: float, bytes_per_s: float) -> float:
    """The least time `cost` takes on a machine of that compute peak and read bandwidth."""
    return max(cost["flops"] / flops_per_s, cost["bytes"] / bytes_per_s)
