"""Measure the app on a (big) trace: first paint, column load, per-key latency, resident memory.

`python -m kdtree_tui.bench TRACE` (headless, Textual's test driver); targets: first paint < 1 s,
< 50 ms per step key press, < 300 MB resident.
"""
from __future__ import annotations

import asyncio
import resource
import sys
import time

from textual import events

from .app import TraceApp


async def _measure(path: str, presses: int) -> dict:
    start = time.perf_counter()
    app = TraceApp(path)
    result = {}
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        result["first_paint_s"] = time.perf_counter() - start
        while not app.session.loaded:
            await pilot.pause(0.01)
        await app.workers.wait_for_complete()
        result["columns_loaded_s"] = time.perf_counter() - start
        await pilot.pause()
        # Per key: from the key event reaching the app to the new step's record drawn in the panels,
        # plus composing one full-screen update (an upper bound on a terminal refresh). Pilot's
        # press() is not used for timing: it waits for the whole process to go idle.
        latencies, renders = [], []
        for key in ("j",) * presses + ("n",) * 10 + ("end", "home", "pagedown"):
            before = app.record
            t = time.perf_counter()
            app.post_message(events.Key(key, key if len(key) == 1 else None))
            while app.record is before:
                await asyncio.sleep(0.0005)
            loaded = time.perf_counter() - t
            t = time.perf_counter()
            app.screen._compositor.render_update(full=True)  # what a terminal refresh composes
            renders.append(time.perf_counter() - t)
            latencies.append(loaded + renders[-1])
        loads = [a - b for a, b in zip(latencies, renders)]
        for name, values in (("key", latencies), ("load", loads), ("render", renders)):
            values = sorted(values)
            result[f"{name}_ms_median"] = 1e3 * values[len(values) // 2]
            result[f"{name}_ms_max"] = 1e3 * values[-1]
        result["num_steps"] = app.session.num_steps
    result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def measure(path: str, presses: int = 50) -> dict:
    return asyncio.run(_measure(path, presses))


if __name__ == "__main__":
    for key, value in measure(sys.argv[1]).items():
        print(f"{key:>18} {value:.3f}" if isinstance(value, float) else f"{key:>18} {value}")
