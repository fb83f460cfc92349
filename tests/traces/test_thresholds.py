"""traces.thresholds: anomaly thresholds follow a trace's precision, can be overridden, and flag steps as an
independent loop over the same columns says (the command line and the app: tests/tui/test_thresholds_cli.py)."""
from __future__ import annotations

import numpy as np
import pytest
from test_traces import make_run, write_run

from kdspec.traces import open_trace
from kdspec.traces.thresholds import (
    CACHE,
    DIVERGED,
    DLOGIT,
    FLAG_COLUMNS,
    LOW_TAU,
    PRECISION_THRESHOLDS,
    Thresholds,
    count_flags,
    flag_steps,
    thresholds_for,
    trace_precision,
)


@pytest.mark.parametrize("metadata, precision", [
    ({"backend": "reference", "model_config": {"weight_dtype": "float32"}}, "float64"),
    ({"backend": "cuda", "model_config": {"weight_dtype": "float32"}}, "float32"),
    ({"backend": "sim", "model_config": {"weight_dtype": "bfloat16"}}, "bfloat16"),
    ({"backend": "cuda", "model_config": {}}, "float32"),       # older traces: no weight_dtype
    ({"backend": "cuda", "model_config": ["damaged"]}, "float32"),
])
def test_precision_and_its_defaults(metadata, precision):
    assert trace_precision(metadata) == precision
    t = thresholds_for(metadata)
    assert (t.dlogit, t.cache, t.min_tau, t.precision) == (*PRECISION_THRESHOLDS[precision], 2, precision)
    assert t.logit_noise == 2 * t.dlogit


def test_overrides_replace_the_defaults_and_say_custom():
    meta = {"backend": "cuda", "model_config": {"weight_dtype": "bfloat16"}}
    t = thresholds_for(meta, dlogit=0.5, min_tau=3)
    assert (t.dlogit, t.cache, t.min_tau, t.precision) == (0.5, PRECISION_THRESHOLDS["bfloat16"][1], 3, "custom")
    assert thresholds_for(meta, dlogit=PRECISION_THRESHOLDS["bfloat16"][0]).precision == "bfloat16"
    assert "custom" in t.describe() and "bfloat16 defaults" in thresholds_for(meta).describe()


@pytest.mark.parametrize("bad", [{"dlogit": float("nan")}, {"dlogit": -1.0}, {"cache": float("inf")},
                                 {"min_tau": -1}, {"min_tau": 1.5}, {"dlogit": True}])
def test_bad_values_are_value_errors(bad):
    with pytest.raises(ValueError):
        Thresholds().with_values(**bad)


def expected_flags(columns, t: Thresholds, mode: str) -> list[int]:
    """Step by step, position by position."""
    out = []
    for i, tau in enumerate(columns["tau"]):
        flags = 0
        for j in range(int(tau)):
            golden = int(columns["golden_tokens"][i][j])
            if golden >= 0 and golden != int(columns["committed_tokens"][i][j]):
                flags |= DIVERGED
            if abs(float(columns["logit_max_abs_diff"][i][j])) > t.dlogit:  # NaN compares False: not measured
                flags |= DLOGIT
        if mode != "ar" and tau < t.min_tau:
            flags |= LOW_TAU
        if abs(float(columns["cache_max_abs_diff"][i])) > t.cache:
            flags |= CACHE
        out.append(flags)
    return out


@pytest.mark.parametrize("mode", ["ddtree", "ar"])
def test_flags_equal_an_independent_loop(mode):
    rng = np.random.default_rng(5)
    steps, width = 300, 6
    tau = rng.integers(1, width + 1, steps)
    committed = rng.integers(0, 9, (steps, width))
    golden = np.where(rng.random((steps, width)) < 0.05, rng.integers(-1, 9, (steps, width)), committed)
    dlogit = rng.choice([0.0, 5e-5, 2e-4, np.nan], (steps, width))
    cache = rng.choice([0.0, 5e-5, 2e-4, np.nan], steps)
    columns = {"tau": tau, "committed_tokens": committed, "golden_tokens": golden, "logit_max_abs_diff": dlogit,
               "cache_max_abs_diff": cache}
    t = Thresholds(1e-4, 1e-4, 3)
    got = flag_steps(columns, t, mode)
    assert got.dtype == np.uint8 and got.tolist() == expected_flags(columns, t, mode)
    assert len(set(got.tolist())) > 4  # the random columns exercise several flag combinations


def test_count_flags_over_a_trace_read_in_blocks(tmp_path, monkeypatch):
    from kdspec.traces import thresholds as module
    records, output, golden = make_run(3, 40, 5, 6, 3, diverge_at=7)
    for i, r in enumerate(records):
        r["logit_max_abs_diff"] = np.full(len(r["committed_tokens"]), 3e-4 if i % 4 == 0 else 1e-6, np.float32)
    path = tmp_path / "t.h5"
    write_run(path, records, output, golden, block_size=5, budget=6, draft_topk=3)
    monkeypatch.setattr(module, "FLAG_BLOCK_STEPS", 7)  # several blocks
    t = Thresholds(1e-4, 1e-4, 2)
    with open_trace(path) as reader:
        found = count_flags(reader, t)
        columns = {name: np.asarray(reader.column(name) if name in ("tau", "cache_max_abs_diff")
                                    else reader.field(name)) for name in FLAG_COLUMNS}
    want = expected_flags(columns, t, "ddtree")
    for bit, key in ((DIVERGED, "diverged"), (DLOGIT, "dlogit"), (LOW_TAU, "short"), (CACHE, "cache")):
        hits = [i for i, f in enumerate(want) if f & bit]
        assert found[key] == len(hits) and found["first"][key] == (hits[0] if hits else None)
    assert found["diverged"] >= 1 and found["first"]["diverged"] == 7 and found["dlogit"] == 10
