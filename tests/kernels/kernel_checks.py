"""Checks shared by the kernel tests: NaN-poisoned outputs, closeness to a float64 reference, one check
parametrised at a toy (simulator) and a K2 (GPU) size."""
import numpy as np
import pytest
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


def rope_table(cfg, max_positions=None, stream=0):
    """The engine's RoPE tables for cfg (float64 reference cos/sin rounded to float32) on the device."""
    from kdspec.engine.golden.model import rope_cos_sin
    from kdspec.numba_kernels.rope import RopeTable
    count = cfg.max_position_embeddings if max_positions is None else int(max_positions)
    cos, sin = rope_cos_sin(cfg, np.arange(count, dtype=np.int64))
    return RopeTable(cuda.to_device(cos.astype(np.float32), stream=stream),
                     cuda.to_device(sin.astype(np.float32), stream=stream))


def by_size(toy_cases, k2_cases, case_id=None):
    """pytest parameters (size, case) of one check at two sizes: "toy" cases marked sim (the simulator runs
    them; on a GPU they run for real), "k2" cases (Kimi K2 sizes) marked gpu (skipped without a GPU).
    case_id(case) names a case in the test id (default: its values joined by "-")."""
    if case_id is None:
        def case_id(case):
            return "-".join(map(case_id, case)) if isinstance(case, tuple) else str(case)
    return ([pytest.param("toy", case, marks=pytest.mark.sim, id=f"toy-{case_id(case)}") for case in toy_cases]
            + [pytest.param("k2", case, marks=pytest.mark.gpu, id=f"k2-{case_id(case)}") for case in k2_cases])
