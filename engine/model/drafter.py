"""The kdtree-dflash block drafter: its shape (``config.json``), the exact forward it computes, its files.

A drafter lives in ``drafter/`` beside its target (config.json, model.safetensors, manifest.json). It is trained
by engine/train/drafter_train.py (torch) and run by the engine (engine/golden/drafter.py, float64), both from
this text. Dimension letters: d target hidden, c latent_dim, r rope_dim, h num_heads,
f intermediate_size, V vocab, L = block_size - 1 drafted depths, P the committed prefix length, n the number
of target layers tapped (3 for the shipped drafter). All math in float32 (float64 in the reference); the
weights are stored in bf16 (``model.safetensors``, the names below) and widened to float32.

Inputs of one draft
    h_t^i for the committed target rows t = 0 .. P-1 and each i in ``target_layers``: the target's residual
    stream after decoder layer i-1 (i = 0: the embedding output), i.e. the input of decoder layer i, BEFORE the
    final norm. For i < num_hidden_layers this is transformers' ``output_hidden_states`` entry i; for
    i = num_hidden_layers transformers returns the final-normed state instead, which is NOT what is used here.
    b, the bonus token at position P (the target's own prediction, not in the cache).
    The target's ``embed_tokens`` [V, d] and ``lm_head`` [V, d] are shared and frozen (not in the drafter file).

Context rows (t < P):  f_t = RMSNorm_fc_norm( fc.weight [d, n*d] . concat_i(h_t^i) )   (concat in list order)
Block rows (j = 0..L):  x_0 = embed_tokens[b]; x_j = mask_embedding [d] for j >= 1; position P + j.

Layer k (tensor prefix ``layers.k.``), for every block row:
    a = RMSNorm_input_norm(x)
    q_lat = a . q_lat.weight^T -> [L+1, h, c]      (q_lat.weight [h*c, d])
    q_pe  = rope(a . q_pe.weight^T -> [L+1, h, r], position P + j)       (q_pe.weight [h*r, d])
    one key/value row per token, shared by all heads (MLA-style; value = the normed latent):
        block row j:   [u | p] = a_j . kv.weight^T        (kv.weight [c + r, d])
        context row t: [u | p] = f_t . kv_ctx.weight^T    (kv_ctx.weight [c + r, d])
        latent = RMSNorm_kv_norm(u) [c]  (kv_norm.weight [c], the same norm for both kinds of row)
        kpe    = rope(p, the row's position: t for context row t, P + j for block row j) [r]
    scores[j, head, t] = (q_lat[j, head] . latent_t + q_pe[j, head] . kpe_t) * (c + r) ** -0.5
    block row j sees every context row t < P and every block row (bidirectional within the block);
    softmax over those keys in float32; o_lat[j, head] = sum_t p[j, head, t] * latent_t  [L+1, h, c]
    x = x + o_proj.weight . flatten_{head, c}(o_lat)      (o_proj.weight [d, h*c], head-major)
    m = RMSNorm_post_norm(x)
    x = x + down_proj.weight . (silu(gate_proj.weight . m) * (up_proj.weight . m))
        (gate_proj.weight, up_proj.weight [f, d]; down_proj.weight [d, f])
Output: for j = 1..L, logits_j = lm_head . RMSNorm_norm(x_j) (norm.weight [d]); row j predicts the token at
    position P + j. The draft per depth j is the top-K of log_softmax(logits_j), sorted descending.
Top-level tensors: fc.weight, fc_norm.weight, mask_embedding [d], norm.weight. No biases anywhere. (The trainer
folds a fitted softmax temperature into norm.weight; nothing else changes.)

RMSNorm_w(x) = x * rsqrt(mean(x^2) + rms_norm_eps) * w. RoPE: rotate adjacent pairs (x[2i], x[2i+1]) by angle
position * rope_theta ** (-2i / r), i = 0..r/2-1 (plain RoPE, no YaRN): (x0 cos - x1 sin, x0 sin + x1 cos), as
engine/golden/layers.py apply_rope. Attention is the engine's MLA latent attention (mla_attention_latent) with
a drafter cache of [c | r] rows per layer: the context rows (which depend only on committed target rows, so they
can be appended as rows commit) followed by the L + 1 block rows.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from kdspec.engine.model.safetensors_io import SafetensorsError, SafetensorsFile

DRAFTER_DIR = "drafter"


class DrafterError(ValueError):
    """A drafter directory or shape that cannot be used (with its target); one line."""


ARCHITECTURE = "kdtree-dflash"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
LAYER_TENSORS = ("input_norm", "q_lat", "q_pe", "kv", "kv_ctx", "kv_norm", "o_proj", "post_norm", "gate_proj",
                 "up_proj", "down_proj")


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's shape, as config.json holds it (plus "architecture").

    # block: block_size = 1 bonus row + L drafted depths
    # layers: num_layers blocks of MLA-style attention (num_heads, latent_dim c, rope_dim r) and SwiGLU
      (intermediate_size f); hidden_size d = the target's
    # context: target_layers (indices into the target's hidden states, see the module docstring)
    # numerics: rms_norm_eps, rope_theta (plain RoPE)
    # target: {"name", "model_safetensors_sha256", "vocab_size", "num_hidden_layers"} of the target trained on
    """

    hidden_size: int
    target_layers: tuple[int, ...]
    num_layers: int = 2
    num_heads: int = 4
    latent_dim: int = 64
    rope_dim: int = 16
    intermediate_size: int = 512
    block_size: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise DrafterError(f"block size must be an integer >= 2 (bonus + at least one drafted depth), got "
                             f"{self.block_size!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "latent_dim", "rope_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                raise DrafterError(f"drafter {name} must be positive, got {getattr(self, name)}")
        if self.rope_dim % 2:
            raise DrafterError(f"drafter rope_dim must be even, got {self.rope_dim}")
        layers = self.target_layers
        if not layers or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0:
            raise DrafterError(f"target_layers must be non-negative and strictly increasing, got {list(layers)}")
        top = self.target.get("num_hidden_layers")
        if top is not None and layers[-1] > top:
            raise DrafterError(f"target_layers {list(layers)} exceed the target's {top} layers")

    @property
    def num_depths(self) -> int:
        """L: drafted positions per block."""
        return self.block_size - 1

    @property
    def softmax_scale(self) -> float:
        return (self.latent_dim + self.rope_dim) ** -0.5

    def check_target(self, target_cfg) -> None:
        """DrafterError unless this drafter fits ``target_cfg`` (hidden size, tapped layers)."""
        if self.hidden_size != target_cfg.hidden_size:
            raise DrafterError(f"drafter hidden_size {self.hidden_size} != the target's {target_cfg.hidden_size}")
        if self.target_layers[-1] > target_cfg.num_hidden_layers:
            raise DrafterError(f"drafter target_layers {list(self.target_layers)} exceed the target's "
                               f"{target_cfg.num_hidden_layers} layers")

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of model.safetensors, in file order ([out, in] linears)."""
        d, h, c, r, f = self.hidden_size, self.num_heads, self.latent_dim, self.rope_dim, self.intermediate_size
        shapes = {"fc.weight": (d, len(self.target_layers) * d), "fc_norm.weight": (d,), "mask_embedding": (d,)}
        per_layer = {"input_norm.weight": (d,), "q_lat.weight": (h * c, d), "q_pe.weight": (h * r, d),
                     "kv.weight": (c + r, d), "kv_ctx.weight": (c + r, d), "kv_norm.weight": (c,),
                     "o_proj.weight": (d, h * c), "post_norm.weight": (d,), "gate_proj.weight": (f, d),
                     "up_proj.weight": (f, d), "down_proj.weight": (d, f)}
        for k in range(self.num_layers):
            shapes.update({f"layers.{k}.{name}": shape for name, shape in per_layer.items()})
        shapes["norm.weight"] = (d,)
        return shapes

    def parameter_count(self) -> int:
        total = 0
        for shape in self.parameter_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    def to_dict(self) -> dict:
        out = {"architecture": ARCHITECTURE, **asdict(self)}
        out["target_layers"] = list(self.target_layers)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterConfig":
        if data.get("architecture") != ARCHITECTURE:
            raise DrafterError(f"drafter config: architecture {data.get('architecture')!r} is not {ARCHITECTURE!r}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, directory: Path) -> None:
        (Path(directory) / CONFIG_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "DrafterConfig":
        path = Path(directory) / CONFIG_FILE
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
            if not isinstance(data, dict):
                raise TypeError(f"a JSON {type(data).__name__}, not an object")
            return cls.from_dict(data)
        except DrafterError:
            raise
        except (FileNotFoundError, NotADirectoryError):
            raise DrafterError(f"{path}: no drafter config") from None
        except OSError as e:
            raise DrafterError(f"{path}: cannot read the drafter config ({e.strerror or e})") from None
        except (ValueError, TypeError, AttributeError, RecursionError) as e:  # JSON, UTF-8, a field's type
            first = (str(e).splitlines() or [""])[0][:200]
            raise DrafterError(f"{path}: not a drafter config ({type(e).__name__}: {first})") from None


def load_drafter(directory: str | Path) -> tuple[DrafterConfig, dict[str, np.ndarray], str]:
    """(config, float32 weights by name, sha256 of model.safetensors) of a drafter directory."""
    directory = Path(directory)
    cfg = DrafterConfig.load(directory)
    path = directory / WEIGHTS_FILE
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
