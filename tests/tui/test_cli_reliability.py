"""The `kdtree` command line under hostile conditions (issue 21): closed pipes, bad flags, damaged inputs.

Most cases call ``cli.main`` in-process (capsys); a few that need a real process (a closed pipe, signals) run
``python -m kdspec.kdtree_tui``.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kdspec.kdtree_tui import cli
from kdspec.traces import open_trace

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}


def kdtree_to_closed_pipe(*args, timeout=60):
    """Run `kdtree ARGS` with stdout a pipe whose read end is already closed (as `| head` leaves it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "kdspec.kdtree_tui", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env=ENV, cwd=ROOT, timeout=timeout)
    finally:
        os.close(write_end)


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("reliability") / "tiny.h5"
    assert cli.main(["record", "--backend", "reference", "--max-new-tokens", "12", "--out", str(out)]) == 0
    return out


def test_a_closed_stdout_pipe_exits_quietly(small_trace):
    """`kdtree info --json T | head`, `kdtree config tiny | head`: no BrokenPipeError traceback, nothing on stderr."""
    for args in (["info", "--json", str(small_trace)], ["config", "tiny"], ["check", str(small_trace)], ["--help"]):
        result = kdtree_to_closed_pipe(*args)
        assert result.stderr == "", (args, result.stderr)
        # argparse itself ignores a failed write of --help (exit 0)
        assert result.returncode == (0 if args == ["--help"] else cli.BROKEN_PIPE_EXIT), (args, result.returncode)


# The child records through cli.main with each step's write slowed down and reported on stdout, so the test
# can signal it in the middle of the run.
SLOW_RECORD = """
import sys, time
from kdspec.kdtree_tui import cli
from kdspec.traces import open_trace
from kdspec.traces.writer import TraceWriter
write = TraceWriter.write_step
def slow_write(self, record):
    write(self, record)
    print(self.num_steps, flush=True)
    time.sleep(0.05)
TraceWriter.write_step = slow_write
sys.exit(cli.main(sys.argv[1:]))
"""


def _take_ctrl_c():
    """The child takes SIGINT as a terminal's foreground process does. Started under a pytest that inherited SIGINT
    ignored (a shell's background job), the child ignored it too and ran all 200 steps (reproduced with `nohup pytest
    -n 2 ... &` in CI's virtual environment)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_leave_an_interrupted_trace_with_every_step(tmp_path, signum, code):
    out = tmp_path / "killed.h5"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RECORD, "record", "--backend", "reference", "--mode", "ar",
                             "--max-new-tokens", "200", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT, preexec_fn=_take_ctrl_c)
    try:
        written = 0
        while written < 5:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            written = int(line)
        sent_at = written
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    written = max([written] + [int(x) for x in stdout.split() if x.isdigit()])
    assert proc.returncode == code, (stderr, f"signalled after step {sent_at}, the child reached step {written}")
    assert stderr.strip() == "kdtree record: interrupted" and "Traceback" not in stderr
    with open_trace(out) as reader:
        assert reader.metadata["status"] == "interrupted"
        assert reader.num_steps == written and len(reader.metadata["end_time"]) == 32


# -- defect 4 -----------------------------------------------------------------------------------------------
def test_demo_does_not_overwrite_without_force(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_select_backend", lambda name: "reference")  # the simulator is slow here
    existing = tmp_path / "demo.h5"
    existing.write_bytes(b"keep me")
    assert cli.main(["demo", "--out", str(existing), "--no-tui", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert existing.read_bytes() == b"keep me"
    assert cli.main(["demo", "--out", str(existing), "--no-tui", "--max-new-tokens", "4", "--force"]) == 0
    with open_trace(existing) as reader:
        assert reader.is_complete


# -- defect 3 -----------------------------------------------------------------------------------------------
def test_a_second_record_to_the_same_path_is_refused_while_the_first_runs(tmp_path, capsys):
    out = tmp_path / "busy.h5"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RECORD, "record", "--backend", "reference", "--mode", "ar",
                             "--max-new-tokens", "40", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "1", proc.stderr.read()
        code = cli.main(["record", "--backend", "reference", "--out", str(out), "--force"])
        err = capsys.readouterr().err
        assert code == 2 and "another recording" in err and len(err.strip().splitlines()) == 1, err
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0
    with open_trace(out) as reader:   # the first run's trace, whole
        assert reader.is_complete and reader.metadata["mode"] == "ar" and len(reader.output_tokens) == 40


# -- defect 2 -----------------------------------------------------------------------------------------------
def test_a_failed_record_with_force_keeps_the_old_trace(small_trace, tmp_path, capsys, monkeypatch):
    out = tmp_path / "old.h5"
    out.write_bytes(small_trace.read_bytes())
    before = out.read_bytes()
    for flags in (["--block-size", "1"], ["--seed", str(2 ** 64)], ["--prompt-ids", "1,2,3000"]):
        code = cli.main(["record", "--backend", "reference", "--out", str(out), "--force", *flags])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, (flags, err)
        assert out.read_bytes() == before, flags
    from kdspec.traces import TraceError
    from kdspec.traces.writer import TraceWriter

    def failing_write(self, record):
        raise TraceError(f"{self.path}: writing step 0 failed (disk full)")
    monkeypatch.setattr(TraceWriter, "write_step", failing_write)
    code = cli.main(["record", "--backend", "reference", "--out", str(out), "--force"])
    assert code == 2 and "disk full" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.h5"]


FIRST_STEP_LATER = """
import sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]   # tests/traces and tests/ (killed_traces.py)
from test_traces import make_run
from test_reliability import new_writer
records, output, golden = make_run(1, 2, 8, 7, 7)
with new_writer(sys.argv[1], force=True) as writer:
    print("open", flush=True)
    sys.stdin.readline()
    writer.write_step(records[0])
    print("step", flush=True)
    sys.stdin.readline()
"""


def test_follow_waits_for_a_recordings_first_step(small_trace, tmp_path, capsys):
    import threading
    import time
    out = tmp_path / "live.h5"
    out.write_bytes(small_trace.read_bytes())   # an old trace there: the follower must not open it
    proc = subprocess.Popen([sys.executable, "-c", FIRST_STEP_LATER, str(out), str(ROOT / "tests" / "traces"),
                             str(ROOT / "tests")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        first_line = proc.stdout.readline().strip()
        assert first_line == "open", proc.communicate(timeout=30)
        waiter = threading.Thread(target=cli.wait_for_first_step, args=(str(out), 0.05))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "step"
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        with open_trace(out) as reader:   # the new recording, live
            assert reader.metadata["status"] == "recording" and reader.num_steps == 1
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert "waiting for the recording" in capsys.readouterr().err


# -- defect 6 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_run_of_non_finite_weights_does_not_check_ok(tmp_path, capsys, value):
    from kdspec.engine.model.checkpoint import load_model, save_model
    cfg, weights = load_model("tiny")
    save_model(tmp_path / "model", cfg, {k: np.full(v.shape, value, np.float32) for k, v in weights.items()})
    out = tmp_path / "t.h5"
    with np.errstate(all="ignore"):
        assert cli.main(["record", "--model", str(tmp_path / "model"), "--backend", "reference",
                         "--max-new-tokens", "8", "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["check", str(out)]) == 1
    assert "not finite" in capsys.readouterr().out
    with open_trace(out) as reader:
        assert np.isnan(reader.column("cache_max_abs_diff")).all()


# -- defect 5 -----------------------------------------------------------------------------------------------
def test_check_agrees_with_record_when_the_last_step_reaches_max_position_embeddings(tmp_path, capsys):
    """tiny (256 positions), prompt "The tree" (8): the last step's bonus lands past the golden's reach."""
    out = tmp_path / "t.h5"
    assert cli.main(["record", "--backend", "reference", "--max-new-tokens", "245", "--out", str(out)]) == 0
    assert "equal to the golden" in capsys.readouterr().out
    assert cli.main(["check", str(out)]) == 0, capsys.readouterr()
    assert cli.main(["info", str(out)]) == 0
    assert "tokens equal" in capsys.readouterr().out


# -- defect 9: one line, exit 2, for every bad input ----------------------------------------------------------
def one_line_exit_2(capsys, argv):
    code = cli.main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err, (argv, code, captured.err)
    return lines[0]


def bad_model_dir(tmp_path, kind):
    """A model directory damaged one way (config.json nested deep, quantization_config a string, ...)."""
    import json
    from kdspec.engine.model.checkpoint import load_model, save_model
    directory = tmp_path / kind
    cfg, weights = load_model("tiny")
    save_model(directory, cfg, weights)
    config = json.loads((directory / "config.json").read_text())
    if kind == "deep config":
        (directory / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    elif kind == "deep list config":
        (directory / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "quantization string":
        (directory / "config.json").write_text(json.dumps({**config, "quantization_config": "fp8"}))
    elif kind == "text_config string":
        (directory / "config.json").write_text(json.dumps({**config, "quantization_config": None, "text_config": 3}))
    elif kind == "safetensors directory":
        (directory / "model.safetensors").unlink()
        (directory / "model.safetensors").mkdir()
    elif kind == "deep index":
        (directory / "model.safetensors.index.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    return directory


@pytest.mark.parametrize("kind", ["deep config", "deep list config", "quantization string", "text_config string",
                                  "safetensors directory", "deep index"])
def test_a_damaged_model_directory_is_one_line(tmp_path, capsys, kind):
    directory = bad_model_dir(tmp_path, kind)
    one_line_exit_2(capsys, ["record", "--model", str(directory), "--backend", "reference",
                             "--out", str(tmp_path / "t.h5")])
    assert not (tmp_path / "t.h5").exists()
    if "config" in kind:
        one_line_exit_2(capsys, ["config", str(directory)])


@pytest.mark.parametrize("flags", [["--budget", "1e8"], ["--budget", "100000000"], ["--block-size", "1e9"],
                                   ["--block-size", "1000000000"], ["--prompt-ids", "9223372036854775808"],
                                   ["--prompt-ids", "1,x"], ["--prompt", "caf\udce9 \udcff"],
                                   ["--max-new-tokens", "99999999999999999999"], ["--seed", "-1"],
                                   ["--temperature", "nan"], ["--drafter", "noisy:2"], ["--topk", "100000"],
                                   ["--out", "/dev/null", "--force"], ["--out", "/no/such/dir/t.h5"]])
def test_bad_record_flags_are_one_line(tmp_path, capsys, flags):
    argv = ["record", "--backend", "reference", *flags]
    if "--out" not in flags:
        argv += ["--out", str(tmp_path / "t.h5")]
    one_line_exit_2(capsys, argv)
    assert not os.path.exists("/dev/null.lock") and not (tmp_path / "t.h5").exists()


def test_running_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch):
    from kdspec.engine.golden.model import ReferenceModel

    def no_memory(*args, **kwargs):
        raise MemoryError()
    monkeypatch.setattr(ReferenceModel, "forward", no_memory)
    line = one_line_exit_2(capsys, ["record", "--backend", "reference", "--out", str(tmp_path / "t.h5")])
    assert "memory" in line and not (tmp_path / "t.h5").exists()


def test_argparse_errors_are_one_line(capsys):
    for argv in (["record", "--mode", "beam", "--out", "x"], ["record"], ["nosuchcommand"], ["info"],
                 ["tui", "a", "b", "c"]):
        line = one_line_exit_2(capsys, argv)
        assert line.startswith("kdtree"), line


def damaged_traces(source, directory):
    """(name, path) of copies of ``source`` missing one attribute, with one of the wrong type, or with a dataset
    of the wrong shape."""
    import shutil
    import h5py
    with h5py.File(source, "r") as f:
        attributes, datasets = list(f.attrs), list(f)
    edits = []
    for name in attributes:
        edits.append((f"no {name}", lambda f, name=name: f.attrs.__delitem__(name)))
        edits.append((f"{name} a list", lambda f, name=name: f.attrs.__setitem__(name, [1, 2])))
        edits.append((f"{name} text", lambda f, name=name: f.attrs.__setitem__(name, "[1, 2]")))
    for name in datasets:
        def two_d(f, name=name):
            data = f[name][...]
            del f[name]
            f[name] = np.stack([data, data])
        def scalar(f, name=name):
            del f[name]
            f[name] = np.int32(3)
        edits += [(f"{name} 2-D", two_d), (f"{name} scalar", scalar), (f"no {name}", lambda f, n=name: f.__delitem__(n))]
    for label, edit in edits:
        path = directory / (label.replace(" ", "_").replace(",", "") + ".h5")
        shutil.copy(source, path)
        with h5py.File(path, "r+") as f:
            edit(f)
        yield label, path


def test_traces_missing_an_attribute_or_with_a_wrong_shaped_dataset_are_one_line(small_trace, tmp_path, capsys):
    from kdspec.kdtree_tui.session import TraceSession
    from kdspec.traces import TraceError
    for label, path in damaged_traces(small_trace, tmp_path):
        for argv in (["info", str(path)], ["info", "--json", str(path)], ["check", str(path)]):
            code = cli.main(argv)
            captured = capsys.readouterr()
            assert code in (0, 1, 2) and len(captured.err.strip().splitlines()) <= 1, (label, argv, captured.err)
            if label.startswith("no ") and label[3:] in ("mode", "status", "seed", "backend", "device", "start_time",
                                                          "end_time", "steps", "prompt_tokens"):
                assert code == 2, (label, argv)
        try:
            session = TraceSession(path)
        except TraceError:
            continue
        try:
            session.install(session.read_columns())
            for i in range(session.num_steps):
                session.step(i)
        except TraceError:
            pass
        finally:
            session.close()


# -- --version, and every default in --help -------------------------------------------------------------------
def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("kdtree ")


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_help_states_every_options_default():
    for parser in _parsers(cli.build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue   # positionals, --help, --version
            text = parser._get_formatter()._format_action(action)
            assert "default" in text or "required" in text, (parser.prog, action.option_strings, text)
