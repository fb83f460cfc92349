"""A full disk (issue 21, defect 1): every stage of a recording fails with a one-line TraceError, never a
RuntimeError or a crash, never a "complete" status on a trace whose finish failed, and the old trace stays
when the recording had no step yet.

The disk tests mount a small tmpfs (root only; skipped with the reason elsewhere) and run the writer in a child
process, since HDF5 could crash (exit 139) on a nearly full disk. The HDF5-failure tests below them need no
mount: they make h5py raise HDF5's RuntimeError at each stage.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from kdspec.traces import TraceError, open_trace

HERE = Path(__file__).resolve().parent

# The child: fills the disk to leave ``free`` bytes, records ``steps`` steps (``vocab`` logits each, random:
# incompressible) to DIR/t.h5, finishes with ``output`` tokens, and prints what happened as JSON.
CHILD = """
import json, os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_traces import MODEL_CONFIG, decode_config, make_run
from kdspec.traces import RunMetadata, TraceError, TraceWriter
directory, cases = sys.argv[2], json.loads(sys.argv[3])
results = []
for case in cases:
    path = os.path.join(directory, "t.h5")
    with open(os.path.join(directory, "filler"), "wb"):
        pass
    stat = os.statvfs(directory)
    with open(os.path.join(directory, "filler"), "wb") as f:
        f.write(b"\\0" * max(0, stat.f_bavail * stat.f_frsize - case["free"]))
    vocab = case.get("vocab", 0)
    records, output, golden = make_run(1, case["steps"], 8, 7, 7, vocab=max(vocab, 64), logits=bool(vocab))
    if vocab:
        rng = np.random.default_rng(0)
        for r in records:
            r["logits"] = rng.standard_normal(r["logits"].shape).astype(np.float32)
    output = output + [1] * case.get("output", 0)
    run = RunMetadata(decode_config(8, 7, 7), {**MODEL_CONFIG, "vocab_size": max(vocab, 64)}, "reference", "cpu",
                      [1, 2, 3, 4, 5], tokenizer="bpe" if case.get("vocabulary") else "byte",
                      vocabulary=[bytes(case["vocabulary"])] * 64 if case.get("vocabulary") else None)
    stage, error, written = "create", None, 0
    try:
        writer = TraceWriter(path, run, save_logits=bool(vocab), force=True)
        try:
            for record in records:
                stage = "step"
                writer.write_step(record)
                written += 1
            stage = "finish"
            writer.finish(output, golden)
            stage = "done"
        except TraceError:
            writer.close("failed")
            raise
    except TraceError as e:
        error = str(e)
    old = open(path, "rb").read() if os.path.exists(path) else None
    results.append(dict(case, stage=stage, error=error, written=written, old_kept=old == b"the old trace",
                        files=sorted(f for f in os.listdir(directory) if f != "filler")))
    os.unlink(os.path.join(directory, "filler"))
    if case.get("keep"):
        os.replace(path, os.path.join(directory, case["keep"]))
    elif os.path.exists(path) and not case.get("old"):
        os.unlink(path)
print(json.dumps(results))
"""


@pytest.fixture
def small_disk():
    """mount(size): a fresh tmpfs of ``size`` bytes; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the full-disk tests run where CI is root)")
    mounted = []

    def mount(size: int) -> Path:
        directory = Path(tempfile.mkdtemp(prefix="kdtree-full-"))
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            directory.rmdir()
            pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode})")
        mounted.append(directory)
        return directory
    yield mount
    for directory in mounted:
        subprocess.run(["umount", str(directory)], capture_output=True)
        directory.rmdir()


def record_on(directory: Path, cases: list[dict]) -> list[dict]:
    result = subprocess.run([sys.executable, "-c", CHILD, str(HERE), str(directory), json.dumps(cases)],
                            capture_output=True, text=True, timeout=300, cwd=HERE.parents[1])
    assert result.returncode == 0, f"child exited {result.returncode}: {result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_a_64k_disk_fills_at_every_stage_without_a_crash(small_disk):
    """Free space from 64 KB down to nothing, 2 KB apart (HDF5 crashed with 6-24 KB free): always a one-line
    TraceError, never a crash; no temporary file is left."""
    directory = small_disk(64 * 1024)
    results = record_on(directory, [{"free": free, "steps": 20} for free in range(60 * 1024, -1, -2048)])
    for r in results:
        assert r["stage"] == "create" and "KB free" in r["error"] and "\n" not in r["error"], r
        assert r["files"] == [], r


def test_a_full_disk_at_each_stage_is_a_trace_error(small_disk):
    directory = small_disk(4 * 1024 * 1024)
    (directory / "t.h5").write_bytes(b"the old trace")
    cases = [
        dict(name="creation", free=100 * 1024, steps=3, old=True),
        dict(name="schema", free=1024 * 1024, steps=3, vocabulary=[7] * 20_000, old=True),   # 1.3 MB of vocab
        dict(name="first flush", free=900 * 1024, steps=3, vocab=250_000, old=True),          # >= 1 MB a step
        dict(name="mid-run", free=1500 * 1024, steps=40, vocab=12_000, keep="mid.h5"),        # 48 KB a token
        dict(name="finish", free=600 * 1024, steps=3, output=200_000, keep="finish.h5"),      # 800 KB output
    ]
    results = {r["name"]: r for r in record_on(directory, cases)}
    for name, r in results.items():
        assert r["error"] and "\n" not in r["error"] and "t.h5" in r["error"], r
        assert not [f for f in r["files"] if f.startswith(".") or f.endswith(".lock")], r
    assert results["creation"]["stage"] == "create" and results["schema"]["stage"] == "create"
    assert results["first flush"]["stage"] == "step" and results["first flush"]["written"] == 0
    for name in ("creation", "schema", "first flush"):   # no step: the old trace stays
        assert results[name]["old_kept"], name
    mid = results["mid-run"]
    assert mid["stage"] == "step" and 0 < mid["written"] < 40
    with open_trace(directory / "mid.h5") as reader:
        assert reader.num_steps == mid["written"] and reader.metadata["status"] == "failed"
    assert results["finish"]["stage"] == "finish"
    with open_trace(directory / "finish.h5") as reader:
        assert reader.metadata["status"] == "failed" and reader.num_steps == 3


# -- HDF5's RuntimeError at each stage, without a disk --------------------------------------------------------
def _writer(path, **kw):
    sys.path.insert(0, str(HERE))
    from test_reliability import new_writer
    return new_writer(path, **kw)


def _records(steps=2):
    sys.path.insert(0, str(HERE))
    from test_traces import make_run
    return make_run(1, steps, 8, 7, 7)


def _hdf5_error(*args, **kwargs):
    raise RuntimeError("Slist already enabled? (slist already enabled?)")


@pytest.mark.parametrize("target", ["File", "create_dataset"])
def test_hdf5_errors_while_creating_are_trace_errors(tmp_path, monkeypatch, target):
    monkeypatch.setattr(h5py.File if target == "File" else h5py.Group, "__init__" if target == "File" else target,
                        _hdf5_error)
    with pytest.raises(TraceError) as excinfo:
        _writer(tmp_path / "t.h5")
    assert "\n" not in str(excinfo.value)
    assert os.listdir(tmp_path) == []


def test_hdf5_errors_while_writing_a_step_are_trace_errors(tmp_path, monkeypatch):
    records, output, golden = _records()
    writer = _writer(tmp_path / "t.h5")
    writer.write_step(records[0])
    monkeypatch.setattr(h5py.File, "flush", _hdf5_error)
    with pytest.raises(TraceError, match="writing step 1"):
        writer.write_step(records[1])
    monkeypatch.undo()
    writer.close("failed")
    with open_trace(tmp_path / "t.h5") as reader:
        assert reader.metadata["status"] == "failed" and reader.num_steps >= 1


def test_a_finish_that_fails_never_says_complete(tmp_path, monkeypatch):
    records, output, golden = _records()
    writer = _writer(tmp_path / "t.h5")
    for record in records:
        writer.write_step(record)
    flushes = []

    def flush_then_fail(self):
        flushes.append(1)
        if len(flushes) == 2:    # the flush after status "complete"
            raise RuntimeError("file write failed")
        h5py.File.flush.__wrapped__(self) if hasattr(h5py.File.flush, "__wrapped__") else original(self)
    original = h5py.File.flush
    monkeypatch.setattr(h5py.File, "flush", flush_then_fail)
    with pytest.raises(TraceError, match="finishing"):
        writer.finish(output, golden)
    monkeypatch.undo()
    writer.close()
    with open_trace(tmp_path / "t.h5") as reader:
        assert reader.metadata["status"] == "failed"


def test_hdf5_errors_while_closing_are_trace_errors(tmp_path, monkeypatch):
    records, _, _ = _records(1)
    writer = _writer(tmp_path / "t.h5")
    writer.write_step(records[0])
    original = h5py.File.close
    monkeypatch.setattr(h5py.File, "close", _hdf5_error)
    with pytest.raises(TraceError, match="closing"):
        writer.close("failed")
    monkeypatch.undo()
    writer.close()   # already closed: nothing to do
    assert not (tmp_path / "t.h5.lock").exists()
    original(writer._steps.file) if writer._steps.id.valid else None
