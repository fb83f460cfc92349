"""Parameter names and shapes in the Hugging Face layout, and seeded random initialisation.

A model's weights are a mapping of HF names (below) to float32 arrays; linear weights are ``[out_features,
in_features]`` as in ``torch.nn.Linear``. Everything else (the golden reference, the device model, the checkpoint
reader and writer) speaks this mapping: a plain dict for a checkpoint, a SeededWeights for a random preset, whose
tensors are drawn where they are used (the host, or the GPU that holds them) with the same bits either way.
"""
from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kdspec.engine.model.config import ModelConfig


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, HF name -> shape, in a stable order."""
    d, h, c = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for layer in range(cfg.num_hidden_layers):
        p = layer_prefix(layer)
        shapes[f"{p}.input_layernorm.weight"] = (d,)
        if cfg.q_lora_rank is None:
            shapes[f"{p}.self_attn.q_proj.weight"] = (h * (n + r), d)
        else:
            shapes[f"{p}.self_attn.q_a_proj.weight"] = (cfg.q_lora_rank, d)
            shapes[f"{p}.self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            shapes[f"{p}.self_attn.q_b_proj.weight"] = (h * (n + r), cfg.q_lora_rank)
        shapes[f"{p}.self_attn.kv_a_proj_with_mqa.weight"] = (c + r, d)
        shapes[f"{p}.self_attn.kv_a_layernorm.weight"] = (c,)
        shapes[f"{p}.self_attn.kv_b_proj.weight"] = (h * (n + v), c)
        shapes[f"{p}.self_attn.o_proj.weight"] = (d, h * v)
        shapes[f"{p}.post_attention_layernorm.weight"] = (d,)
        if cfg.is_moe_layer(layer):
            shapes[f"{p}.mlp.gate.weight"] = (cfg.n_routed_experts, d)
            shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            f = cfg.moe_intermediate_size
            for e in range(cfg.n_routed_experts):
                shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (f, d)
                shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (f, d)
                shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (d, f)
            if cfg.n_shared_experts:
                fs = f * cfg.n_shared_experts
                shapes[f"{p}.mlp.shared_experts.gate_proj.weight"] = (fs, d)
                shapes[f"{p}.mlp.shared_experts.up_proj.weight"] = (fs, d)
                shapes[f"{p}.mlp.shared_experts.down_proj.weight"] = (d, fs)
        else:
            fd = cfg.intermediate_size
            shapes[f"{p}.mlp.gate_proj.weight"] = (fd, d)
            shapes[f"{p}.mlp.up_proj.weight"] = (fd, d)
            shapes[f"{p}.mlp.down_proj.weight"] = (d, fd)
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


# Seeded weights are a counter-based draw: element i of tensor ``name`` is a pure function of (seed, name, i), in
# 64-bit integer arithmetic and one float32 multiply (and, for norms, one add). numpy on the host and torch on a
# GPU compute the same bits, so a preset's weights can be drawn on the device that uses them: k2-mini's 7.5 G
# parameters take seconds to draw and copy on the host and milliseconds on an H200.
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants, as signed int64 (torch has no uint64 multiply)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_PARTS_MEAN = 2 * 0xFFFF  # four 16-bit uniforms summed (Irwin-Hall): mean 2 * 65535, variance (65536^2 - 1) / 3
_PARTS_STD = float(np.sqrt((65536.0 ** 2 - 1) / 3))
# Elements drawn in one piece: bounds the int64 temporaries (8 bytes an element, a few alive) and is the unit of
# work the host threads share.
CHUNK_ELEMENTS = 1 << 24


def _srl(z, bits: int):
    """Logical right shift of int64 values (numpy and torch shift arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _finalize(z):
    """splitmix64's output mix, in place on an int64 array (numpy or torch; both wrap on overflow)."""
    z ^= _srl(z, 30)
    z *= _MIX1
    z ^= _srl(z, 27)
    z *= _MIX2
    z ^= _srl(z, 31)
    return z


def _tensor_key(seed: int, name: str) -> int:
    # seed is validated < 2^64 by the callers; as int64 bits for the mix.
    seed = int(seed) % (1 << 64)
    z = np.array([seed - (1 << 64) if seed >= 1 << 63 else seed], dtype=np.int64)
    z = _finalize(z)
    z ^= zlib.crc32(name.encode())
    return int(_finalize(z)[0])


def init_affine(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(std, mean) of a seeded parameter: norms near 1, gate bias spread so it changes routing, embedding
    ~ N(0, 1), linears ~ N(0, 1/fan_in) (lm_head twice that std, so logits have margins well above fp32
    rounding)."""
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return 0.1, 1.0
    if name.endswith("e_score_correction_bias"):
        return 0.2, 0.0
    if name == "model.embed_tokens.weight":
        return 1.0, 0.0
    return (2.0 if name == "lm_head.weight" else 1.0) / float(np.sqrt(shape[-1])), 0.0


class _Numpy:
    piece = 1 << 16  # elements per pass: the temporaries stay in the core's cache (4x faster than 1 << 24)

    @staticmethod
    def arange(start: int, stop: int):
        return np.arange(start, stop, dtype=np.int64)

    @staticmethod
    def to_float32(a):
        return a.astype(np.float32)

    @staticmethod
    def scalar(value: float):
        return np.float32(value)


class _Torch:
    piece = 1 << 26  # elements per pass: few, large launches; 2.5 GB of int64 temporaries at most

    def __init__(self, torch, device):
        self.torch, self.device = torch, device

    def arange(self, start: int, stop: int):
        return self.torch.arange(start, stop, dtype=self.torch.int64, device=self.device)

    def to_float32(self, a):
        return a.to(self.torch.float32)

    def scalar(self, value: float):
        # a float32 tensor, not a Python float: the product is then float32 x float32 as in numpy
        return self.torch.tensor(float(np.float32(value)), dtype=self.torch.float32, device=self.device)


def _draw_range(xp, key: int, start: int, stop: int, std: float, mean: float):
    """Flat elements start..stop-1 of a tensor with ``key``: float32 [stop - start]."""
    z = xp.arange(start + 1, stop + 1)
    z *= _GAMMA
    z += key
    z = _finalize(z)
    parts = (z & 0xFFFF) + ((z >> 16) & 0xFFFF) + ((z >> 32) & 0xFFFF) + ((z >> 48) & 0xFFFF)
    parts -= _PARTS_MEAN
    out = xp.to_float32(parts)  # exact: |parts| < 2^18
    out *= xp.scalar(std / _PARTS_STD)
    if mean:
        out += xp.scalar(mean)
    return out


def _row_chunks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of at most CHUNK_ELEMENTS elements each (at least one row)."""
    if len(shape) < 2:
        return [(0, shape[0] if shape else 1)]
    row = int(np.prod(shape[1:], dtype=np.int64))
    rows = max(1, CHUNK_ELEMENTS // max(row, 1))
    return [(start, min(start + rows, shape[0])) for start in range(0, shape[0], rows)]


def _fill_rows(xp, out, name: str, shape: tuple[int, ...], seed: int, start: int, stop: int) -> None:
    """Rows start..stop-1 of the seeded tensor into ``out`` (a [stop - start, ...] array of xp's kind)."""
    row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    std, mean = init_affine(name, shape)
    key, flat = _tensor_key(seed, name), out.reshape(-1)  # a view: ``out`` is whole rows of a contiguous tensor
    for first in range(0, (stop - start) * row, xp.piece):
        last = min(first + xp.piece, (stop - start) * row)
        flat[first:last] = _draw_range(xp, key, start * row + first, start * row + last, std, mean)


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype=np.float32) -> np.ndarray:
    """One seeded parameter, drawn on the host (the same values random_weights and SeededWeights give it)."""
    shape = tuple(shape)
    out = np.empty(shape, dtype=np.float32)
    xp = _Numpy()
    for start, stop in _row_chunks(shape):
        _fill_rows(xp, out[start:stop], name, shape, seed, start, stop)
    return out.astype(dtype, copy=False)


def torch_random_tensor(torch, name: str, shape: tuple[int, ...], seed: int, device="cuda", rows=None):
    """The same parameter (or its rows ``rows`` = (start, stop)) as a float32 torch tensor drawn on ``device``,
    bit for bit random_tensor's values."""
    shape = tuple(shape)
    start, stop = rows if rows is not None else (0, shape[0] if shape else 1)
    out = torch.empty((stop - start,) + shape[1:], dtype=torch.float32, device=device)
    xp = _Torch(torch, device)
    for first, last in _row_chunks((stop - start,) + shape[1:]):
        _fill_rows(xp, out[first:last], name, shape, seed, start + first, start + last)
    return out


class SeededWeights(Mapping):
    """A preset's seeded weights, HF name -> float32 array, drawn where they are used: ``weights[name]`` on the
    host (kept once drawn), ``draw(torch, name)`` on a GPU (not kept), ``materialize()`` every tensor on the host
    in threads. check_weights accepts it without drawing: it is made from the config's own shapes."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.cfg, self.seed = cfg, int(seed)
        self.shapes = parameter_shapes(cfg)
        self._host: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.shapes:
            raise KeyError(name)
        with self._lock:
            tensor = self._host.get(name)
        if tensor is None:
            tensor = random_tensor(name, self.shapes[name], self.seed)
            with self._lock:
                tensor = self._host.setdefault(name, tensor)
        return tensor

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def draw(self, torch, name: str, device="cuda", rows=None):
        """Tensor ``name`` (rows ``rows`` = (start, stop) of it) as float32 on torch ``device``: the host values."""
        return torch_random_tensor(torch, name, self.shapes[name], self.seed, device, rows)

    def materialize(self, workers: int | None = None) -> dict[str, np.ndarray]:
        """Every tensor on the host, drawn in ``workers`` threads (default one per CPU; numpy releases the GIL
        for the integer passes) in row chunks: the same values as one thread gives."""
        with self._lock:
            missing = [name for name in self.shapes if name not in self._host]
        tensors = {name: np.empty(self.shapes[name], dtype=np.float32) for name in missing}
        jobs = [(name, start, stop) for name in missing for start, stop in _row_chunks(self.shapes[name])]
        jobs.sort(key=lambda job: -(job[2] - job[1]) * int(np.prod(self.shapes[job[0]][1:], dtype=np.int64)))
        xp = _Numpy()

        def run(job) -> None:
            name, start, stop = job
            _fill_rows(xp, tensors[name][start:stop], name, self.shapes[name], self.seed, start, stop)

        workers = min(len(jobs), workers or os.cpu_count() or 1)
        if workers <= 1:
            for job in jobs:
                run(job)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(run, jobs))
        with self._lock:
            for name, tensor in tensors.items():
                self._host.setdefault(name, tensor)
            return {name: self._host[name] for name in self.shapes}


def random_weights(cfg: ModelConfig, seed: int = 0, dtype=np.float32,
                   workers: int | None = None) -> dict[str, np.ndarray]:
    """All parameters, seeded, on the host: float32 by default (the golden widens to float64 itself). Drawn in
    ``workers`` threads (SeededWeights.materialize), the values independent of them."""
    weights = SeededWeights(cfg, seed).materialize(workers)
    return {name: tensor.astype(dtype, copy=False) for name, tensor in weights.items()}


def parameter_count(weights) -> int:
    """Elements over every tensor, without drawing a SeededWeights."""
    if isinstance(weights, SeededWeights):
        return sum(int(np.prod(shape, dtype=np.int64)) for shape in weights.shapes.values())
    return sum(int(w.size) for w in weights.values())


class WeightError(ValueError):
    """A checkpoint whose tensors do not fit the config; the message names the tensor."""


def check_weights(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Raise WeightError naming the first missing, unexpected or misshapen tensor."""
    if isinstance(weights, SeededWeights):
        if weights.cfg != cfg:
            raise WeightError(f"seeded weights of model {weights.cfg.name} do not fit model {cfg.name}")
        return
    shapes = parameter_shapes(cfg)
    for name, shape in shapes.items():
        if name not in weights:
            raise WeightError(f"checkpoint lacks tensor {name} (expected shape {shape})")
        if tuple(weights[name].shape) != shape:
            raise WeightError(f"tensor {name} has shape {tuple(weights[name].shape)}, config expects {shape}")
    extra = sorted(set(weights) - set(shapes))
    if extra:
        raise WeightError(f"checkpoint has tensor {extra[0]} that the config does not use")
