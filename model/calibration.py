"""Calibration of a drafter's confidences against the verifier's acceptance probabilities.

A draft's confidence c_k claims the probability that draft k is accepted given drafts 1..k-1 were; the verifier
knows that probability exactly, accept_prob = sum_v min(p_target, q_draft). `calibration_error` is the mean
|accept_prob - c| that DeepInfer logs online; `prefix_ece` the binned calibration error of the running products
prod_{i<=k} c_i (what a confidence-scheduled verifier ranks drafts by); `fit_sts` fits DSpark's sequential
temperature scaling: one temperature per block position, left to right, each minimising the prefix ECE at its
position given the temperatures before it (or, as an alternative objective, the mean absolute error).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Bool, Float

STS_GRID = np.exp(np.linspace(np.log(0.05), np.log(20.0), 121))  # candidate temperatures


def calibration_error(accept_prob: Float[np.ndarray, "*n"], confidence: Float[np.ndarray, "*n"],
                      mask: Bool[np.ndarray, "*n"] | None = None) -> float:
    """Mean |accept_prob - confidence| over the drafts (those `mask` selects)."""
    err = np.abs(np.asarray(accept_prob, np.float64) - np.asarray(confidence, np.float64))
    return float(err.mean() if mask is None else err[np.asarray(mask, bool)].mean())


def binned_ece(predicted: Float[np.ndarray, " n"], target: Float[np.ndarray, " n"], bins: int = 10) -> float:
    """Expected calibration error with soft targets: sum over equal-width bins of the predictions of
    (bin share) * |mean prediction - mean target|."""
    predicted, target = np.asarray(predicted, np.float64), np.asarray(target, np.float64)
    which = np.minimum((predicted * bins).astype(int), bins - 1)
    gap = np.bincount(which, predicted - target, minlength=bins)
    return float(np.sum(np.abs(gap)) / max(len(predicted), 1))


def prefix_ece(accept_prob: Float[np.ndarray, "n g"], confidence: Float[np.ndarray, "n g"],
               bins: int = 10) -> Float[np.ndarray, " g"]:
    """Per block position k, the binned ECE of prod_{i<=k} confidence against prod_{i<=k} accept_prob."""
    predicted, target = np.cumprod(confidence, axis=1), np.cumprod(accept_prob, axis=1)
    return np.array([binned_ece(predicted[:, k], target[:, k], bins) for k in range(predicted.shape[1])])


def sts_confidence(conf_logits: Float[np.ndarray, "*n"], temperatures) -> Float[np.ndarray, "*m"]:
    """sigmoid(logit / T): the confidence head's raw logits calibrated by STS temperatures (broadcast)."""
    return 1 / (1 + np.exp(-conf_logits / np.asarray(temperatures)))


def fit_sts(conf_logits: Float[np.ndarray, "n g"], accept_prob: Float[np.ndarray, "n g"],
            objective: str = "prefix_ece", bins: int = 10, grid: np.ndarray = STS_GRID) -> tuple[float, ...]:
    """Per-position temperatures T_k (confidence = sigmoid(logit / T_k)), chosen left to right on `grid`.

    `prefix_ece` (DSpark's STS): T_k minimises the prefix ECE at position k given T_1..T_{k-1}; `abs_error`:
    T_k minimises the mean |accept_prob_k - confidence_k| (the error DeepInfer monitors online)."""
    if objective not in ("prefix_ece", "abs_error"):
        raise ValueError(f"objective must be 'prefix_ece' or 'abs_error', got {objective!r}")
    conf_logits, accept_prob = np.asarray(conf_logits, np.float64), np.asarray(accept_prob, np.float64)
    temps, product = [], np.ones(conf_logits.shape[0])
    target = np.cumprod(accept_prob, axis=1)
    for k in range(conf_logits.shape[1]):
        conf = sts_confidence(conf_logits[None, :, k], grid[:, None])  # [grid, n]
        if objective == "abs_error":
            errors = np.mean(np.abs(conf - accept_prob[None, :, k]), axis=1)
        else:
            errors = [binned_ece(c, target[:, k], bins) for c in product[None] * conf]
        best = int(np.argmin(errors))
        temps.append(float(grid[best]))
        product = product * conf[best]
    return tuple(temps)
