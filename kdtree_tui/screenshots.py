"""SVG screenshots of the main screens (for the README): ``write_screenshots(directory, trace, compare)``.

`python3 -m tools.screenshots [DIR]` writes them from two synthetic traces (engine.bench.synthetic), so the
pictures are reproducible; the traces' own write times read as 0.
"""
from __future__ import annotations

import asyncio
import os
from typing import Optional

import numpy as np

from kdspec.kdtree_tui.app import TraceApp

SIZE = (110, 32)
# (file name, keys pressed after going to the step, step)
SHOTS = (("tree.svg", (), 7), ("logits.svg", ("2",), 7), ("cache.svg", ("3",), 21), ("run.svg", ("4",), 20),
         ("compare.svg", ("5",), 10), ("help.svg", ("question_mark",), 0), ("light.svg", ("d",), 12))


class StableReader:
    """Wraps a TraceReader so pictures do not depend on measured values: the trace's own write times
    (the only timings traces measure itself) read as 0."""

    def __init__(self, reader):
        self._reader = reader

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def column(self, name):
        values = self._reader.column(name)
        return np.zeros_like(values) if name == "time_trace_write" else values


def stable_opener(path):
    from kdspec.traces.reader import open_trace

    return StableReader(open_trace(path))


async def _shoot(app: TraceApp, keys, step: int, out: str) -> None:
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(3):
            await pilot.pause()
            await app.workers.wait_for_complete()
        app.go_to(step)
        await app.workers.wait_for_complete()
        await pilot.pause()
        if keys:
            await pilot.press(*keys)
        for _ in range(3):
            await pilot.pause()
            await app.workers.wait_for_complete()
        app.save_screenshot(os.path.basename(out), path=os.path.dirname(out))


def write_screenshots(directory: str, trace: str, compare: Optional[str], shots=SHOTS) -> list[str]:
    """``shots`` ((file name, keys, step), ...) of ``trace`` (``compare`` beside it in the compare view) as SVG
    files in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    written = []
    for name, keys, step in shots:
        app = TraceApp(trace, compare=compare, opener=stable_opener)
        out = os.path.join(directory, name)
        asyncio.run(_shoot(app, keys, step, out))
        written.append(out)
    return written
