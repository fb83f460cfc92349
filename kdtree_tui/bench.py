"""`kdtree bench tui`: the trace debugger on a 100k-step synthetic trace: first paint, per-key latency, memory.

``run(args, write_trace=...) -> rows`` writes (or reuses, in the temp dir) a synthetic trace with
``write_trace(path, steps, force=True)`` (the command line passes engine.bench.synthetic.write_synthetic_trace:
the app never imports the engine), then runs the app headless (Textual's test driver) in a fresh subprocess,
so the numbers include Python's start, the imports and nothing left over from the parent:

- first paint: launch of the subprocess to the first frame the app composes (status line, step list rows
  as placeholders); also from opening the trace (TraceApp()) to that frame, and to the first frame that
  shows step 0's record and the first screen's step rows;
- per key: from the key event reaching the app to the first composed frame that shows the new step's
  record (tree / logits / cache panels), over ~100 presses (j, PgDn, k, n) once the columns are read;
- peak resident memory of the subprocess (its own: ``peak_resident_mb``) after the keys, the run view and a text
  search.

A composed frame is also rendered to the terminal's escape sequences (what a real terminal is sent), so
that cost is included. Targets (the issue): first paint < 1 s, < 50 ms per key, < 300 MB resident.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

SUITE = "tui"
STEPS = 100_000
QUICK_STEPS = 2_000
# Key presses measured, in order: from step 0 down 40, 20 pages of 10 down, 20 up, then 20 anomalies on.
KEYS = ("j",) * 40 + ("pagedown",) * 20 + ("k",) * 20 + ("n",) * 20
SIZE = (120, 40)
FIRST_PAINT_S, KEY_MS, RSS_MB = 1.0, 50.0, 300.0
TRACE_VERSION = 2  # bump when engine.bench.synthetic changes what it writes: old cached traces are ignored
CHILD_TIMEOUT_S = 600


def run(args=None, *, quick: Optional[bool] = None, steps: Optional[int] = None,
        write_trace: Optional[Callable[..., str]] = None, trace: Optional[str] = None) -> list[dict]:
    """Measure the app; returns result rows (suite, metric, value, unit, target, ok, ...).

    args: an argparse namespace (its ``quick`` / ``steps`` / ``trace`` attributes are used when present) or None.
    quick: a 2000-step trace (CI smoke run; the targets still apply but mean little).
    write_trace: writes the synthetic trace (``synthetic_trace``); trace: an existing trace to measure instead.
    """
    from kdspec.traces.reader import open_trace

    quick = bool(getattr(args, "quick", False)) if quick is None else quick
    trace = trace or getattr(args, "trace", None)
    if trace is None:
        if write_trace is None:
            raise ValueError("the TUI bench needs a trace: run `kdtree bench tui` (it writes a synthetic one) "
                             "or pass --trace PATH")
        steps = steps or getattr(args, "steps", None) or (QUICK_STEPS if quick else STEPS)
        trace = synthetic_trace(int(steps), write_trace)
    with open_trace(trace) as reader:
        steps = reader.num_steps
    return result_rows(measure_in_subprocess(trace), steps)


def synthetic_trace(steps: int, write_trace: Callable[..., str], directory: Optional[str] = None) -> str:
    """The path of a complete ``steps``-step synthetic trace in ``directory`` (default: the temp dir),
    written now by ``write_trace(path, steps, force=True)`` unless an earlier run left one there (about a
    millisecond per step)."""
    from kdspec.traces.reader import open_trace
    from kdspec.traces.schema import TraceError

    directory = directory or os.path.join(tempfile.gettempdir(), "kdtree-bench")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"tui-synthetic-{steps}-v{TRACE_VERSION}.h5")
    if os.path.exists(path):
        try:
            with open_trace(path) as reader:
                if reader.is_complete and reader.num_steps == steps:
                    return path
        except TraceError:
            pass
    _progress(f"writing a {steps}-step synthetic trace to {path} ...")
    partial = f"{path}.{os.getpid()}.partial"
    start = time.perf_counter()
    write_trace(partial, steps, force=True)
    os.replace(partial, path)  # never leave a half-written trace under the reused name
    _progress(f"wrote it in {time.perf_counter() - start:.0f} s")
    return path


def measure_in_subprocess(path: str, keys: tuple = KEYS) -> dict:
    """Run the measurement in a fresh Python; returns its result dict (times in s, plus 'launch_to_*')."""
    command = [sys.executable, "-m", "kdspec.kdtree_tui.bench", "--child", path, "--keys", ",".join(keys)]
    launched = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"bench child failed (exit {done.returncode}): {error}")
    result = json.loads(lines[-1])
    result["launch_to_first_paint_s"] = result.pop("first_paint_at") - launched
    return result


def result_rows(r: dict, steps: int) -> list[dict]:
    """The suite's rows from a child's result dict."""
    keys = r["key_ms"]
    note = f"{steps} steps, {SIZE[0]}x{SIZE[1]}, headless"
    rows = [
        _row("first paint (launch to first frame)", r["launch_to_first_paint_s"], "s", f"< {FIRST_PAINT_S:g} s",
             r["launch_to_first_paint_s"] < FIRST_PAINT_S, note + ", incl. Python start and imports"),
        _row("first paint (open to first frame)", r["open_to_first_paint_s"], "s", None, None,
             f"imports took {r['imports_s']:.2f} s"),
        _row("first screen filled (open to step 0 + rows drawn)", r["open_to_first_screen_s"], "s", None, None,
             "step 0's record and the visible step list rows"),
        _row("all columns read (open to last)", r["open_to_columns_s"], "s", None, None,
             "step list, flags, stage times; in a worker"),
        _row("key press to new step drawn, median", _median(keys), "ms", f"< {KEY_MS:g} ms", _median(keys) < KEY_MS,
             f"{len(keys)} presses: j, PgDn, k, n"),
        _row("key press to new step drawn, p95", _percentile(keys, 95), "ms", f"< {KEY_MS:g} ms",
             _percentile(keys, 95) < KEY_MS, f"max {max(keys):.1f} ms"),
        _row("peak resident memory", r["max_rss_mb"], "MB", f"< {RSS_MB:g} MB", r["max_rss_mb"] < RSS_MB,
             "the app process's own peak (VmHWM), after keys, run view, search"),
    ]
    return rows


def _row(metric: str, value, unit: str, target: Optional[str], ok: Optional[bool], note: str = "") -> dict:
    """A row in kdtree bench's format (the keys of kdspec.engine.bench.common.ROW_KEYS; no peer for this suite)."""
    return dict(suite=SUITE, metric=metric, value=float(value), unit=unit, peer=None, peer_value=None, ratio=None,
                target=target, ok=None if ok is None else bool(ok), note=note)


def _median(values: list[float]) -> float:
    return _percentile(values, 50)


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: a value that was measured)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n q / 100)
    return float(ordered[int(rank) - 1])


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ the child
def _record_frames(app, compositor_update) -> tuple:
    """Wrap the app's ``_display`` so each composed frame is rendered to escape sequences (what a terminal
    would be sent) and recorded; the frames, (perf_counter, index of the record shown or -1, steps with
    columns read) each, and the event that each new frame sets."""
    import asyncio

    frames = []
    frame_seen = asyncio.Event()
    display = app._display

    def timed_display(screen, renderable) -> None:
        display(screen, renderable)
        if renderable is None:
            return
        if isinstance(renderable, compositor_update):
            renderable.render_segments(app.console)  # what a terminal would be sent
        record = app.record
        frames.append((time.perf_counter(), -1 if record is None else record.index, app.session.rows))
        frame_seen.set()

    app._display = timed_display
    return frames, frame_seen


async def _first_screen(app, pilot, frames: list, opened: float) -> dict:
    """Wait for the first frame, the first screen (step 0 and the visible step rows), then every column."""
    result = {}
    while not frames:
        await pilot.pause(0.001)
    result["first_paint_at"] = time.time() - (time.perf_counter() - frames[0][0])
    result["open_to_first_paint_s"] = frames[0][0] - opened
    visible = SIZE[1]
    while not any(index == 0 and rows >= min(visible, app.session.num_steps) for _, index, rows in frames):
        await pilot.pause(0.005)
    result["open_to_first_screen_s"] = next(t for t, index, rows in frames
                                            if index == 0 and rows >= min(visible, app.session.num_steps)) - opened
    while not app.session.loaded:
        await pilot.pause(0.01)
    result["open_to_columns_s"] = time.perf_counter() - opened
    return result


async def _key_latencies(app, frames: list, frame_seen, keys: tuple, key_event) -> list[float]:
    """Per key: ms from posting ``key_event`` to the first frame that shows the new cursor's record."""
    import asyncio

    latencies = []
    for key in keys:
        before = app.record
        frame_seen.clear()
        start = time.perf_counter()
        app.post_message(key_event(key, key if len(key) == 1 else None))
        while True:
            await asyncio.wait_for(frame_seen.wait(), timeout=10)
            frame_seen.clear()
            record = app.record
            if record is not before and record is not None and record.index == app.cursor:
                break
        latencies.append(1e3 * (frames[-1][0] - start))
        await app.workers.wait_for_complete()
    return latencies


async def _measure(path: str, keys: tuple) -> dict:
    imported = time.time()
    from textual import events
    from textual._compositor import CompositorUpdate

    from kdspec.kdtree_tui.app import TraceApp
    imports_s = time.time() - imported

    opened = time.perf_counter()
    app = TraceApp(path)
    frames, frame_seen = _record_frames(app, CompositorUpdate)
    result: dict = {"imports_s": imports_s}
    async with app.run_test(size=SIZE) as pilot:
        result.update(await _first_screen(app, pilot, frames, opened))
        await app.workers.wait_for_complete()
        await pilot.pause()
        result["key_ms"] = await _key_latencies(app, frames, frame_seen, keys, events.Key)
        result["end_step"] = app.cursor
        await pilot.press("4")          # the run view: stats over every step, output text
        await app.workers.wait_for_complete()
        await pilot.pause()
        await pilot.press("1")
        app.session.search("lazy dog")  # builds the text index over every step
        result["num_steps"] = app.session.num_steps
    result["max_rss_mb"] = peak_resident_mb()
    return result


def peak_resident_mb() -> float:
    """This process's own peak resident memory, MB: Linux's VmHWM (the high-water mark of this process's memory
    since its exec). ru_maxrss is the fallback elsewhere, but on Linux it also carries the parent's peak across
    fork + exec: a child of a bench run that had loaded the engine's suites read ~560 MB for a 2000-step trace."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(argv: list[str]) -> int:
    import argparse
    import asyncio

    parser = argparse.ArgumentParser(prog="python -m kdspec.kdtree_tui.bench")
    parser.add_argument("--child", metavar="TRACE", required=True)
    parser.add_argument("--keys", default=",".join(KEYS))
    args = parser.parse_args(argv)
    result = asyncio.run(_measure(args.child, tuple(args.keys.split(","))))
    print(json.dumps(result))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m kdspec.kdtree_tui.bench --trace PATH` prints the rows for a trace (`kdtree bench tui` writes
    the synthetic one); `--child TRACE` measures."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        return _child(argv)
    parser = argparse.ArgumentParser(prog="python -m kdspec.kdtree_tui.bench")
    parser.add_argument("--trace", required=True, help="the trace to measure the debugger on")
    args = parser.parse_args(argv)
    rows = run(args)
    for r in rows:
        flag = "" if r["ok"] is None else ("ok" if r["ok"] else "MISSED")
        print(f"{r['metric']:<52} {r['value']:>9.3f} {r['unit']:<3} {r['target'] or '':<10} {flag:<6} {r['note']}")
    return 1 if any(r["ok"] is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
