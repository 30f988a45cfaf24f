"""Token streams for training: documents joined with eos, seeded random training windows, fixed held-out
windows, and the bigram baseline a trained model has to beat."""

from __future__ import annotations

import numpy as np
from jaxtyping import Int

from model.tokenizer import TextTokenizer


def token_stream(texts: list[str], tokenizer: TextTokenizer, eos_id: int) -> Int[np.ndarray, " n"]:
    """Every text's tokens followed by eos, concatenated (int32)."""
    ids = []
    for text in texts:
        ids += tokenizer.encode(text) + [eos_id]
    return np.asarray(ids, np.int32)


def train_batch(stream: Int[np.ndarray, " n"], batch: int, length: int, seed: int,
                step: int) -> Int[np.ndarray, "b length"]:
    """`batch` windows of `length` tokens at offsets drawn from (seed, step) alone, so a resumed run sees the
    batches an uninterrupted one would."""
    if stream.shape[0] <= length:
        raise ValueError(f"a training stream of {stream.shape[0]} tokens is too short for windows of {length}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, step]))
    starts = rng.integers(0, stream.shape[0] - length + 1, size=batch)
    return stream[starts[:, None] + np.arange(length)]


def held_out_windows(stream: Int[np.ndarray, " n"], length: int) -> Int[np.ndarray, "w length"]:
    """Consecutive non-overlapping windows of `length` tokens (the tail that fills no window is dropped)."""
    n = stream.shape[0] // length
    if n == 0:
        raise ValueError(f"a held-out stream of {stream.shape[0]} tokens is too short for windows of {length}")
    return stream[:n * length].reshape(n, length)


def bigram_loss(train: Int[np.ndarray, " n"], windows: Int[np.ndarray, "w length"], vocab_size: int) -> float:
    """Mean next-token cross-entropy (nats) on held-out `windows` (tokens 1.. of each, as a model is scored) of
    a bigram model counted on `train`, interpolated with add-one unigrams: p = l p(b | a) + (1 - l) p(b); l is
    the best of a grid on the windows themselves, so the baseline is as strong as such a bigram gets."""
    pairs = np.zeros((vocab_size, vocab_size), np.float64)
    np.add.at(pairs, (train[:-1], train[1:]), 1.0)
    unigram = (np.bincount(train, minlength=vocab_size) + 1.0) / (train.shape[0] + vocab_size)
    rows = pairs.sum(axis=1)
    a, b = windows[:, :-1].ravel(), windows[:, 1:].ravel()
    bigram = pairs[a, b] / np.maximum(rows[a], 1.0)
    return min(float(-np.mean(np.log(lam * bigram + (1 - lam) * unigram[b]))) for lam in np.linspace(0, 0.99, 100))


def model_loss(model, windows: Int[np.ndarray, "w length"], batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) of a `model.api.Model` on `windows` (tokens 1.. of each, predicted
    from the tokens before them in the window), through its full-sequence forward."""
    total = 0.0
    for i in range(0, len(windows), batch):
        chunk = windows[i:i + batch]
        logits = np.asarray(model.logits(chunk[:, :-1]), np.float64)
        top = logits.max(axis=-1, keepdims=True)
        log_z = top[..., 0] + np.log(np.exp(logits - top).sum(axis=-1))
        total += float(np.sum(log_z - np.take_along_axis(logits, chunk[:, 1:, None], axis=-1)[..., 0]))
    return total / (windows.shape[0] * (windows.shape[1] - 1))
