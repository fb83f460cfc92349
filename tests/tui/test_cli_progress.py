"""The progress line of `kdtree record` (kdtree_tui/progress.py), driven with a fake terminal stream: what a
terminal would show (a small emulator of carriage return, erase-to-end and newline), no rate before it means
something, the step count of the final summary, and a line for each long phase (model load, golden)."""
from __future__ import annotations

import io
import re
import threading
import time

import pytest

from kdspec.engine.decode.config import DecodeConfig
from kdspec.kdtree_tui import cli
from kdspec.kdtree_tui.progress import Progress
from kdspec.traces import open_trace


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def screen(raw: str) -> list[str]:
    """The lines a terminal shows for ``raw``: printable characters overwrite at the cursor, "\\r" goes to the
    line's start, ESC [ K erases from the cursor to the end of the line, "\\n" starts a new line."""
    lines, line, col = [], [], 0
    for token in re.findall(r"\x1b\[K|\r|\n|[^\x1b\r\n]", raw):
        if token == "\r":
            col = 0
        elif token == "\n":
            lines.append("".join(line))
            line, col = [], 0
        elif token == "\x1b[K":
            del line[col:]
        else:
            line[col:col + 1] = [token]
            col += 1
    return lines + ["".join(line)]


def test_a_shorter_line_leaves_nothing_behind():
    stream, clock = FakeTTY(), Clock()
    bar = Progress(stream, clock=clock)
    bar.start(10_000, done=1)
    for _ in range(3):
        bar.step(1000)
    clock.now += 1.0  # 3001 tokens in 1 s: "3001.0 tok/s"
    bar.step(1000)
    assert screen(stream.getvalue())[-1].endswith("4001.0 tok/s")
    clock.now += 99.0  # 5001 tokens in 100 s: a shorter rate ("50.0 tok/s") over the longer one
    bar.step(1000)
    shown = screen(stream.getvalue())[-1]
    assert shown == bar.line() and shown.endswith(", 50.0 tok/s")


def test_no_rate_before_a_second_and_three_steps():
    stream, clock = FakeTTY(), Clock()
    bar = Progress(stream, clock=clock)
    bar.start(24, done=1)
    clock.now += 0.001
    bar.step(8)  # the first step right after the prefill: no absurd 9000 tok/s
    assert "tok/s" not in screen(stream.getvalue())[-1]
    clock.now += 5.0
    bar.step(8)  # long enough, but two steps only
    assert "tok/s" not in screen(stream.getvalue())[-1]
    bar.step(8)
    assert screen(stream.getvalue())[-1] == (f"[{'#' * 30}] 24/24 tokens, 3 steps, {24 / 5.001:.1f} tok/s")


def test_a_phase_spins_then_says_how_long_it_took():
    stream, clock = FakeTTY(), Clock()
    bar = Progress(stream, clock=clock, spin_seconds=0.005)
    with bar.phase("computing the golden (cpu, float64)"):
        deadline = time.monotonic() + 5
        while stream.getvalue().count("computing") < 4 and time.monotonic() < deadline:
            time.sleep(0.005)  # the spinner redraws while the phase's work runs
        clock.now += 2.5
    raw = stream.getvalue()
    assert {"| computing", "/ computing"} <= set(re.findall(r"[|/\\-] computing", raw))
    assert screen(raw) == ["computing the golden (cpu, float64): done in 2.5 s", ""]
    assert not [t for t in threading.enumerate() if t.name == "kdtree-progress"]


def test_a_failed_phase_is_erased():
    stream = FakeTTY()
    with pytest.raises(KeyboardInterrupt), Progress(stream, spin_seconds=10).phase("loading k2-mini"):
        raise KeyboardInterrupt
    assert screen(stream.getvalue()) == [""]


def test_without_a_terminal_nothing_is_written():
    bar = Progress(None)
    with bar.phase("loading tiny"):
        pass
    bar.start(4, done=1)
    bar.step(3)
    bar.close()  # nothing to write to, nothing raised


def test_record_on_a_terminal_shows_the_phases_and_the_summary_step_count(tmp_path):
    stream, out = FakeTTY(), tmp_path / "p.h5"
    config = DecodeConfig(40, mode="ddtree", drafter="noisy:0.5", seed=1)
    summary = cli.record_trace("tiny", str(out), [1, 2, 3], config, backend="reference", progress=stream)
    lines = screen(stream.getvalue())
    assert re.fullmatch(r"loading tiny \(reference backend\): done in \d+\.\d s", lines[0])
    assert re.fullmatch(r"computing the golden \(cpu, float64\): done in \d+\.\d s", lines[1])
    with open_trace(out) as reader:
        steps = reader.num_steps
    assert summary["steps"] == steps > 5 and summary["tokens"] == 40
    assert re.fullmatch(rf"\[#{{30}}\] 40/40 tokens, {steps} steps(, [\d.]+ tok/s)?", lines[2])
    assert lines[3:] == [""]


def test_the_command_writes_progress_only_to_a_terminal(tmp_path, capsys, monkeypatch):
    args = ["record", "--backend", "reference", "--max-new-tokens", "8"]
    assert cli.main([*args, "--out", str(tmp_path / "a.h5")]) == 0
    assert capsys.readouterr().err == ""  # stderr is captured: not a terminal
    terminal = FakeTTY()
    monkeypatch.setattr("sys.stderr", terminal)
    assert cli.main([*args, "--out", str(tmp_path / "b.h5")]) == 0
    assert "computing the golden (cpu, float64): done in" in screen(terminal.getvalue())[1]
