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
        return jnp.dtype(DTYPES[dtype])
    return jnp.dtype(dtype)


class Model:
    """A DeepSeek-V4 model ready to run: `logits(tokens)` for whole sequences, `step` for the cached path.

    The graph definition is closed over by the jitted functions and parameters travel as a pure pytree
    (`self.params`), so a call costs tens of microseconds of host time.
    """

    def __init__(self, module: nnx.Module, tokenizer=None, engram=None, drafter=None):
        self.graphdef, self.params = nnx.split(module)
        self.config: ModelConfig = module.config
        self.tokenizer = tokenizer
        self.engram = engram  # model.engram.EngramMemory for V4.1 models with Engram layers
        self.drafter = drafter  # model.dspark.Drafter when the checkpoint ships a DSpark drafter

    def module(self) -> nnx.Module:
        """A stateful view of the model, a DeepseekV4 or DeepseekV41 (for research code that wants to call layers
        directly)."""
        return nnx.merge(self.graphdef, self.params)

    @functools.cached_property
    def _forward(self):
        graphdef = self.graphdef

        def forward(params, tokens, cache, *engram_rows, replay=None, prompt_end=None):
            extra = {} if replay is None else {"replay": replay, "prompt_end": prompt_end}  # V4.1 only
            return nnx.merge(graphdef, params)(tokens, cache, *engram_rows, **extra)

        return jax.jit(forward, donate_argnums=2, static_argnames="replay")

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

    def logits(self, tokens: Int[Array | np.ndarray, "b s"], replay=None, prompt_end=None) -> Float[Array, "b s v"]:
        """fp32 next-token logits for every position of each sequence (one full-sequence forward).

        V4.1 takes `replay=model.replay.Replay(...)` and `prompt_end` (see `model.replay`)."""
        tokens = self._check_tokens(tokens)
        return self._run(tokens, self.init_cache(tokens.shape[0], tokens.shape[1]), replay, prompt_end)[0]

    def _run(self, tokens: jax.Array, cache: dict, replay=None, prompt_end=None):
        """One jitted forward; Engram rows are looked up first (on the host or device, by table placement)."""
        if replay is not None and not hasattr(self.config, "n_prefill_layer"):
            raise ValueError("bounded replay needs a causal encoder-decoder (V4.1) model")
        replay = {"replay": replay, "prompt_end": prompt_end}
        if self.engram is None:
            return self._forward(self.params, tokens, cache, **replay)
        rows, history = self.engram.lookup(np.asarray(tokens), np.asarray(cache["engram_history"]))
        logits, cache = self._forward(self.params, tokens, cache, rows, **replay)
        return logits, {**cache, "engram_history": jnp.asarray(history, jnp.int32)}

    def init_cache(self, batch: int, max_len: int) -> dict:
        """An empty reference cache (window rings, compressor states, compressed entries) for `max_len` tokens."""
        cache = self.module().init_cache(batch, max_len)
        cache["capacity"] = jnp.asarray(max_len, jnp.int32)
        if self.engram is not None:
            cache["engram_history"] = jnp.asarray(self.engram.empty_history(batch), jnp.int32)
        return cache

    def step(self, tokens: Int[Array | np.ndarray, "b c"], cache: dict, replay=None, prompt_end=None
             ) -> tuple[Float[Array, "b c v"], dict]:
        """Run the next chunk (prefill chunk or one decode token) of every sequence; the cache is donated.
        V4.1 takes `replay` and `prompt_end` as `logits` does."""
        tokens = self._check_tokens(tokens)
        end = int(cache["pos"]) + tokens.shape[1]
        if end > int(cache["capacity"]):
            raise ValueError(f"cache holds {int(cache['capacity'])} tokens; this chunk would reach {end}")
        rows = jax.tree.leaves(cache["layers"])[0].shape[0]  # every layer leaf is batch-first
        if tokens.shape[0] != rows:
            raise ValueError(f"batch {tokens.shape[0]} does not match the cache's batch {rows}")
        return self._run(tokens, cache, replay, prompt_end)


def build_module(config, rngs: nnx.Rngs, dtype):
    """The model module of a config: DeepseekV4 for a ModelConfig, DeepseekV41 for a V41Config."""
    from model.config_v41 import V41Config
    from model.v41 import DeepseekV41

    return (DeepseekV41 if isinstance(config, V41Config) else DeepseekV4)(config, rngs, dtype)


def engram_table(weight, scale, placement: str):
    """An Engram table in host memory (`host`) or on the device (`device`)."""
    from model.engram import DeviceEngramTable, HostEngramTable

    if placement not in ("host", "device"):
        raise ValueError(f"engram placement must be 'host' or 'device', got {placement!r}")
    return (HostEngramTable if placement == "host" else DeviceEngramTable)(weight, scale)


def abstract_model(config, dtype: str = "float32") -> Model:
    """The model's graph with `ShapeDtypeStruct` parameters: shapes and sizes without allocating."""
    return Model(nnx.eval_shape(lambda: build_module(config, nnx.Rngs(0), resolve_dtype(dtype))))
