"""The work one decode step needs, counted from shapes: FLOPs and bytes of `rows` rows at a live context.

What a step must do, not what a given implementation does: every main-stack matmul once per row (routed experts
only for each row's k chosen ones), each weight read once per step (a routed expert only if some row chose it:
with uniform routing, E * (1 - (1 - k/E)^rows) experts are hit), the embedding rows looked up, and per
attention layer the keys a query reads: the sliding window, then the CSA top-k picks (scored by the indexer
over every visible index key) or every visible HCA entry. fp32 state entries. The MTP blocks do not run in a
plain decode step.
"""

import math

import numpy as np
from flax import nnx

from model.api import abstract_model
from model.config import CSA, HCA, ModelConfig


def expected_experts_hit(config: ModelConfig, rows: int) -> float:
    """Experts some row chooses, in expectation under uniform routing of `rows` rows."""
    e, k = config.n_routed_experts, config.num_experts_per_tok
    return e * (1 - (1 - k / e) ** rows)


def weight_cost(config: ModelConfig, rows: int, dtype: str = "float32") -> dict[str, float]:
    """FLOPs and bytes of the step's weights for `rows` rows (attention over the cache excluded)."""
    flops = weight_bytes = 0.0
    e, k = config.n_routed_experts, config.num_experts_per_tok
    hit = expected_experts_hit(config, rows)
    for path, var in nnx.to_flat_state(abstract_model(config, dtype).params):
        size, itemsize = math.prod(var.shape), np.dtype(var.dtype).itemsize
        if path[0] == "mtp":
            continue
        if path[0] == "embed" or not np.issubdtype(var.dtype, np.floating):  # looked up: the rows read
            weight_bytes += rows * (size // var.shape[0]) * itemsize
        elif len(path) >= 2 and path[-2] == "experts":
            flops += 2 * rows * k * size / e
            weight_bytes += hit * size / e * itemsize
        else:
            flops += 2 * rows * size if len(var.shape) >= 2 else 0
            weight_bytes += size * itemsize
    return {"flops": flops, "bytes": weight_bytes}


def attention_cost(config: ModelConfig, rows: int, context: int) -> dict[str, float]:
    """FLOPs and bytes of the main layers' attention for `rows` rows whose queries sit at position `context`."""
    flops = state_bytes = 0.0
    h, hd, fp32 = config.num_attention_heads, config.head_dim, 4
    for layer in range(config.num_hidden_layers):
        keys = min(context + 1, config.sliding_window)
        kind, ratio = config.layer_kind(layer), config.compress_ratios[layer]
        if kind == CSA:
            visible = (context + 1) // ratio
            keys += min(config.index_topk, visible)
            flops += 2 * config.index_n_heads * config.index_head_dim * visible
            state_bytes += visible * config.index_head_dim * fp32
        elif kind == HCA:
            keys += (context + 1) // ratio
        flops += 4 * h * hd * keys  # scores and the weighted sum, K = V
        state_bytes += keys * hd * fp32
    return {"flops": rows * flops, "bytes": rows * state_bytes}


def decode_step_cost(config: ModelConfig, rows: int, context: int, dtype: str = "float32") -> dict[str, float]:
    """{"flops", "bytes"} a decode step of `rows` rows at position `context` needs (weights plus attention)."""
    w, a = weight_cost(config, rows, dtype), attention_cost(config, rows, context)
    return {"flops": w["flops"] + a["flops"], "bytes": w["bytes"] + a["bytes"]}


def roofline_seconds(cost: dict[str, float], flops_per_s: float, bytes_per_s: float) -> float:
    """The least time `cost` takes on a machine of that compute peak and read bandwidth."""
    return max(cost["flops"] / flops_per_s, cost["bytes"] / bytes_per_s)
