"""Trace reliability (issue 21): the writer and reader under misuse, damage, interruption and full disks."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from kdspec.traces import TraceError, TraceWriter, check, open_trace

from killed_traces import write_killed_trace
from test_traces import make_run, write_run

RUN = dict(block_size=8, budget=7, draft_topk=7)


def valid_trace(path, steps=4, seed=7, **kw):
    records, output, golden = make_run(seed, steps, 8, 7, 7)
    write_run(path, records, output, golden, **RUN, **kw)
    return path


def new_writer(path, **kw):
    from test_traces import MODEL_CONFIG, decode_config
    from kdspec.traces import RunMetadata
    run = RunMetadata(decode_config(8, 7, 7), MODEL_CONFIG, "reference", "cpu", [1, 2, 3, 4, 5])
    return TraceWriter(path, run, **kw)


# -- defect 13: the Python API ---------------------------------------------------------------------------
def test_a_closed_reader_raises_trace_errors(tmp_path):
    reader = open_trace(valid_trace(tmp_path / "t.h5"))
    reader.close()
    for call in (lambda: reader.step(0), lambda: reader.field("tree_tokens"), lambda: reader.column("tau"),
                 lambda: reader.fields(["tau"]), reader.summary, lambda: reader.output_tokens,
                 lambda: reader.golden_tokens, reader.vocabulary, reader.refresh, lambda: check(reader)):
        with pytest.raises(TraceError, match="closed"):
            call()


@pytest.mark.parametrize("name,value", [("root_token", 2 ** 31), ("bonus_token", -2 ** 31 - 1),
                                        ("prefix_len", 2 ** 63), ("tree_tokens", "big"), ("compact_src", "float")])
def test_out_of_range_ids_are_trace_errors(tmp_path, name, value):
    records, _, _ = make_run(1, 1, 8, 7, 7)
    record = dict(records[0])
    if value == "big":
        value = np.asarray(record[name], np.int64) + 2 ** 31
    elif value == "float":
        value = np.asarray(record[name], np.float64) + 0.5
    record[name] = value
    with new_writer(tmp_path / "t.h5") as writer:
        with pytest.raises(TraceError, match=name):
            writer.write_step(record)


def test_out_of_range_output_and_prompt_tokens_are_trace_errors(tmp_path):
    from test_traces import MODEL_CONFIG, decode_config
    from kdspec.traces import RunMetadata
    with pytest.raises(TraceError, match="prompt_tokens"):
        TraceWriter(tmp_path / "p.h5", RunMetadata(decode_config(8, 7, 7), MODEL_CONFIG, "r", "c", [2 ** 31]))
    records, output, golden = make_run(1, 2, 8, 7, 7)
    for bad in ([2 ** 31], np.array([2 ** 40]), [1.5]):
        with new_writer(tmp_path / "o.h5", force=True) as writer:
            for record in records:
                writer.write_step(record)
            with pytest.raises(TraceError, match="output_tokens"):
                writer.finish(bad, golden)


# -- defect 10: attributes finish() and close() change are stored at their full width --------------------
@pytest.mark.parametrize("how", ["finish", "interrupted", "failed", "exception"])
def test_status_and_end_time_are_stored_whole(tmp_path, how):
    records, output, golden = make_run(1, 3, 8, 7, 7)
    path = tmp_path / "t.h5"
    try:
        with new_writer(path) as writer:
            for record in records:
                writer.write_step(record)
            if how == "finish":
                writer.finish(output, golden)
            elif how == "exception":
                raise RuntimeError("boom")
            else:
                writer.close(how)
    except RuntimeError:
        pass
    with open_trace(path) as reader:
        status = {"finish": "complete", "exception": "interrupted"}.get(how, how)
        assert reader.metadata["status"] == status and reader.num_steps == 3
        end = reader.metadata["end_time"]
        assert end.startswith(reader.metadata["start_time"][:4]) and len(end) == 32, end
    with h5py.File(path, "r") as f:
        assert f.attrs.get_id("status").dtype.itemsize == 32
        assert f.attrs.get_id("end_time").dtype.itemsize == 32


# -- defect 3: one recorder per output path --------------------------------------------------------------
def test_a_second_writer_of_the_same_path_is_refused(tmp_path):
    from kdspec.traces.lock import lock_path, recording_state
    path = tmp_path / "t.h5"
    records, output, golden = make_run(1, 2, 8, 7, 7)
    with new_writer(path) as first:
        assert recording_state(path) in ("starting", "recording")
        with pytest.raises(TraceError, match="another recording") as excinfo:
            new_writer(path, force=True)
        assert "\n" not in str(excinfo.value)
        for record in records:
            first.write_step(record)
        first.finish(output, golden)
    assert recording_state(path) is None and not (tmp_path / lock_path("t.h5")).exists()
    with open_trace(path) as reader:
        assert reader.is_complete and reader.num_steps == 2
    with new_writer(path, force=True) as again:  # the lock was given back
        again.write_step(records[0])


def test_a_lock_file_left_by_a_killed_recorder_is_taken_over(tmp_path):
    from kdspec.traces.lock import lock_path, recording_state
    path = tmp_path / "t.h5"
    with open(lock_path(path), "w") as f:
        f.write("999999999 recording\n")   # no such process
    assert recording_state(path) is None
    with new_writer(path) as writer:
        writer.write_step(make_run(1, 1, 8, 7, 7)[0][0])
    assert not (tmp_path / "t.h5.lock").exists()


# -- defect 2: a failed recording leaves what was there -----------------------------------------------------
def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") or p.name.endswith(".lock"))


@pytest.mark.parametrize("how", ["failed", "interrupted", "no status", "exception"])
def test_a_recording_that_fails_before_its_first_step_keeps_the_old_trace(tmp_path, how):
    path = valid_trace(tmp_path / "t.h5")
    before = path.read_bytes()
    try:
        with new_writer(path, force=True) as writer:
            assert path.read_bytes() == before   # not touched until the first step is in place
            if how == "exception":
                raise RuntimeError("step 0 failed")
            writer.close(None if how == "no status" else how)
    except RuntimeError:
        pass
    assert path.read_bytes() == before and leftovers(tmp_path) == []


def test_the_new_trace_replaces_the_old_at_its_first_step(tmp_path):
    from kdspec.traces.lock import recording_state
    path = valid_trace(tmp_path / "t.h5", steps=4)
    records, output, golden = make_run(3, 2, 8, 7, 7)
    with new_writer(path, force=True) as writer:
        assert recording_state(path) == "starting"
        with open_trace(path) as old:
            assert old.num_steps == 4 and old.is_complete
        old_inode = path.stat().st_ino
        temporary = [p for p in leftovers(tmp_path) if p.endswith(".h5")]
        assert temporary == [f".t.h5.recording-{os.getpid()}.h5"]
        writer.write_step(records[0])
        # the new recording is at the final name now (a reader in another process follows it live there:
        # tests/traces/test_traces_crash.py; this process cannot open a file it is writing)
        assert recording_state(path) == "recording" and path.stat().st_ino != old_inode
        assert leftovers(tmp_path) == ["t.h5.lock"]
        writer.write_step(records[1])
        writer.finish(output, golden)
    with open_trace(path) as reader:
        assert reader.is_complete and reader.num_steps == 2 and check(reader)[0] == 0
    assert leftovers(tmp_path) == []


def test_a_run_without_steps_is_put_in_place_by_finish(tmp_path):
    path = tmp_path / "t.h5"
    with new_writer(path) as writer:
        assert not path.exists()
        writer.finish([5], [5])
    with open_trace(path) as reader:
        assert reader.is_complete and reader.num_steps == 0 and reader.output_tokens.tolist() == [5]


def test_bad_metadata_is_refused_before_any_file_is_made(tmp_path):
    from test_traces import MODEL_CONFIG, decode_config
    from kdspec.traces import RunMetadata
    path = valid_trace(tmp_path / "t.h5")
    before = path.read_bytes()
    bad_runs = [RunMetadata({**decode_config(8, 7, 7), "seed": 2 ** 64}, MODEL_CONFIG, "r", "c", [1]),
                RunMetadata(decode_config(8, 7, 7), {"x": object()}, "r", "c", [1]),
                RunMetadata(decode_config(8, 7, 7), MODEL_CONFIG, "r", "c", [2 ** 31]),
                RunMetadata(decode_config(8, 7, 7), MODEL_CONFIG, "r", "c", [1], vocabulary=[b"a", "text"])]
    for run in bad_runs:
        with pytest.raises(TraceError) as excinfo:
            TraceWriter(path, run, force=True)
        assert "\n" not in str(excinfo.value)
        assert path.read_bytes() == before and leftovers(tmp_path) == []


# -- defect 6: check verifies the trace's internal consistency ---------------------------------------------
def edited_run(tmp_path, name, edit, steps=6, seed=11, file_edit=None):
    """A consistent run with ``edit(records, output, golden)`` applied before writing; returns check()."""
    records, output, golden = make_run(seed, steps, 8, 7, 7)
    # a run whose steps have trees of several nodes and paths of several tokens, so every edit has a target
    while not all(len(r["tree_tokens"]) > 2 and len(r["accepted_nodes"]) > 1 for r in records):
        seed += 1000
        records, output, golden = make_run(seed, steps, 8, 7, 7)
    result = edit(records, output, golden)
    if isinstance(result, tuple):
        records, output, golden = result
    path = tmp_path / f"{name}.h5"
    write_run(path, records, output, golden, **RUN)
    if file_edit is not None:   # what the writer would refuse: edit the file itself
        with h5py.File(path, "r+") as f:
            file_edit(f)
    with open_trace(path) as reader:
        return check(reader)


def _set(record, **values):
    for name, value in values.items():
        record[name] = value


def _swap_accepted(records, output, golden):
    """Accepted path [0, a, ...] -> [0, k, ...] where node k's parent is not the root."""
    for r in records:
        off_root = [k for k in range(1, len(r["tree_parents"])) if r["tree_parents"][k] != 0]
        if off_root:
            r["accepted_nodes"][1] = off_root[0]
            return
    records[0]["accepted_nodes"][1] = len(records[0]["tree_tokens"])   # no such node


EDITS = {
    "zero step rows": (lambda r, o, g: ([], o, g), "no step"),
    "parent forward": (lambda r, o, g: r[2]["tree_parents"].__setitem__(1, 2), "parent"),
    "parent cycle": (lambda r, o, g: r[2]["tree_parents"].__setitem__(1, 1), "parent"),
    "root parent": (lambda r, o, g: r[2]["tree_parents"].__setitem__(0, 0), "parent"),
    "accepted not a path": (_swap_accepted, "path"),
    "accepted starts elsewhere": (lambda r, o, g: r[2]["accepted_nodes"].__setitem__(0, 1), "path"),
    "bonus not committed": (lambda r, o, g: _set(r[3], bonus_token=int(r[3]["bonus_token"]) ^ 1), "bonus"),
    "prefix does not chain": (lambda r, o, g: [_set(x, prefix_len=x["prefix_len"] + 1) for x in r[3:]], "continue"),
    "first prefix": (lambda r, o, g: [_set(x, prefix_len=x["prefix_len"] + 2) for x in r], "prompt"),
    "cache_len_after": (lambda r, o, g: _set(r[4], cache_len_after=r[4]["cache_len_after"] + 1), "cache_len_after"),
    "cache_len_verify": (lambda r, o, g: _set(r[4], cache_len_verify=r[4]["cache_len_verify"] - 1), "cache_len_verify"),
    "compaction": (lambda r, o, g: r[4]["compact_dst"].__setitem__(0, 0), "compact"),
    "nan dlogit": (lambda r, o, g: r[1]["logit_max_abs_diff"].__setitem__(0, np.nan), "dlogit"),
    "inf dlogit": (lambda r, o, g: r[1]["logit_max_abs_diff"].__setitem__(0, np.inf), "dlogit"),
    "nan dcache": (lambda r, o, g: _set(r[2], cache_max_abs_diff=np.float32(np.nan)), "dcache"),
    "golden disagrees": (lambda r, o, g: (r, o, g[:-1] + [g[-1] ^ 1]), "golden"),
}


def _tau_zero(f):
    rows = f["steps"][...]
    rows["tau"][1] = 0
    f["steps"][...] = rows


def test_check_fails_a_tau_of_zero_inside_the_trace(tmp_path):
    code, message = edited_run(tmp_path, "tau0", lambda r, o, g: None, file_edit=_tau_zero)
    assert code == 1 and "tau" in message, message


@pytest.mark.parametrize("name", list(EDITS))
def test_check_fails_a_trace_that_is_not_consistent(tmp_path, name):
    edit, needle = EDITS[name]
    code, message = edited_run(tmp_path, name.replace(" ", "_"), edit)
    assert code == 1 and needle in message and "\n" not in message, message


def test_nan_differences_that_were_not_measured_pass(tmp_path):
    """-1 golden tokens (the golden run did not reach) mark NaN differences as not measured: not a failure
    past the recorded output (the last step's overshoot)."""
    def unmeasured_tail(records, output, golden):
        last = records[-1]
        tau = len(last["accepted_nodes"])
        last["golden_tokens"][tau - 1] = -1
        last["logit_max_abs_diff"][tau - 1] = np.nan
        return records, output[:-1], golden[:-1]
    assert edited_run(tmp_path, "tail", unmeasured_tail)[0] == 0

    def unmeasured_inside(records, output, golden):   # but inside the output, a missing golden is not ok
        records[2]["golden_tokens"][0] = -1
        records[2]["logit_max_abs_diff"][0] = np.nan
    code, message = edited_run(tmp_path, "inside", unmeasured_inside)
    assert code == 1, message


def test_check_of_a_consistent_run_still_passes(tmp_path):
    assert edited_run(tmp_path, "fine", lambda r, o, g: None) == edited_run(tmp_path, "fine2", lambda r, o, g: None)
    assert edited_run(tmp_path, "fine3", lambda r, o, g: None)[0] == 0


# -- defect 7: bounded SWMR retries ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def killed_trace(tmp_path_factory):
    """A trace whose writer was SIGKILLed (still flagged open for writing: it opens in SWMR mode only)."""
    return write_killed_trace(tmp_path_factory.mktemp("killed") / "killed.h5", seed=1, steps=40)


def test_a_killed_trace_with_flipped_bytes_fails_within_seconds(killed_trace, tmp_path):
    """HDF5 retried an unreadable metadata block in SWMR mode for minutes; now a few attempts."""
    import random
    import time
    data = killed_trace.read_bytes()
    with open_trace(killed_trace) as reader:
        assert reader.num_steps >= 39
    rng = random.Random(0)
    for trial in range(12):
        damaged = bytearray(data)
        for _ in range(3):
            damaged[rng.randrange(len(damaged))] ^= 0xFF
        path = tmp_path / f"flip{trial}.h5"
        path.write_bytes(bytes(damaged))
        start = time.monotonic()
        try:
            with open_trace(path) as reader:
                for i in range(reader.num_steps):
                    reader.step(i)
                check(reader)
        except TraceError as e:
            assert "\n" not in str(e)
        assert time.monotonic() - start < 5, trial


@pytest.mark.parametrize("name,value", [("tau", 10 ** 9), ("tau", -5), ("num_nodes", 10 ** 9), ("num_nodes", 0)])
def test_the_viewer_bounds_sizes_by_the_declared_shapes(tmp_path, name, value):
    """One tau of 10^9 sized a histogram by it (GBs); the viewer's columns are checked against the widths."""
    from kdspec.kdtree_tui.session import TraceSession
    path = valid_trace(tmp_path / "t.h5", steps=6)
    with h5py.File(path, "r+") as f:
        rows = f["steps"][...]
        rows[name][2] = value
        f["steps"][...] = rows
    session = TraceSession(path)
    try:
        with pytest.raises(TraceError, match=f"step 2: {name}") as excinfo:
            session.read_columns()
        assert "\n" not in str(excinfo.value)
        with pytest.raises(TraceError):
            session.step(2)
        session.step(1)
    finally:
        session.close()
