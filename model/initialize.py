"""Randomly initialised models of a config, in any resident weight format (tests, benchmarks, studies)."""

import numpy as np
from flax import nnx

from model.api import Model, build_module, engram_table, resolve_dtype
from model.checkpoint import to_stored
from model.engram import EngramMemory


def init_model(config, seed: int = 0, weights: str = "float32", engram_placement: str = "device",
               token_map=None) -> Model:
    """A randomly initialised model of this config (std 0.02 matrices, unit norms, zero sinks and biases),
    its weights `float32`, `bfloat16` or, drawn in fp32, in DeepSeek's stored form (`checkpoint`: FP8 linears
    with 128x128 blocks and packed FP4 experts, `model.checkpoint.to_stored`; V4 configs).

    V4.1 Engram tables get random float32 rows, placed in host memory or on the device; `token_map` gives
    the tokenizer's canonical ids (`model.engram.canonical_vocab`), by default each token is its own.
    """
    if weights == "checkpoint":
        return to_stored(init_model(config, seed))
    module = build_module(config, nnx.Rngs(seed), resolve_dtype(weights))
    engram = None
    if getattr(config, "engram_layer_ids", ()):
        memory_rows = np.random.default_rng(seed).normal(
            0, 0.02, (sum(config.engram_num_embeddings), config.engram_head_dim)).astype(np.float32)
        bounds = np.cumsum((0,) + config.engram_num_embeddings)
        tables = [engram_table(memory_rows[a:b], None, engram_placement) for a, b in zip(bounds[:-1], bounds[1:])]
        token_map = EngramMemory.identity_map(config) if token_map is None else token_map
        engram = EngramMemory(config, token_map, tables)
    return Model(module, engram=engram)
