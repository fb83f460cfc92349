"""ModelConfig: HF config.json parsing (flat, Kimi K2.5 text_config, rope_parameters), round trips, validation.

The Kimi K2 fixture is written by hand from the published config.json, not produced
by the code under test.
"""
import copy
import dataclasses
import json
import math

import pytest

from kdspec.engine.model.config import PRESETS, ConfigError, ModelConfig, YarnScaling, resolve_config

# Kimi K2 (moonshotai/Kimi-K2-Instruct) config.json, as published: extra fields the parser must ignore included.
KIMI_K2_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 131072,
    "model_type": "kimi_k2",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}

KIMI_K2_EXPECTED = dict(
    vocab_size=163840, hidden_size=7168, num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
    num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432,
    first_k_dense_replace=1, routed_scaling_factor=2.827, scoring_func="sigmoid", topk_method="noaux_tc",
    n_group=1, topk_group=1, norm_topk_prob=True, rope_theta=50000.0,
    rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0),
    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=131072,
)


def kimi_k2(**changes):
    raw = copy.deepcopy(KIMI_K2_CONFIG)
    raw.update(changes)
    return raw


def assert_is_kimi_k2(cfg):
    for field, value in KIMI_K2_EXPECTED.items():
        assert getattr(cfg, field) == value, field
        assert type(getattr(cfg, field)) is type(value), field


# -- round trips -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_hf_dict_round_trip(preset):
    cfg = PRESETS[preset]
    # Through JSON text, as a real config.json travels.
    raw = json.loads(json.dumps(cfg.to_hf_dict()))
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "name" not in raw
    assert ModelConfig.from_hf_dict(raw, name=cfg.name) == cfg


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_json_file_round_trip_and_resolve(tmp_path, preset):
    cfg = PRESETS[preset]
    directory = tmp_path / preset
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert ModelConfig.from_json_file(directory / "config.json") == cfg  # name taken from the directory
    assert resolve_config(str(directory)) == cfg
    assert resolve_config(preset) is cfg


def test_kimi_k2_round_trip():
    cfg = ModelConfig.from_hf_dict(KIMI_K2_CONFIG, name="kimi-k2")
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())), name="kimi-k2") == cfg


# -- real-looking configs ----------------------------------------------------------------------------------
def test_kimi_k2_config_every_field(tmp_path):
    directory = tmp_path / "Kimi-K2-Instruct"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(KIMI_K2_CONFIG, indent=2))
    cfg = ModelConfig.from_json_file(directory / "config.json")
    assert_is_kimi_k2(cfg)
    assert cfg.name == "Kimi-K2-Instruct"
    assert cfg.qk_head_dim == 192
    assert cfg.has_moe and not cfg.is_moe_layer(0) and cfg.is_moe_layer(1) and cfg.is_moe_layer(60)
    mscale = 0.1 * 1.0 * math.log(32.0) + 1.0
    assert cfg.mscale == pytest.approx(mscale, rel=1e-15)
    assert cfg.softmax_scale == pytest.approx(mscale * mscale / math.sqrt(192), rel=1e-15)


def test_kimi_k2_later_release_yarn_factor_64():
    raw = kimi_k2()
    raw["rope_scaling"] = dict(raw["rope_scaling"], factor=64.0)
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.rope_scaling.factor == 64.0
    assert cfg.mscale == pytest.approx(0.1 * math.log(64.0) + 1.0, rel=1e-15)


def test_kimi_k25_text_config_nesting():
    raw = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": kimi_k2(),
        "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27, "patch_size": 14},
        "media_placeholder_token_id": 163605,
    }
    assert_is_kimi_k2(ModelConfig.from_hf_dict(raw))


def test_rope_parameters_form_yarn():
    raw = kimi_k2()
    del raw["rope_theta"], raw["rope_scaling"]
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                              "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                              "original_max_position_embeddings": 4096}
    assert_is_kimi_k2(ModelConfig.from_hf_dict(raw))


def test_rope_parameters_form_default_rope():
    raw = kimi_k2()
    del raw["rope_theta"], raw["rope_scaling"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 123456.0}
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.rope_theta == 123456.0
    assert cfg.rope_scaling is None
    assert cfg.mscale == 1.0
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-15)


def test_null_q_lora_rank_and_yarn_defaults():
    raw = kimi_k2(q_lora_rank=None, rope_scaling={"type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 2048})
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.q_lora_rank is None
    assert cfg.rope_scaling == YarnScaling(factor=4.0, original_max_position_embeddings=2048, beta_fast=32.0,
                                           beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0)
    assert cfg.mscale == 1.0  # mscale_all_dim 0: no attention-temperature change


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny"].hidden_size = 64


# -- validation --------------------------------------------------------------------------------------------
def assert_config_error(raw, *words):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(raw)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)
    return message


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_experts_not_divisible_by_groups():
    assert_config_error(kimi_k2(n_group=5, topk_group=2), "n_routed_experts", "n_group", "384", "5")


def test_odd_rope_dim():
    assert_config_error(kimi_k2(qk_rope_head_dim=63), "qk_rope_head_dim", "63")


def test_more_experts_per_token_than_experts():
    assert_config_error(kimi_k2(num_experts_per_tok=385), "num_experts_per_tok", "385")


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"])
def test_missing_required_field(field):
    raw = kimi_k2()
    del raw[field]
    assert_config_error(raw, field)


@pytest.mark.parametrize("kind", ["linear", "dynamic", "llama3"])
def test_non_yarn_rope_scaling(kind):
    assert_config_error(kimi_k2(rope_scaling={"type": kind, "factor": 2.0}), "rope_scaling", kind)


def test_non_yarn_rope_parameters():
    raw = kimi_k2()
    del raw["rope_scaling"]
    raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    assert_config_error(raw, "longrope")


@pytest.mark.parametrize("field", ["factor", "original_max_position_embeddings"])
def test_yarn_missing_field(field):
    scaling = dict(KIMI_K2_CONFIG["rope_scaling"])
    del scaling[field]
    assert_config_error(kimi_k2(rope_scaling=scaling), "yarn", field)


@pytest.mark.parametrize("changes, words", [
    (dict(topk_group=2), ("topk_group",)),
    (dict(n_group=8, topk_group=1, num_experts_per_tok=49), ("num_experts_per_tok", "topk_group")),
    (dict(moe_layer_freq=2), ("moe_layer_freq",)),
    (dict(scoring_func="softmax"), ("scoring_func", "softmax")),
    (dict(topk_method="group_limited_greedy"), ("topk_method",)),
    (dict(hidden_size=0), ("hidden_size",)),
    (dict(hidden_size=7168.0), ("hidden_size",)),
    (dict(num_attention_heads=True), ("num_attention_heads",)),
    (dict(q_lora_rank=0), ("q_lora_rank",)),
    (dict(first_k_dense_replace=62), ("first_k_dense_replace",)),
    (dict(n_shared_experts=-1), ("n_shared_experts",)),
    (dict(intermediate_size=0), ("intermediate_size",)),
    (dict(rope_theta=0.0), ("rope_theta",)),
    (dict(rms_norm_eps=-1e-6), ("rms_norm_eps",)),
    (dict(max_position_embeddings=None), ("max_position_embeddings",)),
    (dict(text_config=[1, 2]), ("text_config",)),
])
def test_other_validation_errors(changes, words):
    assert_config_error(kimi_k2(**changes), *words)


def test_yarn_factor_below_one():
    scaling = dict(KIMI_K2_CONFIG["rope_scaling"], factor=0.5)
    assert_config_error(kimi_k2(rope_scaling=scaling), "rope_scaling.factor")


def test_config_json_not_an_object():
    assert_config_error([KIMI_K2_CONFIG], "JSON object")


def test_bad_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 7168,')
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON") as info:
        ModelConfig.from_json_file(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_binary_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json_file(path)


def test_missing_json_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_json_file(tmp_path / "config.json")


def test_unknown_model_name():
    with pytest.raises(ConfigError, match="not a model name"):
        resolve_config("no-such-preset-or-directory")


# -- wrong types and values in config.json are ConfigErrors ------------------------------------------


@pytest.mark.parametrize("changes", [
    dict(rope_scaling="yarn"),                 # AttributeError: 'str' object has no attribute 'get'
    dict(rope_theta=None),                     # TypeError from float(None)
    dict(first_k_dense_replace=None),          # TypeError from 0 <= None
    dict(n_routed_experts="384"),              # TypeError from "384" < 1
    dict(rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                       "mscale_all_dim": None}),  # TypeError from float(None)
])
def test_wrong_types_raise_config_error(changes):
    with pytest.raises(ConfigError):
        ModelConfig.from_hf_dict(kimi_k2(**changes))


@pytest.mark.parametrize("changes", [
    dict(first_k_dense_replace=0.5),           # accepted: not checked to be an integer
    dict(routed_scaling_factor=0.0),           # accepted: would zero every routed expert
    dict(n_group=0),                           # silently becomes 1 (`or 1`)
    dict(norm_topk_prob="false"),              # becomes True via bool("false")
])
def test_wrong_values_rejected(changes):
    with pytest.raises(ConfigError):
        ModelConfig.from_hf_dict(kimi_k2(**changes))


def test_rope_interleave_false_is_refused():
    # half-split RoPE would silently compute other attention scores than the engine's adjacent pairs
    assert_config_error(kimi_k2(rope_interleave=False), "rope_interleave")
    assert ModelConfig.from_hf_dict(kimi_k2(rope_interleave=True)) == ModelConfig.from_hf_dict(kimi_k2())


def test_shipped_model_resolves_by_name():
    cfg = resolve_config("pycoder-mini")
    # every architectural feature of DeepSeek-V3 / Kimi K2 is on in the shipped trained target
    assert cfg.q_lora_rank is not None and cfg.rope_scaling is not None and cfg.n_shared_experts >= 1
    assert cfg.n_group > 1 and cfg.topk_group < cfg.n_group and cfg.first_k_dense_replace >= 1
    assert cfg.scoring_func == "sigmoid" and cfg.topk_method == "noaux_tc"
    with pytest.raises(ConfigError, match="pycoder-mini"):
        resolve_config("no-such-model")
