"""A DFlash-style block drafter on disk: ``drafter/`` beside its target model (config.json, model.safetensors,
manifest.json). The math is engine/golden/drafter.py; the device version engine/device/drafter.py.

config.json: architecture "kdtree-dflash", hidden_size d (the target's), num_layers, num_heads, latent_dim c,
rope_dim r, intermediate_size f, block_size (bonus + L drafted positions), target_layers (indices into the
target's hidden states as transformers numbers them: i < num_hidden_layers is the residual stream entering
layer i, i == num_hidden_layers the final normed state), rms_norm_eps, rope_theta.
Tensors (float32 after load): fc.weight [d, n*d], fc_norm.weight [d], mask_embedding [d], norm.weight [d], and
per layer k ``layers.k.``: input_norm, q_lat [h*c, d], q_pe [h*r, d], kv [c+r, d], kv_ctx [c+r, d], kv_norm [c],
o_proj [d, h*c], post_norm, gate_proj [f, d], up_proj [f, d], down_proj [d, f] (each ``.weight``).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kdspec.engine.model.safetensors_io import SafetensorsError, SafetensorsFile

ARCHITECTURE = "kdtree-dflash"
DRAFTER_DIR = "drafter"


class DrafterError(ValueError):
    """A drafter directory that cannot be used with its target; one line."""


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    latent_dim: int
    rope_dim: int
    intermediate_size: int
    block_size: int
    target_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def num_depths(self) -> int:
        return self.block_size - 1

    @property
    def softmax_scale(self) -> float:
        return (self.latent_dim + self.rope_dim) ** -0.5

    def check_target(self, target_cfg) -> None:
        if self.hidden_size != target_cfg.hidden_size:
            raise DrafterError(f"drafter hidden_size {self.hidden_size} != the target's {target_cfg.hidden_size}")
        bad = [i for i in self.target_layers if not 0 <= i <= target_cfg.num_hidden_layers]
        if bad:
            raise DrafterError(f"drafter target_layers {list(self.target_layers)} name hidden state {bad[0]}, but "
                               f"the target has 0..{target_cfg.num_hidden_layers}")

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        d, h, c, r, f = self.hidden_size, self.num_heads, self.latent_dim, self.rope_dim, self.intermediate_size
        shapes = {"fc.weight": (d, len(self.target_layers) * d), "fc_norm.weight": (d,),
                  "mask_embedding": (d,), "norm.weight": (d,)}
        for k in range(self.num_layers):
            p = f"layers.{k}."
            shapes.update({p + "input_norm.weight": (d,), p + "q_lat.weight": (h * c, d),
                           p + "q_pe.weight": (h * r, d), p + "kv.weight": (c + r, d),
                           p + "kv_ctx.weight": (c + r, d), p + "kv_norm.weight": (c,),
                           p + "o_proj.weight": (d, h * c), p + "post_norm.weight": (d,),
                           p + "gate_proj.weight": (f, d), p + "up_proj.weight": (f, d),
                           p + "down_proj.weight": (d, f)})
        return shapes


def _config_from(raw) -> DrafterConfig:
    if not isinstance(raw, dict) or raw.get("architecture") != ARCHITECTURE:
        raise DrafterError(f"config.json: architecture must be {ARCHITECTURE!r}")
    try:
        cfg = DrafterConfig(**{name: raw[name] for name in ("hidden_size", "num_layers", "num_heads", "latent_dim",
                                                            "rope_dim", "intermediate_size", "block_size")},
                            target_layers=tuple(int(i) for i in raw["target_layers"]),
                            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                            rope_theta=float(raw.get("rope_theta", 10000.0)))
    except (KeyError, TypeError, ValueError) as e:
        raise DrafterError(f"config.json: bad or missing field ({type(e).__name__}: {e})") from None
    ints = (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.latent_dim, cfg.rope_dim, cfg.intermediate_size,
            cfg.block_size)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in ints) or cfg.rope_dim % 2 \
            or cfg.block_size < 2 or not cfg.target_layers:
        raise DrafterError("config.json: sizes must be positive integers, rope_dim even, block_size >= 2, "
                           "target_layers non-empty")
    return cfg


def load_drafter(directory: str | Path) -> tuple[DrafterConfig, dict[str, np.ndarray], str]:
    """(config, float32 weights by name, sha256 of model.safetensors) of a drafter directory."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise DrafterError(f"{directory}: no drafter here (config.json missing)")
    try:
        cfg = _config_from(json.loads((directory / "config.json").read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise DrafterError(f"{directory / 'config.json'}: not JSON ({type(e).__name__})") from None
    path = directory / "model.safetensors"
    try:
        with SafetensorsFile(path) as f:
            weights = {name: np.array(f.get_float32(name)) for name in f.keys()}
    except (SafetensorsError, OSError) as e:
        raise DrafterError(f"{path}: {e}") from None
    for name, shape in cfg.parameter_shapes().items():
        if name not in weights:
            raise DrafterError(f"{path}: missing tensor {name}")
        if weights[name].shape != shape:
            raise DrafterError(f"{path}: {name} has shape {list(weights[name].shape)}, expected {list(shape)}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return cfg, weights, digest
