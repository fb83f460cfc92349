"""What counts as an anomaly in a trace, by the precision it was recorded in: the one definition that
``kdtree info`` and the debugger use (each can override a value: ``--dlogit-threshold`` and friends, or the
app's thresholds screen).

A trace's precision comes from its run metadata: the reference backend is the float64 golden itself (its
differences are zero); the device backends run fp32 arithmetic over fp32 weights (the engine's golden
tolerance, 1e-4 per logit, docs/architecture.md) or over bf16 weights ("bfloat16": weights stored in bf16 and
activations rounded to bf16 before each dense product). The bf16 values rest on tools/bf16_noise.py's
measurement (docs/benchmarks.md, "bf16 logit noise"): they sit above what bf16 rounding does to a healthy model
at nearly every position, so a bf16 trace is not flagged on every step, yet a wrong kernel still is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional

import numpy as np

# precision -> (|dlogit| threshold, cache threshold)
PRECISION_THRESHOLDS = {
    "float64": (1e-9, 1e-9),
    "float32": (1e-4, 1e-4),
    "bfloat16": (0.25, 1.0),
}
DEFAULT_MIN_TAU = 2


@dataclass(frozen=True)
class Thresholds:
    """dlogit: a committed position's max |engine - golden| logit over this is flagged; cache: a step's compacted
    cache difference over this is flagged; min_tau: a DDTree step committing fewer tokens is flagged "short";
    precision: the precision the defaults were chosen for (or "custom")."""

    dlogit: float = PRECISION_THRESHOLDS["float32"][0]
    cache: float = PRECISION_THRESHOLDS["float32"][1]
    min_tau: int = DEFAULT_MIN_TAU
    precision: str = "float32"

    def __post_init__(self):
        for name in ("dlogit", "cache"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"the {name} threshold must be a finite number >= 0, got {value!r}")
        if isinstance(self.min_tau, bool) or not isinstance(self.min_tau, int) or self.min_tau < 0:
            raise ValueError(f"the minimum tau must be an integer >= 0, got {self.min_tau!r}")

    @property
    def logit_noise(self) -> float:
        """The gap below which two logits are a near-tie: each may be off by up to ``dlogit``."""
        return 2.0 * self.dlogit

    def with_values(self, dlogit: Optional[float] = None, cache: Optional[float] = None,
                    min_tau: Optional[int] = None) -> "Thresholds":
        """A copy with the given values replaced (None keeps one)."""
        changes = {k: v for k, v in (("dlogit", dlogit), ("cache", cache), ("min_tau", min_tau)) if v is not None}
        return replace(self, **changes) if changes else self

    def values_text(self) -> str:
        return f"|dlogit| > {self.dlogit:g}, cache > {self.cache:g}, tau < {self.min_tau}"

    def describe(self) -> str:
        origin = f"{self.precision} defaults" if self.precision in PRECISION_THRESHOLDS else "custom"
        return f"{self.values_text()} ({origin})"


def trace_precision(metadata: Mapping) -> str:
    """"float64" (reference backend), "bfloat16" (bf16 weights) or "float32", from a trace's run metadata."""
    if str(metadata.get("backend", "")) == "reference":
        return "float64"
    model = metadata.get("model_config")
    weight_dtype = model.get("weight_dtype") if isinstance(model, Mapping) else None
    return "bfloat16" if weight_dtype in ("bfloat16", "bf16") else "float32"


def thresholds_for(metadata: Mapping, dlogit: Optional[float] = None, cache: Optional[float] = None,
                   min_tau: Optional[int] = None) -> Thresholds:
    """The trace's precision's defaults, with any value given here instead (then the precision reads "custom")."""
    precision = trace_precision(metadata)
    default_dlogit, default_cache = PRECISION_THRESHOLDS[precision]
    base = Thresholds(default_dlogit, default_cache, DEFAULT_MIN_TAU, precision)
    custom = base.with_values(dlogit, cache, min_tau)
    return custom if custom == base else replace(custom, precision="custom")


# ------------------------------------------------------------------------------------------------ flags
# Anomaly flags, one bit each (uint8 per step).
DIVERGED, DLOGIT, LOW_TAU, CACHE = 1, 2, 4, 8
FLAG_NAMES = {DIVERGED: "golden divergence", DLOGIT: "|dlogit| over threshold", LOW_TAU: "tau below threshold",
              CACHE: "cache mismatch"}
FLAG_KEYS = {DIVERGED: "diverged", DLOGIT: "dlogit", LOW_TAU: "short", CACHE: "cache"}  # JSON keys
FLAG_COLUMNS = ("tau", "committed_tokens", "golden_tokens", "logit_max_abs_diff", "cache_max_abs_diff")
FLAG_BLOCK_STEPS = 8192


def flag_steps(columns: Mapping, thresholds: Thresholds, mode: str) -> np.ndarray:
    """uint8 [S]: DIVERGED | DLOGIT | LOW_TAU | CACHE per step, from FLAG_COLUMNS [S] / [S, L+1] (padding past
    tau ignored; a golden token < 0 is one the golden did not reach; NaN differences were not measured)."""
    c, t = columns, thresholds
    tau = np.asarray(c["tau"])
    committed, golden = np.asarray(c["committed_tokens"]), np.asarray(c["golden_tokens"])
    valid = np.arange(committed.shape[1])[None, :] < tau[:, None]
    diverged = ((committed != golden) & valid & (golden >= 0)).any(axis=1)
    with np.errstate(invalid="ignore"):
        dlogit = (np.where(valid, np.abs(c["logit_max_abs_diff"]), 0) > t.dlogit).any(axis=1)
        cache = np.abs(c["cache_max_abs_diff"]) > t.cache
    low_tau = (tau < t.min_tau) if mode != "ar" else np.zeros(len(tau), bool)
    flags = (diverged * DIVERGED) | (dlogit * DLOGIT) | (low_tau * LOW_TAU) | (cache * CACHE)
    return flags.astype(np.uint8)


def count_flags(reader, thresholds: Thresholds) -> dict:
    """{JSON key: steps flagged} over a whole trace (traces.reader.TraceReader), read in blocks of steps, plus
    "first" {key: first flagged step or None}."""
    counts = {key: 0 for key in FLAG_KEYS.values()}
    first: dict = {key: None for key in FLAG_KEYS.values()}
    mode = str(reader.metadata.get("mode", "ddtree"))
    for lo in range(0, reader.num_steps, FLAG_BLOCK_STEPS):
        hi = min(lo + FLAG_BLOCK_STEPS, reader.num_steps)
        flags = flag_steps(reader.fields(FLAG_COLUMNS, lo, hi), thresholds, mode)
        for bit, key in FLAG_KEYS.items():
            hits = np.flatnonzero(flags & bit)
            counts[key] += int(hits.size)
            if first[key] is None and hits.size:
                first[key] = lo + int(hits[0])
    return {**counts, "first": first}
