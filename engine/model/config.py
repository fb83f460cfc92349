"""Model configuration: one frozen dataclass read from an HF ``config.json``, and the presets.

Dimension letters used across the project (as in DeepSeek-V3 ``inference/model.py``):
d hidden_size, h num_attention_heads, c kv_lora_rank, q q_lora_rank, n qk_nope_head_dim,
r qk_rope_head_dim, v v_head_dim, e n_routed_experts, k num_experts_per_tok, f moe_intermediate_size,
F intermediate_size (dense MLP), V vocab_size.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


class ConfigError(ValueError):
    """A model configuration that cannot be used; the message is one line naming the field."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (``rope_scaling`` with type ``yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 / Kimi K2 architecture, field names as in the HF config.

    # embedding / output
    vocab_size, hidden_size, rms_norm_eps, tie_word_embeddings, max_position_embeddings
    # blocks
    num_hidden_layers; the first ``first_k_dense_replace`` use a dense SwiGLU MLP of ``intermediate_size``
    # mla
    num_attention_heads, q_lora_rank (None: q = q_proj(x)), kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim
    # moe
    n_routed_experts, num_experts_per_tok, n_shared_experts, moe_intermediate_size,
    routed_scaling_factor, scoring_func (sigmoid), topk_method (noaux_tc), n_group, topk_group,
    norm_topk_prob
    # rope
    rope_theta, rope_scaling (YarnScaling or None)
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    first_k_dense_replace: int
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    rope_theta: float = 10000.0
    rope_scaling: Optional[YarnScaling] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    name: str = "custom"

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{field} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ConfigError(f"q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(f"first_k_dense_replace must be in 0..num_hidden_layers, got {self.first_k_dense_replace}")
        if self.first_k_dense_replace > 0 and self.intermediate_size < 1:
            raise ConfigError(f"intermediate_size must be positive with dense layers, got {self.intermediate_size}")
        if self.has_moe:
            if self.n_routed_experts < 1 or self.moe_intermediate_size < 1:
                raise ConfigError("n_routed_experts and moe_intermediate_size must be positive in MoE layers")
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise ConfigError(f"num_experts_per_tok must be in 1..n_routed_experts ({self.n_routed_experts}), "
                                  f"got {self.num_experts_per_tok}")
            if self.n_shared_experts < 0:
                raise ConfigError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                raise ConfigError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group "
                                  f"({self.n_group})")
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"topk_group must be in 1..n_group ({self.n_group}), got {self.topk_group}")
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                raise ConfigError("group-limited routing needs at least 2 experts per group (group score = top-2 sum)")
            if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
                raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in "
                                  f"topk_group groups")
        if self.scoring_func != "sigmoid":
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not supported (only 'sigmoid')")
        if self.topk_method not in ("noaux_tc", "greedy"):
            raise ConfigError(f"topk_method {self.topk_method!r} is not supported (noaux_tc)")
        if self.has_moe and self.routed_scaling_factor <= 0:
            raise ConfigError(f"routed_scaling_factor must be positive, got {self.routed_scaling_factor}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError("rope_theta and rms_norm_eps must be positive")
        if self.rope_scaling is not None:
            if self.rope_scaling.factor < 1:
                raise ConfigError(f"rope_scaling.factor must be >= 1, got {self.rope_scaling.factor}")
            if self.rope_scaling.original_max_position_embeddings < 1:
                raise ConfigError("rope_scaling.original_max_position_embeddings must be positive")

    # -- derived sizes -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_moe(self) -> bool:
        return self.first_k_dense_replace < self.num_hidden_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def mscale(self) -> float:
        """YaRN attention-temperature factor; the softmax scale is multiplied by its square."""
        ys = self.rope_scaling
        if ys is None or ys.mscale_all_dim == 0 or ys.factor <= 1:
            return 1.0
        return 0.1 * ys.mscale_all_dim * math.log(ys.factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.mscale ** 2

    # -- (de)serialisation -------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("rope_scaling", "name")}
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        d["model_type"] = "deepseek_v3"
        d["moe_layer_freq"] = 1
        d["rope_scaling"] = None if self.rope_scaling is None else {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "custom") -> "ModelConfig":
        cfg = _text_config(raw)
        theta_source, rope_scaling = _rope_fields(cfg)
        if cfg.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"moe_layer_freq {cfg['moe_layer_freq']!r} is not supported (only 1)")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ConfigError(f"config lacks required field {missing[0]}")
        kwargs: dict[str, Any] = {k: _integer(cfg, k, None) for k in required}
        q_lora = cfg.get("q_lora_rank")
        kwargs.update(
            q_lora_rank=None if q_lora is None else _integer(cfg, "q_lora_rank", None),
            n_routed_experts=_integer(cfg, "n_routed_experts", 0),
            num_experts_per_tok=_integer(cfg, "num_experts_per_tok", 0),
            n_shared_experts=_integer(cfg, "n_shared_experts", 0),
            moe_intermediate_size=_integer(cfg, "moe_intermediate_size", 0),
            intermediate_size=_integer(cfg, "intermediate_size", 0),
            first_k_dense_replace=_integer(cfg, "first_k_dense_replace", 0),
            routed_scaling_factor=_number(cfg, "routed_scaling_factor", 1.0),
            scoring_func=cfg.get("scoring_func", "sigmoid"),
            topk_method=cfg.get("topk_method", "noaux_tc"),
            n_group=_integer(cfg, "n_group", 1),
            topk_group=_integer(cfg, "topk_group", 1),
            norm_topk_prob=_boolean(cfg, "norm_topk_prob", True),
            rope_theta=_number(theta_source, "rope_theta", 10000.0),
            rope_scaling=rope_scaling,
            rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
            tie_word_embeddings=_boolean(cfg, "tie_word_embeddings", False),
            max_position_embeddings=_integer(cfg, "max_position_embeddings", 4096),
            name=name,
        )
        return cls(**kwargs)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to be a model configuration") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None
        return cls.from_hf_dict(raw, name=path.parent.name or "custom")


def _field_value(source: dict, key: str, default, where: str):
    """The field's value, the default when absent; an explicit null is an error (q_lora_rank excepted)."""
    value = source.get(key, default)
    if value is None:
        raise ConfigError(f"{where}{key} must be set, got null")
    return value


def _integer(source: dict, key: str, default, section: str = "") -> int:
    where = f"{section}." if section else ""
    value = _field_value(source, key, default, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}{key} must be an integer, got {value!r}")
    return value


def _number(source: dict, key: str, default, section: str = "") -> float:
    where = f"{section}." if section else ""
    value = _field_value(source, key, default, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}{key} must be a finite number, got {value!r}")
    return float(value)


def _boolean(source: dict, key: str, default) -> bool:
    value = _field_value(source, key, default, "")
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _text_config(raw: Any) -> dict[str, Any]:
    """The dict of the text model's fields: raw itself, or its ``text_config`` (Kimi K2.5/K2.6 nest them)."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    cfg = raw.get("text_config", raw)
    if not isinstance(cfg, dict):
        raise ConfigError("text_config must be a JSON object")
    return cfg


def _rope_fields(cfg: dict[str, Any]) -> tuple[dict[str, Any], Optional[YarnScaling]]:
    """(the dict that holds rope_theta, YarnScaling or None) from ``rope_scaling``, or from
    ``rope_parameters`` (newer transformers write rope settings there, rope_theta inside)."""
    rope_params = cfg.get("rope_parameters")
    if rope_params is not None and not isinstance(rope_params, dict):
        raise ConfigError("rope_parameters must be a JSON object")
    # The engine rotates adjacent pairs, the official checkpoints' layout, which transformers reads when
    # rope_interleave is true (its default); a model trained with it false rotates the two halves instead.
    if cfg.get("rope_interleave", True) is not True:
        raise ConfigError(f"rope_interleave {cfg.get('rope_interleave')!r} is not supported: the engine's RoPE "
                          f"rotates adjacent pairs (rope_interleave true)")
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope_params is not None:
        scaling, scaling_field = rope_params, "rope_parameters"
    else:
        scaling_field = "rope_scaling"
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{scaling_field} must be a JSON object or null, got {scaling!r}")
    theta_source = cfg if "rope_theta" in cfg else (rope_params or {})
    return theta_source, _yarn_scaling(scaling, scaling_field) if scaling else None


def _yarn_scaling(scaling: dict[str, Any], field: str) -> Optional[YarnScaling]:
    """YarnScaling of a rope scaling dict of type yarn; None for the default type (or none given)."""
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ConfigError(f"{field} type {kind!r} is not supported (only yarn)")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ConfigError(f"{field} of type yarn lacks {key}")
    return YarnScaling(
        factor=_number(scaling, "factor", None, field),
        original_max_position_embeddings=_integer(scaling, "original_max_position_embeddings", None, field),
        beta_fast=_number(scaling, "beta_fast", 32.0, field),
        beta_slow=_number(scaling, "beta_slow", 1.0, field),
        mscale=_number(scaling, "mscale", 1.0, field),
        mscale_all_dim=_number(scaling, "mscale_all_dim", 0.0, field),
    )


_YARN_K2 = YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                       mscale=1.0, mscale_all_dim=1.0)

PRESETS: dict[str, ModelConfig] = {
    # Small enough for the CUDA simulator; YaRN on, one dense layer then MoE with one shared expert.
    "tiny": ModelConfig(
        name="tiny", vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
        intermediate_size=48, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        norm_topk_prob=True, rope_theta=10000.0,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        rms_norm_eps=1e-6, max_position_embeddings=256),
    # A second shape: more layers, q_lora_rank null, two dense layers, group-limited routing, no YaRN.
    "small": ModelConfig(
        name="small", vocab_size=300, hidden_size=48, num_hidden_layers=4, num_attention_heads=3,
        q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=16,
        intermediate_size=64, first_k_dense_replace=2, routed_scaling_factor=1.5, n_group=4, topk_group=2,
        norm_topk_prob=False, rope_theta=50000.0, rope_scaling=None, rms_norm_eps=1e-5,
        max_position_embeddings=512),
    # Kimi K2 per-layer dimensions and vocabulary; few layers and fewer experts so it fits a GPU quickly.
    "k2-mini": ModelConfig(
        name="k2-mini", vocab_size=163840, hidden_size=7168, num_hidden_layers=4, num_attention_heads=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=32, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
        intermediate_size=18432, first_k_dense_replace=1, routed_scaling_factor=2.827, n_group=1, topk_group=1,
        norm_topk_prob=True, rope_theta=50000.0, rope_scaling=_YARN_K2, rms_norm_eps=1e-6,
        max_position_embeddings=131072),
}


# Trained models shipped in the package, by name: HF model directories (config.json, model.safetensors,
# tokenizer.json, manifest.json: how each was made).
SHIPPED_MODELS_DIR = Path(__file__).resolve().parent / "presets"
SHIPPED_MODELS = ("pycoder-mini",)


def shipped_model_dir(model) -> Optional[Path]:
    """The directory of a shipped trained model (``pycoder-mini``), or None for any other name."""
    return SHIPPED_MODELS_DIR / model if isinstance(model, str) and model in SHIPPED_MODELS else None


def model_names() -> tuple[str, ...]:
    """Every name ``--model`` takes besides a directory: random presets, then shipped trained models."""
    return tuple(PRESETS) + SHIPPED_MODELS


def resolve_config(model: str) -> ModelConfig:
    """A preset name, a shipped model's name, or a model directory holding ``config.json``."""
    if model in PRESETS:
        return PRESETS[model]
    path = shipped_model_dir(model) or Path(model)
    if path.is_dir():
        return ModelConfig.from_json_file(path / "config.json")
    raise ConfigError(f"unknown model {model!r}: not a model name ({', '.join(model_names())}) nor a model "
                      f"directory")
