"""recipe.py: the shipped shape has every DeepSeek-V3 feature on and fits the size budget."""
import dataclasses

import pytest

from kdspec.engine.train.errors import TrainError
from kdspec.engine.train.recipe import PYCODER_MINI, SMOKE, ModelShape


def test_shipped_shape_fits_16_mb_in_bf16():
    assert PYCODER_MINI.parameter_count() * 2 <= 16_000_000
    kwargs = PYCODER_MINI.hf_config_kwargs(eod_id=0)
    assert kwargs["q_lora_rank"] and kwargs["n_group"] > 1 and kwargs["topk_group"] < kwargs["n_group"]
    assert kwargs["first_k_dense_replace"] >= 1 and kwargs["n_shared_experts"] >= 1
    assert kwargs["rope_parameters"]["rope_type"] == "yarn" and kwargs["rope_parameters"]["factor"] > 1
    assert kwargs["max_position_embeddings"] >= 1024
    assert kwargs["pad_token_id"] is None


@pytest.mark.parametrize("change", [dict(n_group=1, topk_group=1), dict(topk_group=4), dict(first_k_dense_replace=0),
                                    dict(original_max_position_embeddings=2048), dict(n_shared_experts=0)])
def test_shapes_without_a_feature_are_refused(change):
    with pytest.raises(TrainError):
        dataclasses.replace(SMOKE, **change)


def test_parameter_count_equals_transformers():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kdspec.engine.train.trainer import build_model, count_parameters
    for shape in (SMOKE, ModelShape(vocab_size=512, hidden_size=64, moe_intermediate_size=32, intermediate_size=96)):
        model = build_model(shape, torch.device("cpu"), seed=0)
        assert count_parameters(model) == shape.parameter_count()
