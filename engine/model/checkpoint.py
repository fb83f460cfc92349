"""Model checkpoints: HF-layout directories (config.json + safetensors) written and read with numpy.

A directory holds ``config.json`` and either ``model.safetensors`` or shards ``model-0000i-of-0000N.safetensors``
with ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).
Tensors are F32, F16 or BF16, or, as DeepSeek-V3 / Kimi K2 ship them, FP8: the linear projection weights
stored as F8_E4M3 with a float32 ``NAME_scale_inv`` (``...weight_scale_inv``) of one scale per 128x128 block,
shape [ceil(out/128), ceil(in/128)]; the weight is ``fp8 * scale_inv`` blockwise. Everything loads as float32.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Optional

import numpy as np

from kdspec.engine.model.config import PRESETS, ModelConfig, model_names, shipped_model_dir
from kdspec.engine.model.safetensors_io import (
    SafetensorsError,
    SafetensorsFile,
    e4m3_to_float32,
    float32_to_e4m3,
    save_file,
)
from kdspec.engine.model.tokenizer import tokenizer_for
from kdspec.engine.model.weights import SeededWeights, WeightError, check_weights

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = (128, 128)
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": list(FP8_BLOCK)}
_SAVE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# The weights DeepSeek-V3 stores in FP8: attention projections, dense MLP, routed and shared experts
# (not embeddings, lm_head, norms, the router gate or its bias).
_FP8_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj"
                         r"|o_proj)|mlp\.((experts\.\d+|shared_experts)\.)?(gate_proj|up_proj|down_proj))\.weight$")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message is one line naming the file or tensor."""


def is_fp8_weight(name: str) -> bool:
    """Whether DeepSeek-V3's FP8 checkpoints store this HF parameter as block-scaled F8_E4M3."""
    return _FP8_WEIGHT.match(name) is not None


# -- FP8 block quantisation ---------------------------------------------------------------------------------
def _expand_blocks(scale_inv: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """[ceil(out/bo), ceil(in/bi)] -> [out, in]: each block's scale repeated over its elements."""
    return np.repeat(np.repeat(scale_inv, block[0], axis=0), block[1], axis=1)[:shape[0], :shape[1]]


def quantize_fp8_blocks(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (uint8 e4m3 codes [out, in], float32 scale_inv [ceil(out/bo), ceil(in/bi)]).

    Each block's largest magnitude maps to 448 (e4m3's largest finite value), as DeepSeek's quantiser does.
    """
    out_dim, in_dim = w.shape
    rows, cols = math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1])
    padded = np.zeros((rows * block[0], cols * block[1]), dtype=np.float32)
    padded[:out_dim, :in_dim] = np.abs(w)
    amax = padded.reshape(rows, block[0], cols, block[1]).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    codes = float32_to_e4m3(w.astype(np.float32) / _expand_blocks(scale_inv, w.shape, block))
    return codes, scale_inv


def dequantize_fp8_blocks(codes: np.ndarray, scale_inv: np.ndarray,
                          block: tuple[int, int] = FP8_BLOCK) -> np.ndarray:
    """uint8 e4m3 codes [out, in] and float32 scale_inv [ceil(out/bo), ceil(in/bi)] -> float32 [out, in]."""
    return e4m3_to_float32(codes) * _expand_blocks(scale_inv.astype(np.float32), codes.shape, block)


# -- saving -------------------------------------------------------------------------------------------------
def save_model(directory: str | Path, cfg: ModelConfig, weights: dict[str, np.ndarray], dtype: str = "float32",
               max_shard_bytes: Optional[int] = None, fp8: bool = False) -> list[Path]:
    """Write an HF-layout checkpoint of ``weights`` (HF name -> float array) into ``directory``.

    dtype: "float32" | "bfloat16" | "float16" for every tensor not stored as FP8. fp8: store the linear
    projection weights (``is_fp8_weight``) as block-scaled F8_E4M3 plus ``NAME_scale_inv``. Tensors beyond
    ``max_shard_bytes`` (stored bytes) go to several shards plus an index. Checkpoint files of an earlier save
    in the directory are removed first, so the loader never mixes two saves. Returns the safetensors paths.
    """
    if dtype not in _SAVE_DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported (one of {', '.join(_SAVE_DTYPES)})")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    try:
        check_weights(cfg, weights)
    except WeightError as e:
        raise CheckpointError(str(e)) from None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.match(old.name):
            old.unlink()

    # Units that stay together in one shard: a tensor, or an FP8 weight with its scale_inv.
    units: list[list[tuple[str, np.ndarray, str]]] = []
    for name, w in weights.items():
        if fp8 and is_fp8_weight(name):
            codes, scale_inv = quantize_fp8_blocks(np.asarray(w, dtype=np.float32))
            units.append([(name, codes, "F8_E4M3"), (name + SCALE_SUFFIX, scale_inv, "F32")])
        else:
            units.append([(name, np.asarray(w, dtype=np.float32), _SAVE_DTYPES[dtype])])
    itemsize = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}
    shards: list[list[tuple[str, np.ndarray, str]]] = [[]]
    shard_bytes = 0
    for unit in units:
        unit_bytes = sum(a.size * itemsize[d] for _, a, d in unit)
        if max_shard_bytes is not None and shards[-1] and shard_bytes + unit_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].extend(unit)
        shard_bytes += unit_bytes

    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = dtype
    if fp8:
        hf["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (directory / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")

    names = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total_size, weight_map = 0, {}
    for file_name, shard in zip(names, shards):
        total_size += save_file(directory / file_name, {n: a for n, a, _ in shard}, {n: d for n, _, d in shard},
                                metadata={"format": "pt"})  # transformers refuses safetensors without format=pt
        weight_map.update({n: file_name for n, _, _ in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [directory / n for n in names]


# -- loading ------------------------------------------------------------------------------------------------
def _checkpoint_dir(model: str | Path) -> Path:
    path = shipped_model_dir(model) or Path(model)
    if not path.is_dir():
        raise CheckpointError(f"unknown model {str(model)!r}: not a model name ({', '.join(model_names())}) nor a "
                              f"directory")
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path}: no {CONFIG_FILE}")
    return path


def model_directory(model: str | Path) -> Optional[Path]:
    """The directory a model name or path reads from (None for a random preset)."""
    if isinstance(model, str) and model in PRESETS:
        return None
    return _checkpoint_dir(model)


def model_tokenizer(model: str | Path):
    """The tokenizer of a model: the directory's tokenizer.json (byte-level BPE, opening with config.json's
    bos_token_id) where it has one, else byte-level (the presets, checkpoints saved without one)."""
    directory = model_directory(model)
    bos = None
    if directory is not None:
        try:
            bos = json.loads((directory / CONFIG_FILE).read_text()).get("bos_token_id")
        except (OSError, ValueError, AttributeError, RecursionError):
            bos = None  # load_model_config reports a bad config.json; the tokenizer needs no more than this
        bos = bos if isinstance(bos, int) and not isinstance(bos, bool) and bos >= 0 else None
    return tokenizer_for(directory, bos)


def load_model_config(model: str | Path) -> ModelConfig:
    """The config of a preset name, shipped model or checkpoint directory, without touching any tensor."""
    if isinstance(model, str) and model in PRESETS:
        return PRESETS[model]
    return ModelConfig.from_json_file(_checkpoint_dir(model) / CONFIG_FILE)


def _tensor_files(directory: Path) -> dict[str, str]:
    """HF name -> safetensors file name, from the index, the single file, or every *.safetensors."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError, OSError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index_path}: weight_map must map tensor names to file names")
        for file_name in sorted(set(weight_map.values())):
            # lexically, not by resolving: a hub cache's shards are symlinks into a blobs folder beside it
            parts = PurePath(file_name).parts
            if not parts or PurePath(file_name).is_absolute() or ".." in parts:
                raise CheckpointError(f"{index_path}: shard {file_name!r} lies outside the checkpoint directory")
        for file_name in sorted(set(weight_map.values())):
            if not (directory / file_name).is_file():
                raise CheckpointError(f"{index_path}: references missing shard {file_name}")
        return weight_map
    if (directory / SINGLE_FILE).exists() and not (directory / SINGLE_FILE).is_file():
        raise CheckpointError(f"{directory / SINGLE_FILE}: not a file")
    files = [SINGLE_FILE] if (directory / SINGLE_FILE).is_file() else \
        sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"{directory}: no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file")
    names: dict[str, str] = {}
    for file_name in files:
        with SafetensorsFile(directory / file_name) as f:
            for name in f.keys():
                if name in names:
                    raise CheckpointError(f"{directory}: tensor {name} is in both {names[name]} and {file_name}")
                names[name] = file_name
    return names


def _raw_config(directory: Path) -> dict:
    """config.json as a dict (ModelConfig.from_json_file read it already: it is a JSON object)."""
    return json.loads((directory / CONFIG_FILE).read_text())


def _section(raw: dict, key: str, directory: Path) -> dict:
    """A JSON-object field of config.json ({} when absent or null); CheckpointError when it is something else."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{directory / CONFIG_FILE}: {key} must be a JSON object, got {value!r:.60}")
    return value


def _fp8_block(directory: Path) -> tuple[int, int]:
    raw = _raw_config(directory)
    quant = _section(raw, "quantization_config", directory) or \
        _section(_section(raw, "text_config", directory), "quantization_config", directory)
    block = quant.get("weight_block_size", FP8_BLOCK)
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise CheckpointError(f"{directory / CONFIG_FILE}: quantization_config.weight_block_size must be two "
                              f"positive integers, got {block!r}")
    return int(block[0]), int(block[1])


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def _mtp_layers(directory: Path, cfg: ModelConfig) -> range:
    """The layer indices of DeepSeek-V3's multi-token-prediction module, which it ships as extra layers after
    the last one (not used here)."""
    raw = _raw_config(directory)
    extra = (_section(raw, "text_config", directory) or raw).get("num_nextn_predict_layers") or 0
    if isinstance(extra, bool) or not isinstance(extra, int) or not 0 <= extra <= cfg.num_hidden_layers:
        raise CheckpointError(f"{directory / CONFIG_FILE}: num_nextn_predict_layers must be an integer in "
                              f"0..num_hidden_layers ({cfg.num_hidden_layers}; DeepSeek-V3 ships 1), got {extra!r:.40}")
    return range(cfg.num_hidden_layers, cfg.num_hidden_layers + extra)


def _layer(name: str) -> int:
    found = _LAYER.match(name)
    return int(found.group(1)) if found else -1


def _check_counts(directory: Path, cfg: ModelConfig, names: dict[str, str]) -> None:
    """config.json's layer and expert counts against the tensors the checkpoint holds, before the expected
    tensor names are built (a config claiming 10^9 layers would build billions of them)."""
    layers = max((_layer(n) for n in names), default=-1) + 1
    if cfg.num_hidden_layers > layers:
        raise CheckpointError(f"{directory / CONFIG_FILE}: num_hidden_layers is {cfg.num_hidden_layers}, but the "
                              f"checkpoint holds tensors of {layers} layers")
    if cfg.has_moe:
        experts = max((int(m.group(1)) for m in map(_EXPERT.match, names) if m), default=-1) + 1
        if cfg.n_routed_experts > experts:
            raise CheckpointError(f"{directory / CONFIG_FILE}: n_routed_experts is {cfg.n_routed_experts}, but "
                                  f"the checkpoint holds tensors of {experts} experts")


def _open(files: dict[str, SafetensorsFile], directory: Path, file_name: str) -> SafetensorsFile:
    if file_name not in files:
        files[file_name] = SafetensorsFile(directory / file_name)
    return files[file_name]


def _read_weights(directory: Path, cfg: ModelConfig, files: dict[str, SafetensorsFile]) -> dict[str, np.ndarray]:
    names = _tensor_files(directory)
    mtp = _mtp_layers(directory, cfg)
    names = {n: f for n, f in names.items() if _layer(n) not in mtp}
    _check_counts(directory, cfg, names)
    block = _fp8_block(directory)
    infos = {}
    for name, file_name in names.items():
        f = _open(files, directory, file_name)
        if name not in f:
            raise CheckpointError(f"{f.path}: lacks tensor {name} (named in {INDEX_FILE})")
        infos[name] = f.info(name)
    # Names and shapes first, from the headers alone (zero-copy placeholders): a wrong checkpoint fails
    # before any tensor is read.
    placeholders = {n: np.broadcast_to(np.float32(0), i.shape) for n, i in infos.items()
                    if not n.endswith(SCALE_SUFFIX)}
    try:
        check_weights(cfg, placeholders)
    except WeightError as e:
        raise CheckpointError(f"{directory}: {e}") from None

    weights: dict[str, np.ndarray] = {}
    for name, info in infos.items():
        scale_name = name + SCALE_SUFFIX
        if name.endswith(SCALE_SUFFIX):
            if name[:-len(SCALE_SUFFIX)] not in infos:
                raise CheckpointError(f"{directory}: {name} has no weight {name[:-len(SCALE_SUFFIX)]}")
            continue  # read with its weight
        f = files[names[name]]
        if info.dtype == "F8_E4M3":
            if scale_name not in infos:
                raise CheckpointError(f"{directory}: FP8 tensor {name} has no {scale_name}")
            scale_inv = files[names[scale_name]].get_float32(scale_name)
            weights[name] = _dequantize(name, f.get(name), scale_inv, block)
        elif scale_name in infos:
            raise CheckpointError(f"{directory}: {scale_name} scales tensor {name}, which is {info.dtype}, "
                                  "not F8_E4M3")
        else:
            # F32 stays a read-only view of the map; BF16 / F16 are widened into new float32 arrays.
            weights[name] = f.get(name) if info.dtype == "F32" else f.get_float32(name)
    return weights


def _dequantize(name: str, codes: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    if codes.ndim != 2:
        raise CheckpointError(f"FP8 tensor {name} has shape {codes.shape}, block scaling needs 2 dimensions")
    expected = (math.ceil(codes.shape[0] / block[0]), math.ceil(codes.shape[1] / block[1]))
    if scale_inv.shape != expected:
        raise CheckpointError(f"{name}{SCALE_SUFFIX} has shape {scale_inv.shape}, expected {expected} for "
                              f"{name} {codes.shape} in {block[0]}x{block[1]} blocks")
    return dequantize_fp8_blocks(codes, scale_inv, block)


def load_model(model: str | Path, seed: int = 0) -> tuple[ModelConfig, Mapping[str, np.ndarray]]:
    """A preset name (seeded random weights: a SeededWeights, each tensor drawn when first used), a shipped
    model's name or a checkpoint directory -> (config, float32 weights by HF name).

    Weights read from F32 files are read-only views of the memory-mapped file (copy before writing in place).
    """
    if isinstance(model, str) and model in PRESETS:
        cfg = PRESETS[model]
        return cfg, SeededWeights(cfg, seed)
    directory = _checkpoint_dir(model)
    cfg = ModelConfig.from_json_file(directory / CONFIG_FILE)
    files: dict[str, SafetensorsFile] = {}
    try:
        weights = _read_weights(directory, cfg, files)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    finally:
        for f in files.values():
            f.close()
    return cfg, weights
