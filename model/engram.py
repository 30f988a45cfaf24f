"""Engram (DeepSeek-V4.1): hashed n-gram memory gated into the hyper-connection residual streams.

Three parts, each usable on its own:
- keys, on the host: `canonical_vocab` maps token ids to canonical ids (tokens that normalise alike share
  one), and `NgramHasher` turns canonical ids into table row indices (one per n-gram order 2..N and hash
  head) for every Engram layer; int64 numpy, bit-exact with the released tables;
- tables: `HostEngramTable` / `DeviceEngramTable` hold one layer's rows (FP8 e4m3 with one UE8M0 scale per
  32 channels, or plain float32) and gather + dequantise them;
- the gate: `Engram` adds one shared value to every stream, weighted by a per-stream sigmoid gate.

In a block the Engram update runs first, on the streams the previous layer left (before this layer's
attention mHC site). Checkpoint names under `layers.{i}.engram.`: `wkv.weight` (+ `wkv.scale` when FP8),
`q_weight`, `k_weight` (the `Engram` parameters) and `embed.weight` / `embed.scale` (the table, see
`table_names`). transformers prefixes them with `model.`.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Float32, Int, Int32, Int64, Shaped
from tokenizers import Regex, Tokenizer, normalizers

from model.axes import param
from model.linear import Linear

SCALE_BLOCK = 32  # channels per UE8M0 scale in a table row
DEAD = -1  # a look-back slot with no usable token (before the sequence, or a blocked token)
_INT64_MAX = np.iinfo(np.int64).max
_PRIME_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic Miller-Rabin below 3.3e24


# ---- canonical ids ---------------------------------------------------------------------------

def canonical_vocab(tokenizer_json: str | Path) -> Int64[np.ndarray, "vocab"]:
    """token id -> canonical id for every id of a `tokenizer.json` (added tokens included).

    Each id is decoded alone (special tokens kept). A text containing U+FFFD (a partial UTF-8 byte token)
    is keyed by its raw token string; any other text by its normalised form (NFKC, NFD, strip accents,
    lowercase, whitespace runs to one space, a lone space kept, strip), or by itself when that is empty.
    Equal keys share an id; ids are assigned in first-seen order over 0..V-1.
    """
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    sentinel = "\ue000"  # private use: lets a token that is exactly one space survive Strip
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    keys: dict[str, int] = {}
    out = np.empty(tokenizer.get_vocab_size(with_added_tokens=True), np.int64)
    for token_id in range(out.shape[0]):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        out[token_id] = keys.setdefault(key, len(keys))
    return out


def canonical_vocab_size(tokenizer_json: str | Path) -> int:
    """Number of distinct canonical ids of a tokenizer (V4.1 checks it equals `engram_compressed_vocab_size`)."""
    return int(canonical_vocab(tokenizer_json).max()) + 1


# ---- hashing ---------------------------------------------------------------------------------

def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _PRIME_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _PRIME_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


class NgramHasher:
    """Canonical ids -> Engram table row indices, for every Engram layer (host side, int64 numpy).

    For position t the look-back window is c_t, c_{t-1}, ..., c_{t-N+1}; a slot before the sequence start,
    or at or beyond a blocked token (image token, padding), holds `pad_id` (blocking stops the look-back).
    Per layer, products_s = window_s * multiplier_s (int64, wrapping), rolling = products_0, and for
    s = 1..N-1: rolling ^= products_s; the (s+1)-gram row of head j is rolling mod prime[s-1, j] plus the
    offset of that (order, head) sub-table in the layer's table.

    Args: `layer_ids` the Engram layers (multiplier seeds), `engram_vocab_size` where the prime scan
    starts, `num_embeddings` each layer's table rows (must equal the sum of its primes),
    `max_ngram_size` N, `n_heads` hash heads per order, `compressed_vocab_size` the canonical vocab size,
    `pad_id` the canonical id of the pad token (`canonical_vocab(...)[engram_pad_id]`).
    """

    def __init__(self, layer_ids: Sequence[int], engram_vocab_size: int, num_embeddings: Sequence[int],
                 max_ngram_size: int, n_heads: int, compressed_vocab_size: int, pad_id: int):
        if len(num_embeddings) != len(layer_ids):
            raise ValueError(f"num_embeddings has {len(num_embeddings)} entries for {len(layer_ids)} layers")
        if max_ngram_size < 2 or n_heads < 1 or compressed_vocab_size < 1:
            raise ValueError(f"need max_ngram_size >= 2, n_heads >= 1, compressed_vocab_size >= 1; got "
                             f"{max_ngram_size}, {n_heads}, {compressed_vocab_size}")
        if not 0 <= pad_id < compressed_vocab_size:
            raise ValueError(f"pad_id {pad_id} is not a canonical id (< {compressed_vocab_size})")
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.max_ngram_size, self.n_heads = max_ngram_size, n_heads
        self.compressed_vocab_size, self.pad_id = compressed_vocab_size, pad_id
        self.primes = self._scan_primes(engram_vocab_size)  # [layers, N-1, heads]
        sizes = self.primes.reshape(len(self.layer_ids), -1)
        for layer, rows, expected in zip(self.layer_ids, sizes.sum(axis=1), num_embeddings):
            if rows != expected:
                raise ValueError(f"Engram layer {layer}: the hash primes give {rows} table rows but "
                                 f"engram_num_embeddings says {expected}; the config does not match the tables")
            if rows > np.iinfo(np.int32).max:
                raise ValueError(f"Engram layer {layer}: {rows} rows do not fit int32 row indices")
        self.offsets = np.cumsum(sizes, axis=1) - sizes  # exclusive prefix sums, [layers, (N-1) * heads]
        bound = max(1, (_INT64_MAX // compressed_vocab_size) // 2)
        self.multipliers = np.stack([
            np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram_size, dtype=np.int64) * 2 + 1
            for layer in self.layer_ids]) if self.layer_ids else np.zeros((0, max_ngram_size), np.int64)

    @property
    def n_lookups(self) -> int:
        """Rows gathered per token and layer: (N - 1) orders x heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    def _scan_primes(self, start: int) -> Int64[np.ndarray, "layers orders heads"]:
        """Per (layer, order): the next primes above `start - 1`, skipping every prime taken before."""
        used: set[int] = set()
        out = np.zeros((len(self.layer_ids), self.max_ngram_size - 1, self.n_heads), np.int64)
        for layer in range(len(self.layer_ids)):
            for order in range(self.max_ngram_size - 1):
                candidate = start - 1
                for head in range(self.n_heads):
                    candidate += 1
                    while candidate in used or not _is_prime(candidate):
                        candidate += 1
                    used.add(candidate)
                    out[layer, order, head] = candidate
        return out

    def _sequence(self, canonical: Int[np.ndarray, "b s"], history: Int[np.ndarray, "b h"] | None,
                  blocked: Bool[np.ndarray, "b s"] | None) -> Int64[np.ndarray, "b n"]:
        """History followed by the chunk (n = h + s tokens), with blocked tokens as DEAD (validated)."""
        canonical = np.asarray(canonical, np.int64)
        if canonical.ndim != 2:
            raise ValueError(f"canonical ids must be [batch, seq], got shape {canonical.shape}")
        if canonical.size and (canonical.min() < 0 or canonical.max() >= self.compressed_vocab_size):
            raise ValueError(f"canonical ids must lie in [0, {self.compressed_vocab_size}), got range "
                             f"[{canonical.min()}, {canonical.max()}]")
        width = self.max_ngram_size - 1
        if history is None:
            history = np.full((canonical.shape[0], width), DEAD, np.int64)
        history = np.asarray(history, np.int64)
        if history.shape != (canonical.shape[0], width):
            raise ValueError(f"history must be [batch, {width}] = {(canonical.shape[0], width)}, "
                             f"got {history.shape}")
        if history.size and (history.min() < DEAD or history.max() >= self.compressed_vocab_size):
            raise ValueError(f"history entries must be canonical ids or {DEAD}, got range "
                             f"[{history.min()}, {history.max()}]")
        if blocked is not None:
            blocked = np.asarray(blocked, bool)
            if blocked.shape != canonical.shape:
                raise ValueError(f"blocked mask {blocked.shape} does not match canonical ids {canonical.shape}")
            canonical = np.where(blocked, DEAD, canonical)
        return np.concatenate([history, canonical], axis=1)

    def windows(
        self, canonical: Int[np.ndarray, "b s"], history: Int[np.ndarray, "b n1"] | None = None,
        blocked: Bool[np.ndarray, "b s"] | None = None,
    ) -> Int64[np.ndarray, "b s n"]:
        """The look-back window of every position: [..., k] = the token k places back, or `pad_id`.

        `history` holds the N-1 canonical ids before the chunk, oldest first (from `next_history`); an
        entry DEAD (-1) stops the look-back there. None means the chunk starts the sequence; a history of
        all `pad_id` gives the same windows. `blocked` marks tokens (image, padding) no n-gram may span.
        """
        seq = self._sequence(canonical, history, blocked)
        width, length = self.max_ngram_size - 1, seq.shape[1] - (self.max_ngram_size - 1)
        out = np.empty((seq.shape[0], length, self.max_ngram_size), np.int64)
        stopped = np.zeros((seq.shape[0], length), bool)
        for shift in range(self.max_ngram_size):
            source = seq[:, width - shift: width - shift + length]
            stopped |= source == DEAD
            out[..., shift] = np.where(stopped, self.pad_id, source)
        return out

    def __call__(
        self, canonical: Int[np.ndarray, "b s"], history: Int[np.ndarray, "b n1"] | None = None,
        blocked: Bool[np.ndarray, "b s"] | None = None,
    ) -> Int32[np.ndarray, "layers b s k"]:
        """Row indices into each layer's table: [i] is for Engram layer `layer_ids[i]`, k = `n_lookups`.

        Hashing a sequence in chunks (each with the `next_history` of the one before) equals hashing it
        whole. Arguments as in `windows`.
        """
        tokens = self.windows(canonical, history, blocked)
        products = tokens[:, :, None, :] * self.multipliers  # [b, s, layers, N], int64 (never overflows)
        rolling, rows = products[..., 0], []
        for shift in range(1, self.max_ngram_size):
            rolling = rolling ^ products[..., shift]
            rows.append(rolling[..., None] % self.primes[:, shift - 1])  # [b, s, layers, heads]
        rows = np.concatenate(rows, axis=-1) + self.offsets
        return np.moveaxis(rows, 2, 0).astype(np.int32)

    def next_history(
        self, canonical: Int[np.ndarray, "b s"], history: Int[np.ndarray, "b n1"] | None = None,
        blocked: Bool[np.ndarray, "b s"] | None = None,
    ) -> Int64[np.ndarray, "b n1"]:
        """The history to pass with the chunk that follows this one (blocked tokens become DEAD)."""
        return self._sequence(canonical, history, blocked)[:, -(self.max_ngram_size - 1):]


# ---- tables ----------------------------------------------------------------------------------

def table_names(layer: int) -> tuple[str, str]:
    """Native checkpoint names of layer `layer`'s Engram table: (rows [R, head_dim], scales [R, head_dim/32])."""
    return f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"


def dequantize_rows(
    rows: Shaped[Array | np.ndarray, "*idx d"], scales: Shaped[Array | np.ndarray, "*idx blocks"] | None
) -> Float32[Array | np.ndarray, "*idx d"]:
    """Gathered table rows to float32: FP8 value x 2^(scale byte - 127) per 32 channels (rows as-is unscaled).
    jax or numpy arrays in, the same kind out (both exact: FP8 to float32 and power-of-two scales); call it
    inside a jitted function for jax arrays (`_dequantize_on_device`)."""
    values = rows.astype(np.float32)
    if scales is None:
        return values
    blocks = values.reshape(*values.shape[:-1], scales.shape[-1], SCALE_BLOCK)
    return (blocks * scales.astype(np.float32)[..., None]).reshape(values.shape)


_dequantize_on_device = jax.jit(dequantize_rows)


def _checked_table(weight, scale):
    """(weight, scale as float8_e8m0fnu or None), after checking dtypes and shapes."""
    if weight.ndim != 2:
        raise ValueError(f"an Engram table must be [rows, head_dim], got shape {weight.shape}")
    if scale is None:
        if weight.dtype != np.float32:
            raise TypeError(f"an unscaled Engram table must be float32, got {weight.dtype}")
        return weight, None
    if weight.dtype != ml_dtypes.float8_e4m3fn:
        raise TypeError(f"a scaled Engram table must be float8_e4m3fn, got {weight.dtype}")
    if scale.dtype == np.uint8:
        scale = scale.view(ml_dtypes.float8_e8m0fnu)
    if scale.dtype != ml_dtypes.float8_e8m0fnu:
        raise TypeError(f"Engram table scales must be float8_e8m0fnu or uint8, got {scale.dtype}")
    expected = (weight.shape[0], weight.shape[1] // SCALE_BLOCK)
    if weight.shape[1] % SCALE_BLOCK or tuple(scale.shape) != expected:
        raise ValueError(f"Engram table {tuple(weight.shape)} needs scales of shape {expected} "
                         f"(one per {SCALE_BLOCK} channels), got {tuple(scale.shape)}")
    return weight, scale


class EngramTable(abc.ABC):
    """One Engram layer's table; `gather(indices)` returns dequantised float32 rows on the device."""

    num_rows: int
    head_dim: int
    axes = ("table_rows", None)  # logical axes of `weight` and `scale`: rows, then channels or scale blocks

    @abc.abstractmethod
    def gather(self, indices: Int[Array, "*idx"] | Int[np.ndarray, "*idx"]) -> Float32[Array, "*idx d"]:
        """Rows `indices` (e.g. [b, s, n_lookups] from `NgramHasher`) as float32 [..., head_dim]."""

    def gather_host(self, indices: Int[np.ndarray, "*idx"]) -> Float32[np.ndarray, "*idx d"]:
        """`gather` into host memory (the serving engine's step inputs)."""
        return np.asarray(self.gather(indices))


class HostEngramTable(EngramTable):
    """Table in host memory (numpy; may be memory-mapped): rows are gathered on the host and only they are
    moved to `device` (FP8 + scales, 264 bytes per 256-dim row), then dequantised there."""

    def __init__(self, weight: Shaped[np.ndarray, "rows d"], scale: Shaped[np.ndarray, "rows blocks"] | None,
                 device: jax.Device | jax.sharding.Sharding | None = None):
        self.weight, self.scale = _checked_table(weight, scale)
        self.num_rows, self.head_dim = weight.shape
        self.device = device

    def gather(self, indices: Int[Array, "*idx"] | Int[np.ndarray, "*idx"]) -> Float32[Array, "*idx d"]:
        indices = np.asarray(indices)
        rows = jax.device_put(self.weight[indices], self.device)
        scales = None if self.scale is None else jax.device_put(self.scale[indices], self.device)
        return _dequantize_on_device(rows, scales)

    def gather_host(self, indices: Int[np.ndarray, "*idx"]) -> Float32[np.ndarray, "*idx d"]:
        """Gathered and dequantised on the host, with no round trip through the device."""
        indices = np.asarray(indices)
        return dequantize_rows(self.weight[indices], None if self.scale is None else self.scale[indices])


class DeviceEngramTable(EngramTable):
    """Table in device memory (jax arrays); gather and dequantisation run in one jitted call.

    Indices must lie in [0, num_rows) (`NgramHasher` guarantees it; out-of-range ones are clamped).
    """

    def __init__(self, weight: Shaped[np.ndarray, "rows d"] | Shaped[Array, "rows d"],
                 scale: Shaped[np.ndarray, "rows blocks"] | Shaped[Array, "rows blocks"] | None):
        weight, scale = _checked_table(weight, scale)
        self.weight = jnp.asarray(weight)
        self.scale = None if scale is None else jnp.asarray(scale)
        self.num_rows, self.head_dim = self.weight.shape

    def gather(self, indices: Int[Array, "*idx"] | Int[np.ndarray, "*idx"]) -> Float32[Array, "*idx d"]:
        return _gather_dequantize(self.weight, self.scale, jnp.asarray(indices))


@jax.jit
def _gather_dequantize(weight, scale, indices):
    rows = jnp.take(weight, indices, axis=0, mode="clip")
    scales = None if scale is None else jnp.take(scale, indices, axis=0, mode="clip")
    return dequantize_rows(rows, scales)


# ---- the gate --------------------------------------------------------------------------------

class Engram(nnx.Module):
    """The Engram update of one layer: streams_k += g_k * v, computed in fp32.

    `wkv` maps the concatenated looked-up rows to one key per stream plus a shared value v. With
    w = q_weight * k_weight (the two RMSNorm gains, only ever used as a product),
    dot_k = sum_d(h_k * w_k * key_k) * rsqrt(mean h_k^2 + eps) * rsqrt(mean key_k^2 + eps) / sqrt(D), and
    g_k = sigmoid(sign(dot_k) * sqrt(max(|dot_k|, 1e-6))); the norms are per stream over D. Blocked
    tokens get g = 0 (their streams pass through).
    """

    clamp = 1e-6  # floor of |dot| under the square root

    def __init__(self, hidden_size: int, hc_mult: int, n_lookups: int, head_dim: int, eps: float, dtype,
                 rngs: nnx.Rngs):
        self.wkv = Linear(n_lookups * head_dim, hidden_size * (hc_mult + 1), dtype, rngs)
        self.q_weight = param(jnp.ones((hc_mult, hidden_size), jnp.float32), "hc", "embed")
        self.k_weight = param(jnp.ones((hc_mult, hidden_size), jnp.float32), "hc", "embed")
        self.hidden_size, self.hc_mult, self.eps = hidden_size, hc_mult, eps

    def __call__(
        self, streams: Float[Array, "b s n d"], rows: Float[Array, "b s k e"],
        blocked: Bool[Array, "b s"] | None = None,
    ) -> Float[Array, "b s n d"]:
        kv = self.wkv(rows.reshape(*rows.shape[:-2], -1))  # rows cast to the weight's dtype, as upstream
        d, n = self.hidden_size, self.hc_mult
        key = kv[..., :n * d].astype(jnp.float32).reshape(*kv.shape[:-1], n, d)
        value = kv[..., n * d:].astype(jnp.float32)
        weight = self.q_weight[...].astype(jnp.float32) * self.k_weight[...].astype(jnp.float32)
        h = streams.astype(jnp.float32)
        rstd = (jax.lax.rsqrt(jnp.mean(h * h, axis=-1) + self.eps)
                * jax.lax.rsqrt(jnp.mean(key * key, axis=-1) + self.eps))
        dot = jnp.sum(h * weight * key, axis=-1) * rstd * d ** -0.5
        gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), self.clamp)), dot))
        if blocked is not None:
            gate = jnp.where(blocked[..., None], 0.0, gate)
        return (h + gate[..., None] * value[..., None, :]).astype(streams.dtype)


# ---- per-model lookup ------------------------------------------------------------------------

class EngramMemory:
    """Everything a V4.1 model needs to turn token ids into Engram rows: the canonical-id map, the hasher
    and one table per Engram layer (all host-placed or all device-placed)."""

    def __init__(self, config, token_map: Int[np.ndarray, "vocab"], tables: Sequence[EngramTable]):
        if len(tables) != len(config.engram_layer_ids):
            raise ValueError(f"{len(tables)} Engram tables for layers {list(config.engram_layer_ids)}")
        token_map = np.asarray(token_map, np.int64)
        if token_map.shape != (config.vocab_size,):
            raise ValueError(f"canonical token map has shape {token_map.shape}; expected ({config.vocab_size},)")
        self.token_map, self.tables = token_map, tuple(tables)
        self.hasher = NgramHasher(config.engram_layer_ids, config.engram_vocab_size, config.engram_num_embeddings,
                                  config.engram_max_ngram_size, config.engram_n_heads,
                                  config.engram_compressed_vocab_size, int(token_map[config.engram_pad_id]))

    @classmethod
    def identity_map(cls, config) -> Int64[np.ndarray, "vocab"]:
        """Canonical ids for a model without a tokenizer: each token is its own id (needs equal sizes)."""
        if config.engram_compressed_vocab_size != config.vocab_size:
            raise ValueError(f"Engram needs the tokenizer's canonical ids: engram_compressed_vocab_size="
                             f"{config.engram_compressed_vocab_size} differs from vocab_size={config.vocab_size}")
        return np.arange(config.vocab_size, dtype=np.int64)

    def empty_history(self, batch: int) -> Int64[np.ndarray, "b n1"]:
        """The look-back history of sequences that have not started."""
        return np.full((batch, self.hasher.max_ngram_size - 1), DEAD, np.int64)

    def lookup(self, tokens: Int[np.ndarray, "b c"], history: Int[np.ndarray, "b n1"], on_host: bool = False):
        """(rows per Engram layer [b, c, n_lookups, head_dim] on the device, or in host memory with `on_host`,
        the history after this chunk)."""
        canonical = self.token_map[np.asarray(tokens)]
        indices = self.hasher(canonical, history)
        rows = tuple((table.gather_host if on_host else table.gather)(idx) for table, idx in zip(self.tables, indices))
        return rows, self.hasher.next_history(canonical, history)

    def advance(self, tokens: Int[np.ndarray, "b c"], history: Int[np.ndarray, "b n1"]) -> Int[np.ndarray, "b n1"]:
        """The history after `tokens` (no lookup: e.g. the committed part of a speculative block)."""
        return self.hasher.next_history(self.token_map[np.asarray(tokens)], history)
