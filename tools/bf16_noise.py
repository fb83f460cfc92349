"""How far bf16 weights move a model's logits from the float64 golden: the basis of the bf16 anomaly thresholds
(traces/thresholds.py, docs/benchmarks.md "bf16 logit noise").

The cuda backend's bf16 mode stores weights in bf16 and rounds each dense product's activation to bf16, with
fp32 accumulation. Emulated here in float64 (so the emulation adds no rounding of its own): every weight rounded
to bf16, every linear's input rounded to bf16. The golden's tokens are fed teacher-forced (one causal forward over
prompt + golden continuation equals the AR steps), so each position's |dlogit| compares like with like.

Printed per model: |dlogit| quantiles over every position, argmax flips, the golden's 10th-percentile top-1/top-2
margin, and the worst cache-row difference.

    python3 -m tools.bf16_noise [--models tiny small pycoder-mini] [--tokens 64]
"""
from __future__ import annotations

import argparse
from unittest import mock

import numpy as np

from kdspec.engine.golden import layers
from kdspec.engine.golden import model as golden_model
from kdspec.engine.golden.model import ReferenceModel, decode
from kdspec.engine.model.checkpoint import load_model
from kdspec.engine.model.safetensors_io import bf16_bits_to_float32, float32_to_bf16_bits
from kdspec.engine.model.tokenizer import tokenizer_for

PROMPTS = ("def parse_args(argv):\n    ", "The tree", "class Node:\n    def __init__(self, ")


def bf16(a: np.ndarray) -> np.ndarray:
    return bf16_bits_to_float32(float32_to_bf16_bits(np.asarray(a, np.float32))).astype(np.float64)


_FLOAT64_LINEAR = layers.linear


def bf16_linear(x, weight):
    return _FLOAT64_LINEAR(bf16(x), weight)


def teacher_forced(model: ReferenceModel, ids: np.ndarray):
    """(logits [s, V], cache) of one causal forward over ids."""
    cache = model.new_cache(len(ids))
    return model.forward(cache, ids, np.arange(len(ids))), cache


def cache_difference(a, b, rows: int) -> float:
    """max |a - b| over every layer's latent and rope-key rows 0..rows-1 (what a trace's cache_max_abs_diff is)."""
    return max(float(np.abs(x[:rows] - y[:rows]).max()) for x, y in zip(a.c + a.k_pe, b.c + b.k_pe))


def measure(name: str, tokens: int) -> dict:
    cfg, weights = load_model(name)
    golden = ReferenceModel(cfg, {k: v.astype(np.float64) for k, v in weights.items()})
    rounded = ReferenceModel(cfg, {k: bf16(v) for k, v in weights.items()})
    tokenizer = tokenizer_for(name)
    diffs, flips, margins, caches = [], 0, [], []
    for prompt in PROMPTS:
        ids = np.asarray(tokenizer.encode(prompt), np.int64)
        n = min(tokens, cfg.max_position_embeddings - len(ids))
        run = decode(golden, ids, n)
        full = np.concatenate([ids, run.tokens[:-1]])
        with mock.patch.object(golden_model, "linear", bf16_linear), \
                mock.patch.object(layers, "linear", bf16_linear):
            emulated, cache = teacher_forced(rounded, full)
        emulated = emulated[len(ids) - 1:]
        caches.append(cache_difference(cache, run.cache, len(full)))
        diffs.append(np.abs(emulated - run.logits).max(axis=1))
        flips += int((emulated.argmax(axis=1) != run.tokens).sum())
        top2 = np.sort(run.logits, axis=1)[:, -2:]
        margins.append(top2[:, 1] - top2[:, 0])
    d = np.concatenate(diffs)
    return {"model": name, "positions": len(d), "p50": float(np.median(d)), "p99": float(np.quantile(d, 0.99)),
            "max": float(d.max()), "argmax flips": flips, "cache max": max(caches),
            "golden margin p10": float(np.quantile(np.concatenate(margins), 0.1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small", "pycoder-mini"])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"{'model':<14} {'positions':>9} {'p50':>9} {'p99':>9} {'max':>9} {'flips':>6} {'margin p10':>10} "
          f"{'cache max':>9}")
    for name in args.models:
        r = measure(name, args.tokens)
        print(f"{r['model']:<14} {r['positions']:>9} {r['p50']:>9.2e} {r['p99']:>9.2e} {r['max']:>9.2e} "
              f"{r['argmax flips']:>6} {r['golden margin p10']:>10.3g} {r['cache max']:>9.2e}")


if __name__ == "__main__":
    main()
