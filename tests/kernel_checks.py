"""Checks shared by the kernel tests: NaN-poisoned outputs and closeness to a float64 reference."""
import numpy as np
from numba import cuda


def assert_close(actual, expected, rtol):
    """Elementwise rtol, with an absolute floor of rtol * max|expected| for entries near zero; a NaN left
    from the poison (an output never written) fails."""
    assert np.isfinite(actual).all(), "output not fully written (NaN poison left) or non-finite"
    scale = max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def poisoned(shape):
    """A float32 device array of NaN: whatever a kernel leaves unwritten stays NaN."""
    return cuda.to_device(np.full(shape, np.nan, dtype=np.float32))


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)
