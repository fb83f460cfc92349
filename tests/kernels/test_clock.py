"""The GPU-clock stamps (numba_kernels/clock.py): begin and end stamps land in order, the counter advances at end
stamps only and stops at the capacity, clear starts over, and a bad capacity is refused."""
from __future__ import annotations

import numpy as np
import pytest

from kdspec.numba_kernels.clock import Stamps


@pytest.mark.sim
def test_spans_in_order_and_bounded():
    stamps = Stamps(2)
    assert stamps.spans().shape == (0, 2)
    for _ in range(3):  # the third span is past the capacity: dropped
        stamps.stamp(False)
        stamps.stamp(True)
    spans = stamps.spans()
    assert spans.shape == (2, 2)
    assert (spans[:, 1] >= spans[:, 0]).all() and spans[1, 0] >= spans[0, 1] and spans[0, 0] > 0
    stamps.clear()
    stamps.stamp(False)
    assert stamps.spans().shape == (0, 2)  # a begun span is not a completed one
    stamps.stamp(True)
    assert stamps.spans().shape == (1, 2)


@pytest.mark.sim
def test_refuses_no_capacity():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        Stamps(0)
