"""Engine.plan_golden: where `--golden auto` runs the golden (GPU for a cuda run whose float64 weights fit the
free GPU memory, else the CPU within half the RAM, else none), and the explicit choices. The machine is faked
(RAM, GPU, free memory), so the decisions are tested here without a GPU."""
import numpy as np
import pytest

from kdspec.engine.decode import api
from kdspec.engine.model.config import PRESETS
from kdspec.engine.model.weights import parameter_shapes

GIB = 2 ** 30


@pytest.fixture
def engine():
    return api.load("small", backend="reference")


@pytest.fixture
def machine(monkeypatch):
    """Set ram / gpu (None: no torch CUDA) / free (GPU bytes free) of a fake machine."""
    state = {"ram": 64 * GIB, "gpu": True, "free": 80 * GIB}
    monkeypatch.setattr(api, "_physical_memory", lambda: state["ram"])
    monkeypatch.setattr(api, "gpu_golden_unavailable", lambda: None if state["gpu"] else "no CUDA here")
    monkeypatch.setattr(api, "_free_gpu_memory", lambda: state["free"])
    return state


def test_golden_bytes_are_eight_a_parameter(engine):
    params = sum(int(np.prod(shape)) for shape in parameter_shapes(PRESETS["small"]).values())
    assert engine.golden_bytes() == 8 * params


def test_auto_takes_the_gpu_on_a_cuda_run_whose_weights_fit(engine, machine):
    engine.backend = "cuda"
    need = engine.golden_bytes()
    machine["free"] = need + api.GOLDEN_GPU_HEADROOM
    assert engine.plan_golden("auto").where == "gpu" and engine.plan_golden("auto").device == "cuda"
    machine["free"] = need + api.GOLDEN_GPU_HEADROOM - 1  # one byte short: the CPU, within half the RAM
    plan = engine.plan_golden("auto")
    assert plan.where == "cpu" and plan.device is None and "half the RAM" in plan.reason


def test_auto_takes_the_cpu_without_cuda_or_off_a_cuda_run(engine, machine):
    engine.backend = "cuda"
    machine["gpu"] = False
    assert engine.plan_golden("auto").where == "cpu"
    engine.backend, machine["gpu"] = "reference", True  # a GPU is there, but the run is not on it
    assert engine.plan_golden("auto").where == "cpu"


def test_auto_leaves_the_golden_out_past_half_the_ram(engine, machine):
    need = engine.golden_bytes()
    machine["ram"] = 2 * need
    assert engine.plan_golden("auto").where == "cpu"   # exactly half: still the CPU
    machine["ram"] = 2 * need - 2
    plan = engine.plan_golden("auto")
    assert plan.where == "none" and "exceed half the RAM" in plan.reason
    engine.backend, machine["free"] = "cuda", need  # a GPU without the headroom does not take it either
    assert engine.plan_golden("auto").where == "none"


def test_explicit_choices(engine, machine):
    machine["ram"] = 0  # an explicit choice is taken whatever the size
    assert engine.plan_golden("cpu").where == "cpu" and engine.plan_golden("none").where == "none"
    assert engine.plan_golden("gpu").where == "gpu"
    machine["gpu"] = False
    with pytest.raises(api.BackendUnavailable, match="no CUDA here"):
        engine.plan_golden("gpu")
    with pytest.raises(ValueError, match="golden must be one of auto, cpu, gpu, none"):
        engine.plan_golden("tpu")
