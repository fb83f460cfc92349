"""Reference token choice: greedy argmax, Gumbel-max sampling with counter-based noise, top-k with margin.

The noise for token v at absolute position p depends only on (seed, p, v), so a tree node and the AR step
at the same position draw the same noise (docs/ddtree.md). The hash is splitmix64's finaliser on
uint64 (wrapping multiply, xor, shift), which a GPU reproduces bit for bit; the uniform takes the top 53
bits. Gumbel noise is -log(-log(u)) in float64; a GPU's float64 log may differ from numpy's by an ulp,
which changes a choice only at an exact float64 tie.
"""
from __future__ import annotations

import math

import numpy as np

GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
MIX_MUL_1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_MUL_2 = np.uint64(0x94D049BB133111EB)
TWO_POW_MINUS_53 = 2.0 ** -53


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 (arrays or scalars), wrapping arithmetic."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * MIX_MUL_1
        z = (z ^ (z >> np.uint64(27))) * MIX_MUL_2
    return z ^ (z >> np.uint64(31))


def row_key(seed: int, position: int) -> np.uint64:
    """uint64 key of one (seed, absolute position) row of noise."""
    with np.errstate(over="ignore"):
        return mix64(mix64(np.uint64(seed)) + np.uint64(position) * GOLDEN_GAMMA)[()]


def uniform(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    """float64 u in (0, 1) for each token id: (top 53 bits of the hash + 0.5) * 2^-53."""
    token_ids = np.asarray(token_ids, dtype=np.uint64)
    with np.errstate(over="ignore"):
        bits = mix64(row_key(seed, position) + (token_ids + np.uint64(1)) * GOLDEN_GAMMA)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * TWO_POW_MINUS_53


def gumbel_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """float64 [V]: standard Gumbel noise -log(-log(u)) for tokens 0..V-1 at this (seed, position)."""
    if seed < 0 or position < 0 or vocab <= 0:
        raise ValueError(f"need seed >= 0, position >= 0, vocab > 0; got {seed}, {position}, {vocab}")
    return -np.log(-np.log(uniform(seed, position, np.arange(vocab))))


def check_temperature(temperature) -> float:
    """The temperature as a float; ValueError unless it is a finite number >= 0 (not a bool)."""
    if (isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer, np.floating))
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    return float(temperature)


def choose_token(logits: np.ndarray, temperature: float, seed: int, position: int) -> int:
    """Next token from logits [V]: argmax (ties -> lowest id) at T == 0, else argmax(logits / T + gumbel).

    The division and addition run in float64 (logits widened first).
    """
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.shape[0] == 0:
        raise ValueError(f"logits must be [V] with V > 0, got shape {logits.shape}")
    temperature = check_temperature(temperature)
    if temperature == 0:
        return int(np.argmax(logits))  # np.argmax returns the first (lowest) index of the max
    perturbed = logits.astype(np.float64) / np.float64(temperature) + gumbel_noise(seed, position, logits.shape[0])
    return int(np.argmax(perturbed))


def choose_tokens(logits: np.ndarray, temperature: float, seed: int, positions: np.ndarray) -> np.ndarray:
    """int64 [s]: choose_token for each row of logits [s, V] at absolute positions [s]."""
    return np.asarray([choose_token(row, temperature, seed, int(p)) for row, p in zip(logits, positions)],
                      dtype=np.int64)


def topk_with_margin(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k of logits [V] (ties -> lower id) and the top-1 minus top-2 margin.

    Returns (ids int64 [k], values [k] in the logits' dtype, margin scalar in the logits' dtype;
    +inf when V == 1).
    """
    logits = np.asarray(logits)
    if logits.ndim != 1 or not 1 <= k <= logits.shape[0]:
        raise ValueError(f"need logits [V] and 1 <= k <= V, got shape {logits.shape} and k={k}")
    order = np.lexsort((np.arange(logits.shape[0]), -logits.astype(np.float64)))[:max(k, 2)]
    values = logits[order]
    margin = values[0] - values[1] if len(order) > 1 else logits.dtype.type(np.inf)
    return order[:k].astype(np.int64), values[:k], margin
