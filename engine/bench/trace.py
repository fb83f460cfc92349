"""Suite ``trace``: what recording a trace costs on k2-mini (the e2e suite's model, loaded once).

For AR and DDTree (oracle drafter, block 8, budget 7) the same decode runs twice, alternately, without and
with ``on_step`` writing every step to a TraceWriter (records built by the decode loop, written by
traces/writer.py; golden None). Reported:
- recording overhead = (wall with trace - wall without) / wall with trace (target <= 5%): records + writes,
  over a 256-token decode (DDTree oracle B=7: 32 steps), a recording of the length a user records;
- its two parts: the per-run cost of creating the file (schema, metadata) and closing it (a few ms, whatever
  the run's length: most of the overhead of a 6-step run), and the per-step share, time inside
  TraceWriter.write_step / wall with trace;
- bytes per step = trace file size after close / steps.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

from kdspec.engine.bench.common import progress, row
from kdspec.engine.bench.e2e import load_model
from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.decode.drafters import parse_drafter
from kdspec.engine.decode.loop import generate
from kdspec.traces import RunMetadata, TraceWriter

SUITE = "trace"
TARGET_OVERHEAD = 0.05


def _record(cfg, model, ops, prompt, config, drafter, path):
    """One decode of ``config`` writing a trace at ``path``: (wall seconds, seconds in write_step, steps, seconds
    creating and closing the file)."""
    start = time.perf_counter()
    run = RunMetadata(config.resolved(cfg.vocab_size).as_dict(), {**cfg.to_hf_dict(), "name": cfg.name},
                      backend=model.backend, device="bench", prompt_tokens=prompt)
    writer = TraceWriter(path, run, force=True)
    spent = [0.0]
    created = time.perf_counter()

    def on_step(record):
        start = time.perf_counter()
        writer.write_step(record)
        spent[0] += time.perf_counter() - start

    result = generate(model, prompt, config, drafter, on_step=on_step, tree_ops=ops)
    decoded = time.perf_counter()
    writer.finish(result.tokens)
    writer.close()
    end = time.perf_counter()
    return end - start, spent[0], result.steps, (created - start) + (end - decoded)


def run(quick: bool = False) -> list[dict]:
    cfg, model, ops, _ = load_model(quick)
    # Host-bound AR steps vary by milliseconds from run to run (seen: +-4 ms per step on `small`), so the
    # overhead compares the fastest of several alternating runs; the medians go into the note.
    new_tokens, block, budget, repeats = (2, 3, 2, 1) if quick else (256, 8, 7, 7)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, cfg.vocab_size, 4 if quick else 32).astype(np.int64)
    if quick:  # the simulator is slow: random "golden" tokens (the oracle then misses; every path still runs)
        golden = rng.integers(0, cfg.vocab_size, len(prompt) + new_tokens + block)
    else:  # the engine's own AR continuation, as in the e2e suite
        continuation = generate(model, prompt, DecodeConfig(new_tokens + block), tree_ops=ops).tokens
        golden = np.concatenate([prompt, continuation])
    ddtree = DecodeConfig(new_tokens, mode="ddtree", block_size=block, budget=budget)
    drafter = parse_drafter("oracle").build(golden, block - 1, ddtree.resolved(cfg.vocab_size).topk, cfg.vocab_size)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kdtree-bench-") as tmp:
        for mode, config, mode_drafter in (("ar", DecodeConfig(new_tokens), None), ("ddtree", ddtree, drafter)):
            progress(f"trace: {mode}, {new_tokens} tokens, with and without a trace")
            path = os.path.join(tmp, f"{mode}.h5")
            plain, traced, writes, fixed = [], [], [], []
            for _ in range(repeats):
                start = time.perf_counter()
                generate(model, prompt, config, mode_drafter, tree_ops=ops)
                plain.append(time.perf_counter() - start)
                wall, spent, steps, open_close = _record(cfg, model, ops, prompt, config, mode_drafter, path)
                traced.append(wall)
                writes.append(spent / wall)
                fixed.append(open_close)
            plain_s, traced_s = min(plain), min(traced)
            overhead = (traced_s - plain_s) / traced_s
            label = "AR" if mode == "ar" else f"DDTree oracle B={budget}"
            rows.append(row(SUITE, f"{label} recording overhead", 100 * overhead, "%",
                            target=f"<= {100 * TARGET_OVERHEAD:g}%", ok=None if quick else overhead <= TARGET_OVERHEAD,
                            note=f"fastest of {repeats}: {plain_s * 1e3:.4g} ms without, {traced_s * 1e3:.4g} ms with a "
                                 f"trace ({steps} steps); medians {statistics.median(plain) * 1e3:.4g} / "
                                 f"{statistics.median(traced) * 1e3:.4g} ms; write_step alone "
                                 f"{100 * statistics.median(writes):.2g}% ({statistics.median(writes) * traced_s / steps * 1e3:.3g}"
                                 f" ms a step); file create + close {statistics.median(fixed) * 1e3:.3g} ms a run"))
            rows.append(row(SUITE, f"{label} bytes per step", os.path.getsize(path) / steps, "B",
                            note=f"{os.path.getsize(path)} B file, {steps} steps, gzip"))
    return rows
