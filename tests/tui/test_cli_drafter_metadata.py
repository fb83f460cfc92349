"""The run metadata names the drafter: a trained drafter's name, its config.json and the sha256 of its weights
file (checked here against the files themselves), an oracle's name, nothing for AR; a drafter that cannot load
is one line, exit 2, and no output file; traces written before the attribute still read."""
from __future__ import annotations

import hashlib
import json

import h5py
import numpy as np

from kdspec.engine.model.checkpoint import model_directory
from kdspec.kdtree_tui import cli
from kdspec.traces import open_trace

DRAFTER = model_directory("pycoder-mini") / "drafter"


def record(tmp_path, name, *argv):
    out = tmp_path / name
    assert cli.main(["record", "--backend", "reference", "--max-new-tokens", "12", "--out", str(out), *argv]) == 0
    return out


def test_a_trained_drafter_is_named_configured_and_digested(tmp_path, capsys):
    out = record(tmp_path, "py.h5", "--model", "pycoder-mini", "--drafter", "dflash")
    with open_trace(out) as reader:
        drafter = reader.metadata["drafter"]
        assert np.isfinite(reader.metadata["time_golden"]) and reader.metadata["time_golden"] > 0
    assert drafter["name"] == f"dflash:{DRAFTER}"
    assert drafter["digest"] == hashlib.sha256((DRAFTER / "model.safetensors").read_bytes()).hexdigest()
    on_disk = json.loads((DRAFTER / "config.json").read_text())
    assert {k: drafter["config"][k] for k in on_disk} == on_disk
    capsys.readouterr()
    assert cli.main(["info", str(out)]) == 0
    assert f"drafter    dflash:{DRAFTER}  digest {drafter['digest'][:16]}" in capsys.readouterr().out


def test_oracle_and_ar_runs(tmp_path):
    with open_trace(record(tmp_path, "noisy.h5", "--drafter", "noisy:0.5")) as reader:
        assert reader.metadata["drafter"] == {"name": "noisy:0.5"}
    with open_trace(record(tmp_path, "ar.h5", "--mode", "ar")) as reader:
        assert reader.metadata["drafter"] == {}


def test_a_drafter_that_cannot_load_is_one_line_and_no_file(tmp_path, capsys):
    out = tmp_path / "t.h5"
    code = cli.main(["record", "--model", "pycoder-mini", "--backend", "reference", "--drafter",
                     f"dflash:{tmp_path / 'missing'}", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no drafter config" in err[0]
    assert not out.exists() and not list(tmp_path.iterdir())


def test_traces_without_the_attributes_still_read(tmp_path):
    out = record(tmp_path, "old.h5")
    with h5py.File(out, "r+") as f:   # as a trace written before these attributes existed
        del f.attrs["drafter"], f.attrs["time_golden"]
    with open_trace(out) as reader:
        assert reader.metadata["drafter"] == {} and np.isnan(reader.metadata["time_golden"])
