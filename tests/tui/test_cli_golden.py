"""`kdtree record --golden auto|cpu|gpu|none` (issue 21): where the golden runs, what the trace says about it, what
`check` / `info` make of a trace without one, and the refusals (oracle drafters without a golden, gpu without
CUDA) as one line and exit 2 before any file is touched."""
from __future__ import annotations

import json
import re
import types

import h5py
import numpy as np
import pytest

from kdspec.engine.decode import api
from kdspec.kdtree_tui import cli
from kdspec.traces import open_trace

TINY = ["--model", "tiny", "--backend", "reference", "--max-new-tokens", "12"]


def record(tmp_path, *args, name="t.h5"):
    out = tmp_path / name
    return cli.main(["record", *TINY, "--out", str(out), *args]), out


def one_error_line(capsys, needle: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and needle in err, err
    return err


def test_golden_none_says_so_in_the_trace_and_check_passes_it(tmp_path, capsys):
    code, out = record(tmp_path, "--golden", "none", "--mode", "ar")
    assert code == 0
    assert "no golden (--golden none)" in capsys.readouterr().out
    with open_trace(out) as reader:
        assert reader.metadata["decode_config"]["golden"] == "none"
        assert (reader.field("golden_tokens") == -1).all() and np.isnan(reader.field("logit_max_abs_diff")).all()
        assert len(reader.golden_tokens) == 0 and len(reader.output_tokens) == 12
    assert cli.main(["check", str(out)]) == 0
    assert "ok: 12 tokens in 11 steps, intact; no golden to compare" in capsys.readouterr().out
    assert cli.main(["info", str(out)]) == 0
    assert "golden     none (recorded with --golden none)" in capsys.readouterr().out
    assert cli.main(["info", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["golden_match"] is None


def test_a_trace_without_a_golden_that_carries_golden_tokens_fails_check(tmp_path, capsys):
    code, out = record(tmp_path, "--golden", "cpu")
    assert code == 0
    with h5py.File(out, "r+") as f:  # say "none" after the fact: the steps still hold the golden's tokens
        decode = json.loads(f.attrs["decode_config"])
        f.attrs["decode_config"] = json.dumps({**decode, "golden": "none"})
    capsys.readouterr()
    assert cli.main(["check", str(out)]) == 1
    assert "recorded without a golden (--golden none), yet step 0 carries golden tokens" in capsys.readouterr().out


def test_golden_cpu_records_where_and_says_how_long(tmp_path, capsys):
    code, out = record(tmp_path, "--golden", "cpu")
    assert code == 0
    summary = capsys.readouterr().out
    assert "equal to the golden" in summary and re.search(r", golden on cpu \d+\.\d s$", summary.strip())
    with open_trace(out) as reader:
        assert reader.metadata["decode_config"]["golden"] == "cpu"
        assert (reader.field("golden_tokens")[:, 0] >= 0).all()
    assert cli.main(["check", str(out)]) == 0
    assert "equal the golden" in capsys.readouterr().out


def test_golden_auto_takes_the_cpu_for_a_small_model(tmp_path):
    code, out = record(tmp_path)
    assert code == 0
    with open_trace(out) as reader:
        assert reader.metadata["decode_config"]["golden"] == "cpu"


@pytest.mark.parametrize("drafter", [[], ["--drafter", "oracle"], ["--drafter", "noisy:0.5"]])
def test_oracle_drafters_are_refused_without_a_golden_before_any_file_is_touched(tmp_path, capsys, drafter):
    old = tmp_path / "old.h5"
    old.write_bytes(b"an old trace")
    code, _ = record(tmp_path, "--golden", "none", "--force", *drafter, name="old.h5")
    assert code == 2
    one_error_line(capsys, "follows the golden run, but --golden none leaves it out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.h5"] and old.read_bytes() == b"an old trace"


def test_golden_auto_that_leaves_the_golden_out_refuses_the_oracle(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(api, "_physical_memory", lambda: 1024)  # every model's float64 weights exceed half of it
    code, out = record(tmp_path)
    assert code == 2
    one_error_line(capsys, "--golden auto leaves it out (float64 weights")
    assert not out.exists()
    code, out = record(tmp_path, "--mode", "ar", name="ar.h5")  # AR needs no golden: recorded without one
    assert code == 0
    with open_trace(out) as reader:
        assert reader.metadata["decode_config"]["golden"] == "none"


def test_golden_gpu_without_torch_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # `import torch` raises ImportError
    code, _ = record(tmp_path, "--golden", "gpu")
    assert code == 2
    one_error_line(capsys, "--golden gpu: the GPU golden needs torch with CUDA")
    assert list(tmp_path.iterdir()) == []


def test_golden_gpu_without_a_cuda_gpu_is_one_line(tmp_path, capsys, monkeypatch):
    fake = types.SimpleNamespace(__version__="9.9+cpu", cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(__import__("sys").modules, "torch", fake)
    code, _ = record(tmp_path, "--golden", "gpu")
    assert code == 2
    one_error_line(capsys, "torch 9.9+cpu sees none")
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_golden_is_a_usage_error(tmp_path, capsys):
    code, _ = record(tmp_path, "--golden", "tpu")
    assert code == 2
    one_error_line(capsys, "argument --golden: invalid choice")


def test_help_states_the_golden_default_and_bound(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["record", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "half the RAM" in text and "(default: auto)" in text.split("--golden", 1)[1]


def test_golden_gpu_computes_on_cuda_and_says_so(tmp_path, capsys, monkeypatch):
    """Without a GPU here: the CLI's gpu path asks Engine.golden_for for device "cuda" (answered by the numpy
    golden) and the trace says gpu."""
    asked = []
    numpy_golden = api.Engine.golden_for

    def golden_for(self, prompt, config, device=None):
        asked.append(device)
        return numpy_golden(self, prompt, config)

    monkeypatch.setattr(api, "gpu_golden_unavailable", lambda: None)
    monkeypatch.setattr(api.Engine, "golden_for", golden_for)
    code, out = record(tmp_path, "--golden", "gpu")
    assert code == 0 and asked == ["cuda"]
    assert "golden on gpu" in capsys.readouterr().out
    with open_trace(out) as reader:
        assert reader.metadata["decode_config"]["golden"] == "gpu"


def test_the_gpu_golden_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch):
    class OutOfMemoryError(RuntimeError):  # torch.cuda.OutOfMemoryError's name and base
        pass

    def golden_for(self, prompt, config, device=None):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 56.00 GiB")

    monkeypatch.setattr(api, "gpu_golden_unavailable", lambda: None)
    monkeypatch.setattr(api.Engine, "golden_for", golden_for)
    code, out = record(tmp_path, "--golden", "gpu")
    assert code == 2
    one_error_line(capsys, "the GPU golden ran out of GPU memory: use --golden cpu or none")
    assert not out.exists()
