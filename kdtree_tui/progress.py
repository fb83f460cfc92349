"""The progress line of `kdtree record` and `kdtree demo` on a terminal's stderr (kdtree_tui/cli.py drives it).

While a long phase runs (the model loading, the golden) a spinner line names it and counts its seconds; once it
ends the line says how long it took. Then a bar of tokens and steps follows the decode. Every redraw returns to
the start of the line and erases to its end, so a shorter line never leaves characters of a longer one behind.
Without a stream (stderr is not a terminal) nothing is written.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TextIO

ERASE_TO_END = "\x1b[K"   # ANSI "erase in line" from the cursor to its end
BAR_WIDTH = 30
# A rate over a short time is noise (the first step alone, right after the prefill, reads thousands of tok/s):
# the bar shows one once both of these have passed.
RATE_AFTER_SECONDS = 1.0
RATE_AFTER_STEPS = 3
SPIN_SECONDS = 0.1
FRAMES = "|/-\\"


class Progress:
    """Phases, then the decode's bar, on ``stream`` (None: silent). ``clock``: seconds (tests pass a fake)."""

    def __init__(self, stream: TextIO | None, clock: Callable[[], float] = time.perf_counter,
                 spin_seconds: float = SPIN_SECONDS):
        self.stream, self.clock, self.spin_seconds = stream, clock, spin_seconds
        self.total = self.done = self.steps = 0
        self.started: float | None = None
        self._lock = threading.Lock()

    def _draw(self, text: str, end: str = "") -> None:
        if self.stream is None:
            return
        with self._lock:
            self.stream.write("\r" + text + ERASE_TO_END + end)
            self.stream.flush()

    @contextlib.contextmanager
    def phase(self, label: str):
        """``with progress.phase("loading tiny"):`` a spinner and the seconds so far while the block runs, then
        "label: done in X s" on a line of its own; erased when the block fails (the error line follows)."""
        if self.stream is None:
            yield
            return
        started = self.clock()
        stop = threading.Event()

        def spin() -> None:
            frame = 0
            while not stop.wait(self.spin_seconds):
                frame += 1
                self._draw(f"{FRAMES[frame % len(FRAMES)]} {label}... {self.clock() - started:.0f} s")

        self._draw(f"{FRAMES[0]} {label}...")
        spinner = threading.Thread(target=spin, name="kdtree-progress", daemon=True)
        spinner.start()
        try:
            yield
        except BaseException:
            stop.set()
            spinner.join()
            self._draw("")
            raise
        stop.set()
        spinner.join()
        self._draw(f"{label}: done in {self.clock() - started:.1f} s", end="\n")

    def start(self, total: int, done: int = 0) -> None:
        """The decode begins: ``total`` tokens to produce, ``done`` of them already (the prefill's token)."""
        self.total, self.done, self.steps, self.started = total, min(total, done), 0, self.clock()
        self._draw(self.line())

    def step(self, committed: int) -> None:
        """One verify step committed ``committed`` tokens (counted up to the total, like the output)."""
        self.done, self.steps = min(self.total, self.done + committed), self.steps + 1
        self._draw(self.line())

    def line(self) -> str:
        """The bar: tokens done of the total, steps (as the final summary counts them) and, once it means
        something, the rate."""
        filled = BAR_WIDTH * self.done // max(1, self.total)
        text = (f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total} tokens, "
                f"{self.steps} steps")
        elapsed = 0.0 if self.started is None else self.clock() - self.started
        if elapsed >= RATE_AFTER_SECONDS and self.steps >= RATE_AFTER_STEPS:
            text += f", {self.done / elapsed:.1f} tok/s"
        return text

    def close(self) -> None:
        """The bar's last state, and the line ends (nothing when the decode never started)."""
        if self.started is not None:
            self._draw(self.line(), end="\n")
            self.started = None
