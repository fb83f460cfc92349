"""Shared helpers of the TUI tests (no tests here): trace fixtures, settling the app, a stable reader.

Everything the tests compare against comes from the synthetic records themselves (engine.bench.synthetic),
never from the app's own computations.
"""
from __future__ import annotations

from kdspec.engine.bench.synthetic import synthetic_records, write_synthetic_trace
from kdspec.kdtree_tui.screenshots import stable_opener  # noqa: F401  (re-exported to the snapshot tests)

# A small trace: 120 steps, block 8, budget 16 (anomalies every 29 steps).
SMALL_STEPS = 120


def small_trace(directory, name="synthetic.h5", steps=SMALL_STEPS, **kwargs) -> str:
    return write_synthetic_trace(directory / name, steps, **kwargs)


def small_records(steps=SMALL_STEPS, **kwargs) -> list[dict]:
    return list(synthetic_records(steps, **kwargs))


async def settle(app, pilot, rounds: int = 3) -> None:
    """Let the reader workers finish and their messages be handled."""
    from textual.worker import WorkerCancelled

    for _ in range(rounds):
        await pilot.pause()
        try:
            await app.workers.wait_for_complete()
        except WorkerCancelled:  # an exclusive worker replaced by a newer one (follow polling)
            pass
        await pilot.pause()


def brute_flags(records, dlogit=1e-4, min_tau=2, cache=1e-4) -> list[set]:
    """Per step the set of anomaly names, computed by plain loops over the records."""
    out = []
    for r in records:
        names = set()
        if any(int(c) != int(g) for c, g in zip(r["committed_tokens"], r["golden_tokens"])):
            names.add("golden divergence")
        if any(abs(float(d)) > dlogit for d in r["logit_max_abs_diff"]):
            names.add("|dlogit| over threshold")
        if len(r["accepted_nodes"]) < min_tau:
            names.add("tau below threshold")
        if abs(float(r["cache_max_abs_diff"])) > cache:
            names.add("cache mismatch")
        out.append(names)
    return out


def text_of(ids) -> str:
    return "".join(chr(t) if 32 <= t < 127 else f"<{t}>" for t in ids)


def run_async(test):
    """Run an async test body with asyncio.run (no pytest async plugin is installed)."""
    import asyncio
    import functools

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return wrapper


def logits_trace(directory, name="logits.h5", steps=40, golden=lambda i: i % 3 != 2, seed=5, **shape):
    """A synthetic trace recorded with save_logits: (path, records). Each record carries ``logits`` [tau, V]
    (random, the committed token the argmax) and, for the steps where ``golden(step)``, ``golden_logits``: those
    plus noise (float64)."""
    import numpy as np
    from kdspec.engine.bench.synthetic import synthetic_metadata
    from kdspec.traces.writer import TraceWriter

    meta = synthetic_metadata(**shape)
    vocab = meta.model_config["vocab_size"]
    rng = np.random.default_rng(seed)
    path, records, output = directory / name, [], []
    with TraceWriter(path, meta, save_logits=True, compression="lzf") as writer:
        for i, r in enumerate(synthetic_records(steps, **shape)):
            tau = len(r["accepted_nodes"])
            logits = rng.standard_normal((tau, vocab)).astype(np.float32)
            logits[np.arange(tau), r["committed_tokens"]] = 4.0
            r = {**r, "logits": logits}
            if golden(i):
                r["golden_logits"] = logits.astype(np.float64) + rng.normal(0.0, 0.3, (tau, vocab))
            writer.write_step(r)
            records.append(r)
            output.extend(([int(r["root_token"])] if not output else []) + r["committed_tokens"].tolist())
        writer.finish(output)
    return str(path), records


def screen_text(app) -> str:
    """The app's screen as plain text (what export_screenshot draws, without the SVG)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, color_system="truecolor",
                      record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()
