"""The public model object: config + pure parameter pytree + jit-compiled forward functions."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from model.config import ModelConfig
from model.transformer import DeepseekV4

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    """`"float32"` / `"bfloat16"` (or the jnp dtype itself) to a jnp dtype, with a clear error otherwise."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


class Model:
    """A DeepSeek-V4 model ready to run: `logits(tokens)` for whole sequences, `step` for the cached path.

    The graph definition is closed over by the jitted functions and parameters travel as a pure pytree
    (`self.params`), so a call costs tens of microseconds of host time.
    """

    def __init__(self, module: DeepseekV4, tokenizer=None):
        self.graphdef, self.params = nnx.split(module)
        self.config: ModelConfig = module.config
        self.tokenizer = tokenizer

    def module(self) -> DeepseekV4:
        """A stateful view of the model (for research code that wants to call layers directly)."""
        return nnx.merge(self.graphdef, self.params)

    @functools.cached_property
    def _forward(self):
        graphdef = self.graphdef

        def forward(params, tokens, cache):
            return nnx.merge(graphdef, params)(tokens, cache)

        return jax.jit(forward, donate_argnums=2)

    def _check_tokens(self, tokens) -> jax.Array:
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be an int array of shape [batch, seq] with seq >= 1, got {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got range "
                             f"[{tokens.min()}, {tokens.max()}]")
        return jnp.asarray(tokens, jnp.int32)

    def logits(self, tokens: Int[Array, "b s"]) -> Float[Array, "b s v"]:
        """fp32 next-token logits for every position of each sequence (one full-sequence forward)."""
        tokens = self._check_tokens(tokens)
        cache = self.init_cache(tokens.shape[0], tokens.shape[1])
        return self._forward(self.params, tokens, cache)[0]

    def init_cache(self, batch: int, max_len: int) -> dict:
        """An empty reference cache (window rings, compressor states, compressed entries) for `max_len` tokens."""
        cache = self.module().init_cache(batch, max_len)
        cache["capacity"] = jnp.asarray(max_len, jnp.int32)
        return cache

    def step(self, tokens: Int[Array, "b c"], cache: dict) -> tuple[Float[Array, "b c v"], dict]:
        """Run the next chunk (prefill chunk or one decode token) of every sequence; the cache is donated."""
        tokens = self._check_tokens(tokens)
        end = int(cache["pos"]) + tokens.shape[1]
        if end > int(cache["capacity"]):
            raise ValueError(f"cache holds {int(cache['capacity'])} tokens; this chunk would reach {end}")
        if tokens.shape[0] != cache["layers"][0]["ring_kv"].shape[0]:
            raise ValueError(f"batch {tokens.shape[0]} does not match the cache's batch "
                             f"{cache['layers'][0]['ring_kv'].shape[0]}")
        return self._forward(self.params, tokens, cache)


def init_model(config: ModelConfig, seed: int = 0, dtype: str = "float32") -> Model:
    """A randomly initialised model of this config (std 0.02 matrices, unit norms, zero sinks and biases)."""
    return Model(DeepseekV4(config, nnx.Rngs(seed), resolve_dtype(dtype)))


def abstract_model(config: ModelConfig, dtype: str = "float32") -> Model:
    """The model's graph with `ShapeDtypeStruct` parameters: shapes and sizes without allocating."""
    module = nnx.eval_shape(lambda: DeepseekV4(config, nnx.Rngs(0), resolve_dtype(dtype)))
    return Model(module)
