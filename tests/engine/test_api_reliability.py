"""The engine's Python API refuses bad arguments with its own error types (issue 21, defect 13)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kdspec.engine.decode import api
from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.golden.sampling import choose_token


@pytest.fixture(scope="module")
def engine():
    return api.load("tiny", backend="reference")


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -1.0, True, "0.5", None])
def test_bad_temperatures_are_value_errors(engine, temperature):
    with pytest.raises(ValueError, match="temperature"):
        engine.golden([1, 2, 3], 2, temperature=temperature)
    with pytest.raises(ValueError, match="temperature"):
        choose_token(np.zeros(4), temperature, 0, 0)
    with pytest.raises(ValueError, match="temperature"):
        DecodeConfig(4, temperature=temperature)


def test_bogus_weight_dtype_is_refused():
    for backend in ("reference", "auto"):
        with pytest.raises(ValueError, match="weight_dtype"):
            api.load("tiny", backend=backend, weight_dtype="bogus")


@pytest.mark.parametrize("kwargs,needle", [(dict(mode="ddtree", block_size=1), "block_size must be an integer >= 2"),
                                          (dict(seed=2 ** 64), "seed must be at most"),
                                          (dict(seed=-1), "seed must be an integer >= 0")])
def test_decode_settings_that_would_fail_mid_run_are_refused_up_front(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DecodeConfig(4, **kwargs)


def test_a_nan_cache_difference_is_not_dropped():
    """records.cache_max_abs_diff: NaN rows give NaN (Python's max() dropped them: all-NaN weights read 0.0)."""
    from types import SimpleNamespace
    from kdspec.engine.decode.records import cache_max_abs_diff
    ours = SimpleNamespace(c=[np.zeros((4, 2)), np.full((4, 2), np.nan)], k_pe=[np.zeros((4, 2))] * 2, length=4)
    theirs = SimpleNamespace(c=[np.zeros((4, 2))] * 2, k_pe=[np.zeros((4, 2))] * 2, length=4)
    assert math.isnan(cache_max_abs_diff(ours, theirs, 0, 4))
    ours.c[1] = np.ones((4, 2))
    assert cache_max_abs_diff(ours, theirs, 0, 4) == 1.0
    assert math.isnan(cache_max_abs_diff(ours, theirs, 4, 4))   # no row compared
