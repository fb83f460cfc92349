"""Parameter names and shapes in the Hugging Face layout, and seeded random initialisation.

A model's weights are a plain ``dict[str, np.ndarray]`` keyed by the HF names below; linear weights are
``[out_features, in_features]`` as in ``torch.nn.Linear``. Everything else (the golden reference, the device
model, the checkpoint reader and writer) speaks this dictionary.
"""
from __future__ import annotations

import os
import zlib
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


# Tensors above this many elements are drawn in row chunks, each from its own generator, so that one big tensor
# (k2-mini's embedding and lm_head: 1.17 G elements each, ~15 s on one core) spreads over every core.
CHUNK_ELEMENTS = 1 << 24


def _tensor_rng(seed: int, name: str, chunk: int | None = None) -> np.random.Generator:
    # One stream per tensor (per row chunk of a big one): any tensor can be regenerated alone, in any order.
    key = [seed, zlib.crc32(name.encode())]
    return np.random.default_rng(key if chunk is None else key + [chunk])


def _row_chunks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of a tensor drawn in chunks; one range (the whole tensor) up to CHUNK_ELEMENTS."""
    size = int(np.prod(shape, dtype=np.int64))
    if size <= CHUNK_ELEMENTS or len(shape) < 2:
        return [(0, shape[0] if shape else 1)]
    rows = max(1, CHUNK_ELEMENTS // (size // shape[0]))
    return [(start, min(start + rows, shape[0])) for start in range(0, shape[0], rows)]


def _fill(out: np.ndarray, name: str, seed: int, chunk: int | None, chunks: int) -> None:
    """Draw ``out`` (a whole tensor, or row chunk ``chunk`` of ``chunks``) in place: norms near 1, gate bias
    spread so it changes routing, embedding ~ N(0, 1), linears ~ N(0, 1/fan_in)."""
    rng = _tensor_rng(seed, name, chunk if chunks > 1 else None)
    rng.standard_normal(out.shape, dtype=np.float32, out=out)
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        out *= np.float32(0.1)
        out += np.float32(1.0)
    elif name.endswith("e_score_correction_bias"):
        out *= np.float32(0.2)
    elif name != "model.embed_tokens.weight":
        # lm_head a little hotter so logits have margins well above fp32 rounding.
        gain = 2.0 if name == "lm_head.weight" else 1.0
        out *= np.float32(gain / np.sqrt(out.shape[-1]))


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype=np.float32) -> np.ndarray:
    """One seeded parameter (the same values random_weights gives it)."""
    out = np.empty(shape, dtype=np.float32)
    chunks = _row_chunks(shape)
    for i, (start, stop) in enumerate(chunks):
        _fill(out[start:stop], name, seed, i, len(chunks))
    return out.astype(dtype, copy=False)


def random_weights(cfg: ModelConfig, seed: int = 0, dtype=np.float32,
                   workers: int | None = None) -> dict[str, np.ndarray]:
    """All parameters, seeded; float32 by default (the golden widens to float64 itself).

    Each tensor (each row chunk of a tensor over CHUNK_ELEMENTS) draws from its own generator, so the work runs
    in ``workers`` threads (default: one per CPU; numpy's generators release the GIL for bulk draws) with the
    same values as one thread gives: k2-mini's 28 GiB take minutes on one core.
    """
    shapes = parameter_shapes(cfg)
    tensors = {name: np.empty(shape, dtype=np.float32) for name, shape in shapes.items()}
    jobs = []
    for name, shape in shapes.items():
        chunks = _row_chunks(shape)
        jobs += [(name, i, len(chunks), start, stop) for i, (start, stop) in enumerate(chunks)]
    jobs.sort(key=lambda job: -(job[4] - job[3]) * int(np.prod(shapes[job[0]][1:], dtype=np.int64)))  # big first

    def run(job) -> None:
        name, i, chunks, start, stop = job
        _fill(tensors[name][start:stop], name, seed, i, chunks)

    workers = min(len(jobs), workers or os.cpu_count() or 1)
    if workers <= 1:
        for job in jobs:
            run(job)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, jobs))
    return {name: tensor.astype(dtype, copy=False) for name, tensor in tensors.items()}


class WeightError(ValueError):
    """A checkpoint whose tensors do not fit the config; the message names the tensor."""


def check_weights(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Raise WeightError naming the first missing, unexpected or misshapen tensor."""
    shapes = parameter_shapes(cfg)
    for name, shape in shapes.items():
        if name not in weights:
            raise WeightError(f"checkpoint lacks tensor {name} (expected shape {shape})")
        if tuple(weights[name].shape) != shape:
            raise WeightError(f"tensor {name} has shape {tuple(weights[name].shape)}, config expects {shape}")
    extra = sorted(set(weights) - set(shapes))
    if extra:
        raise WeightError(f"checkpoint has tensor {extra[0]} that the config does not use")
