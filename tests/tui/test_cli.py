"""The `kdtree` command line: record on the simulator, round-trip of every field, check/info exit codes, errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from kdspec.engine.decode import api
from kdspec.engine.decode.config import DecodeConfig
from kdspec.traces import RunMetadata, TraceWriter, open_trace

ENV = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}


def kdtree(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "kdspec.kdtree_tui", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def test_help_lists_the_commands():
    result = kdtree("--help")
    assert result.returncode == 0
    for command in ("record", "info", "check", "tui", "demo", "config"):
        assert command in result.stdout


@pytest.mark.sim
@pytest.mark.slow
def test_sim_trace_round_trips_every_field(tmp_path):
    """What the engine emitted (sim backend, tiny) is exactly what the reader gives back."""
    engine = api.load("tiny", backend="sim", seed=3)
    golden = engine.golden("abc", 12 + 8)
    records = []
    path = tmp_path / "rt.h5"
    config = DecodeConfig(12, mode="ddtree", drafter="noisy:0.6", seed=3)
    run = RunMetadata(config.resolved(engine.cfg.vocab_size).as_dict(), engine.cfg.to_hf_dict(), "sim",
                      "CUDA simulator", prompt_tokens=[97, 98, 99])
    with TraceWriter(path, run) as writer:
        def on_step(record):
            records.append({k: np.copy(v) for k, v in record.items()})
            writer.write_step(record)
        result = engine.generate("abc", config, golden=golden, on_step=on_step)
        writer.finish(result.tokens, golden.tokens[:12])
    assert result.golden_match
    with open_trace(path) as reader:
        assert reader.num_steps == len(records)
        assert np.array_equal(reader.output_tokens, result.tokens)
        for i, emitted in enumerate(records):
            step = reader.step(i).as_dict()
            for name, value in emitted.items():
                if name.startswith("time_"):
                    assert step[name] == pytest.approx(value), name
                else:
                    np.testing.assert_array_equal(np.asarray(step[name]), np.asarray(value), err_msg=name)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny.h5"
    result = kdtree("record", "--model", "tiny", "--backend", "sim", "--prompt", "Hi", "--max-new-tokens", "10",
                    "--drafter", "noisy:0.6", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "equal to the golden" in result.stdout
    return out


@pytest.mark.sim
@pytest.mark.slow
def test_check_passes_on_a_recorded_trace_and_fails_on_a_diverged_copy(recorded, tmp_path):
    assert kdtree("check", str(recorded)).returncode == 0
    info = json.loads(kdtree("info", "--json", str(recorded)).stdout)
    assert info["golden_match"] is True and info["backend"] == "sim" and info["num_steps"] >= 1
    assert len(info["output_tokens"]) == 10
    diverged = tmp_path / "diverged.h5"
    shutil.copy(recorded, diverged)
    with h5py.File(diverged, "r+") as f:
        name = next(n for n in ("output_tokens", "output") if n in f)
        tokens = f[name][...]
        tokens[-1] = (tokens[-1] + 1) % 256
        f[name][...] = tokens
    result = kdtree("check", str(diverged))
    assert result.returncode == 1, result.stdout + result.stderr


def test_record_refuses_to_overwrite_and_rejects_bad_parameters(tmp_path):
    existing = tmp_path / "x.h5"
    existing.write_bytes(b"keep me")
    result = kdtree("record", "--backend", "reference", "--out", str(existing))
    assert result.returncode == 2 and "exists" in result.stderr and existing.read_bytes() == b"keep me"
    for args, words in ((["--budget", "0"], "budget"), (["--block-size", "0"], "block_size"),
                        (["--topk", "0"], "topk"), (["--prompt-ids", "1,999"], "vocabulary"),
                        (["--prompt", ""], "prompt"), (["--max-new-tokens", "5000"], "max_position")):
        result = kdtree("record", "--backend", "reference", "--out", str(tmp_path / "y.h5"), *args)
        assert result.returncode == 2, (args, result.stderr)
        assert words in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "y.h5").exists()


def test_bad_model_config_is_one_line_exit_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 7}))
    for command in (["config", str(tmp_path)], ["record", "--model", str(tmp_path), "--backend", "reference",
                                                 "--out", str(tmp_path / "t.h5")]):
        result = kdtree(*command)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_unreadable_traces_exit_2(tmp_path):
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"\x00not a trace" * 100)
    for command in ("info", "check"):
        for path in (garbage, tmp_path / "missing.h5"):
            result = kdtree(command, str(path))
            assert result.returncode == 2 and "Traceback" not in result.stderr
            assert len(result.stderr.strip().splitlines()) == 1


def test_same_seed_and_config_record_the_same_trace(tmp_path):
    """Two recordings of one run agree in every field but timings and timestamps."""
    paths = [tmp_path / f"run{i}.h5" for i in range(2)]
    for path in paths:
        result = kdtree("record", "--backend", "reference", "--model", "small", "--drafter", "noisy:0.6",
                        "--budget", "12", "--seed", "7", "--max-new-tokens", "16", "--out", str(path))
        assert result.returncode == 0, result.stderr
    with open_trace(paths[0]) as first, open_trace(paths[1]) as second:
        assert first.num_steps == second.num_steps > 1
        for i in range(first.num_steps):
            a, b = first.step(i).as_dict(), second.step(i).as_dict()
            assert a.keys() == b.keys()
            for name in a:
                if not name.startswith("time_"):
                    np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)
        np.testing.assert_array_equal(first.output_tokens, second.output_tokens)
        meta_a, meta_b = (dict(r.metadata) for r in (first, second))
        for meta in (meta_a, meta_b):
            for key in [k for k in meta if "time" in k]:
                del meta[key]
        assert json.dumps(meta_a, sort_keys=True, default=str) == json.dumps(meta_b, sort_keys=True, default=str)


def test_numba_occupancy_hint_stays_out_of_the_output():
    """The engine launches small grids on purpose: Numba's low-occupancy hint (with its highlighting) is
    silenced by the command line; other warnings are not."""
    import warnings

    from numba.core.errors import NumbaPerformanceWarning

    from kdspec.kdtree_tui import cli
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cli.main(["--version"]) == 0
        warnings.warn(NumbaPerformanceWarning("Grid size 1 will likely result in GPU under-utilization due to "
                                              "low occupancy."))
        warnings.warn(NumbaPerformanceWarning("another hint"))
    assert ["another hint" in str(w.message) for w in seen] == [True]
