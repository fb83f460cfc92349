"""api.load's backend choice: the CUDA simulator runs toy shapes only (its attention kernels' register tiles are
sized for them), so a larger model is refused there with a reason, and "auto" falls back to the reference."""
import os

import pytest

from kdspec.engine.decode import api
from kdspec.engine.model.config import PRESETS, resolve_config

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="needs the CUDA simulator")


def test_sim_refuses_a_model_past_its_toy_shapes():
    cfg = resolve_config("pycoder-mini")
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (64, 16)
    with pytest.raises(api.BackendUnavailable, match=r"toy shapes only \(kv_lora_rank <= 32, qk_rope_head_dim <= 8; "
                                                     r"this model has 64 and 16\)"):
        api.load("pycoder-mini", backend="sim")


def test_auto_takes_the_simulator_for_toy_presets_and_the_reference_past_them():
    assert PRESETS["tiny"].kv_lora_rank <= 32
    assert api.load("tiny", backend="auto").backend == "sim"
    assert api.load("pycoder-mini", backend="auto").backend == "reference"
