"""Suite ``spec``: real drafting. The shipped trained target (pycoder-mini) with its trained block drafter
(``--drafter dflash``) on held-out prompts the model never saw (engine/model/presets/pycoder-mini/
heldout_prompts.json, tools/pycoder_prompts.py), PROMPTS prompts x NEW_TOKENS new tokens, at T = 0 and T = 1.

For each temperature, side by side in one run: AR (the peer), a chain (the drafter's top-1 per depth: budget L,
top-K 1) and DDTree at BUDGETS (drafter top-K = min(B, V)), block size BLOCK_SIZE. Per run:
- mean tau (tokens per verify step, the bonus counted) and tokens/s (new tokens over decode wall time, summed over
  the prompts, after one untimed decode of the first prompt that compiles and captures; ratio: against AR at the
  same temperature);
- tokens equal to AR: speculative decoding must commit AR's tokens (at T = 1 too: the sampling noise is keyed by
  (seed, position), docs/ddtree.md), a run that does not misses its target;
- acceptance per depth, the drafter's stated probability against the measured rate per (depth, rank) and its
  expected calibration error, by traces.analytics over the run's steps
  (each prompt's steps recorded to a temporary trace and analysed there, then combined weighted by steps / by
  forecasts), the same numbers `kdtree info` gives for one trace.
On a GPU the target and the drafter run on the cuda backend (the drafter's forward on the device:
engine/device/drafter.py); elsewhere both run on the reference backend (float64: slower, but exact).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kdspec.engine.bench.common import progress, row
from kdspec.engine.decode import api
from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.model.checkpoint import model_directory
from kdspec.traces import RunMetadata, TraceWriter, open_trace
from kdspec.traces.analytics import analyze, binned_calibration

SUITE = "spec"
MODEL = "pycoder-mini"
PROMPTS, NEW_TOKENS = 32, 128
TEMPERATURES = (0.0, 1.0)
BLOCK_SIZE = 8
BUDGETS = (8, 16, 32, 64, 128, 256)
PROMPTS_FILE = "heldout_prompts.json"


def heldout_prompts(count: int) -> list[list[int]]:
    """The first ``count`` held-out prompts of the shipped model (token ids)."""
    path = Path(model_directory(MODEL)) / PROMPTS_FILE
    prompts = json.loads(path.read_text())["prompts"]
    if len(prompts) < count:
        raise ValueError(f"{path} holds {len(prompts)} prompts, fewer than {count}")
    return prompts[:count]


def _runs(block_size: int, budgets) -> list[tuple[str, dict]]:
    """(label, DecodeConfig keywords) of every run: AR first (the peer), then the chain, then DDTree."""
    depths = block_size - 1
    runs = [("AR", {"mode": "ar"}),
            (f"chain (top-1, B={depths})", {"mode": "ddtree", "budget": depths, "topk": 1})]
    runs += [(f"DDTree B={b}", {"mode": "ddtree", "budget": b}) for b in budgets]
    return runs


class _Totals:
    """One run summed over the prompts."""

    def __init__(self):
        self.tokens = self.equal = self.steps = 0
        self.seconds = 0.0
        self.taus: list[int] = []
        self.reached = None          # sum over prompts of steps x reached[d]
        self.bins = None             # [3, BINS]: forecasts, sum of stated, sum of hits per bin
        self.top1 = None             # the same over the rank-0 forecasts
        self.cells = None            # [3, L, K]: forecasts, sum of stated, sum of hits per (depth, rank)

    def add(self, result, ar_tokens, analytics) -> None:
        self.tokens += len(result.tokens)
        self.equal += int(np.array_equal(result.tokens, ar_tokens))
        self.seconds += result.elapsed
        self.taus += list(result.taus)
        if analytics is None or analytics.num_depths == 0:
            return
        steps = analytics.num_steps
        self.steps += steps
        reached = steps * np.nan_to_num(analytics.reached)
        self.reached = reached if self.reached is None else self.reached + reached
        c = analytics.calibration
        count = np.nan_to_num(c.bin_count)
        bins = np.stack([count, count * np.nan_to_num(c.bin_stated), count * np.nan_to_num(c.bin_measured)])
        self.bins = bins if self.bins is None else self.bins + bins
        count = np.nan_to_num(c.top1_bin_count)
        top1 = np.stack([count, count * np.nan_to_num(c.top1_bin_stated), count * np.nan_to_num(c.top1_bin_measured)])
        self.top1 = top1 if self.top1 is None else self.top1 + top1
        cell_count = np.nan_to_num(c.count)
        cells = np.stack([cell_count, cell_count * np.nan_to_num(c.stated), cell_count * np.nan_to_num(c.measured)])
        self.cells = cells if self.cells is None else self.cells + cells

    @property
    def mean_tau(self) -> float:
        return float(np.mean(self.taus)) if self.taus else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def acceptance(self) -> str:
        if self.reached is None or not self.steps:
            return "-"
        return " ".join(f"{d + 1}:{r / self.steps:.2f}" for d, r in enumerate(self.reached))

    def calibration(self, ranks: int = 2) -> str:
        """Per depth, the drafter's mean stated probability and the measured rate for ranks 0..ranks-1."""
        if self.cells is None:
            return "-"
        count, stated, hits = self.cells
        parts = []
        for d in range(count.shape[0]):
            cells = []
            for r in range(min(ranks, count.shape[1])):
                n = count[d, r]
                cells.append(f"r{r} {stated[d, r] / n:.2f}/{hits[d, r] / n:.2f}" if n else f"r{r} -")
            parts.append(f"d{d + 1} " + " ".join(cells))
        return "; ".join(parts)

    def ece(self, top1: bool = False) -> float:
        """The ECE of the combined bins (of the rank-0 forecasts with ``top1``)."""
        bins = self.top1 if top1 else self.bins
        return float("nan") if bins is None else binned_calibration(*bins)[2]


def _analysed(engine, prompt, config, result_records, path) -> object:
    """traces.analytics of one decode's step records, written to a trace at ``path`` first."""
    run = RunMetadata(config.resolved(engine.cfg.vocab_size).as_dict(),
                      {**engine.cfg.to_hf_dict(), "name": MODEL}, backend=engine.backend, device="bench",
                      prompt_tokens=prompt)
    with TraceWriter(path, run, force=True) as writer:
        for record in result_records:
            writer.write_step(record)
    with open_trace(path) as reader:
        return analyze(reader, check_steps=0)


def run(quick: bool = False, temperatures=TEMPERATURES, budgets=BUDGETS) -> list[dict]:
    """The suite's rows; ``temperatures`` and ``budgets`` split it into processes that fit shorter limits."""
    backend = "reference" if quick else "auto"
    prompts_n, new_tokens, budgets = (2, 8, (8,)) if quick else (PROMPTS, NEW_TOKENS, budgets)
    engine = api.load(MODEL, backend=backend)
    if engine.backend == "sim":   # the simulator is for toy shapes; pycoder-mini runs exactly on the reference
        engine = api.load(MODEL, backend="reference")
    prompts = heldout_prompts(prompts_n)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kdtree-bench-spec-") as tmp:
        for temperature in temperatures:
            totals, ar_tokens = {}, []
            for label, keywords in _runs(BLOCK_SIZE, budgets):
                progress(f"spec: T={temperature:g} {label}, {len(prompts)} prompts x {new_tokens} tokens")
                drafter = None if keywords["mode"] == "ar" else "dflash"
                config = DecodeConfig(new_tokens, block_size=BLOCK_SIZE, temperature=temperature, drafter=drafter,
                                      **keywords)
                total = totals[label] = _Totals()
                # one untimed decode first: kernel compilation and graph capture are not the run's speed
                engine.generate(prompts[0], config, golden=False)
                started = time.perf_counter()
                for i, prompt in enumerate(prompts):
                    records = []
                    result = engine.generate(prompt, config, golden=False, on_step=records.append)
                    if keywords["mode"] == "ar":
                        ar_tokens.append(np.asarray(result.tokens))
                    analytics = None if keywords["mode"] == "ar" else _analysed(
                        engine, prompt, config, records, os.path.join(tmp, f"run{i}.h5"))
                    total.add(result, ar_tokens[i], analytics)
                # the run's headline figures as soon as it ends: a run cut short by a time limit keeps them
                progress(f"spec: T={temperature:g} {label} done in {time.perf_counter() - started:.1f} s, mean tau "
                         f"{total.mean_tau:.2f}, {total.tokens_per_second:.1f} tok/s, equal to AR {total.equal}/"
                         f"{len(prompts)}")
            rows += _rows(temperature, totals, len(prompts), new_tokens, engine.backend)
    return rows


def _rows(temperature: float, totals: dict, prompts: int, new_tokens: int, backend: str) -> list[dict]:
    ar = totals["AR"]
    rows = [row(SUITE, f"T={temperature:g} AR tokens/s", ar.tokens_per_second, "tok/s",
                note=f"{prompts} held-out prompts x {new_tokens} tokens, {MODEL} on {backend}")]
    for label, total in totals.items():
        if label == "AR":
            continue
        equal = total.equal == prompts
        rows.append(row(SUITE, f"T={temperature:g} {label} mean tau", total.mean_tau, "tok/step",
                        note=f"{len(total.taus)} steps; acceptance per depth {total.acceptance()}"))
        rows.append(row(SUITE, f"T={temperature:g} {label} drafter ECE", total.ece(), "",
                        note=f"top-1 ECE {total.ece(top1=True):.3f}; stated/measured per (depth, rank): "
                             f"{total.calibration()}"))
        rows.append(row(SUITE, f"T={temperature:g} {label} tokens/s", total.tokens_per_second, "tok/s",
                        peer="AR", peer_value=ar.tokens_per_second))
        rows.append(row(SUITE, f"T={temperature:g} {label} prompts equal to AR", total.equal, f"/{prompts}",
                        target="all", ok=equal,
                        note="speculative decoding must commit AR's tokens"))
    return rows
