"""Seeded weights (engine/model/weights.py): a counter-based draw that numpy on the host and torch on a GPU compute
bit for bit alike, so a preset's tensors can be drawn where they are used."""
import zlib

import numpy as np
import pytest

from kdspec.engine.model import weights as W
from kdspec.engine.model.config import PRESETS
from kdspec.engine.model.weights import SeededWeights, WeightError, check_weights, random_tensor, random_weights

MASK = (1 << 64) - 1


def splitmix64_finalize(z: int) -> int:
    """splitmix64's output mix on a Python int (Steele, Lea and Flood 2014), written out independently."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def expected_element(seed: int, name: str, index: int, std: float, mean: float) -> np.float32:
    """Element ``index`` of a seeded tensor by the documented recipe: key = mix(mix(seed) ^ crc32(name)); bits =
    mix(key + (index + 1) * golden gamma); the sum of its four 16-bit parts centred (Irwin-Hall), times one
    float32 scale, plus the mean."""
    key = splitmix64_finalize(splitmix64_finalize(seed) ^ zlib.crc32(name.encode()))
    bits = splitmix64_finalize((key + (index + 1) * 0x9E3779B97F4A7C15) & MASK)
    parts = sum((bits >> shift) & 0xFFFF for shift in (0, 16, 32, 48)) - 2 * 0xFFFF
    scale = np.float32(std / np.sqrt((65536.0 ** 2 - 1) / 3))
    value = np.float32(parts) * scale
    return value + np.float32(mean) if mean else value


@pytest.mark.parametrize("name, seed", [("model.embed_tokens.weight", 0), ("lm_head.weight", 3),
                                        ("model.layers.1.input_layernorm.weight", 2 ** 64 - 1),
                                        ("model.layers.2.mlp.experts.5.down_proj.weight", 12345)])
def test_elements_follow_the_recipe(name, seed):
    shape = PRESETS["small"].vocab_size, 48  # any 2-D shape: the recipe reads only the flat index
    std, mean = W.init_affine(name, shape)
    tensor = random_tensor(name, shape, seed)
    for index in (0, 1, 47, 48, 1000, shape[0] * shape[1] - 1):
        assert tensor.reshape(-1)[index] == expected_element(seed, name, index, std, mean), index


def test_values_do_not_depend_on_pieces_chunks_or_workers(monkeypatch):
    cfg = PRESETS["small"]
    whole = random_weights(cfg, 5, workers=1)
    monkeypatch.setattr(W, "CHUNK_ELEMENTS", 1000)
    monkeypatch.setattr(W._Numpy, "piece", 77)
    pieces = random_weights(cfg, 5, workers=3)
    assert list(whole) == list(pieces)
    assert all(np.array_equal(whole[k], pieces[k]) for k in whole)


def test_distribution_per_tensor_kind():
    cfg = PRESETS["small"]
    weights = random_weights(cfg, 1)
    embed = weights["model.embed_tokens.weight"]
    assert abs(float(embed.mean())) < 0.02 and abs(float(embed.std()) - 1.0) < 0.02
    assert np.abs(embed).max() <= 2 * np.sqrt(3.0) + 1e-6  # four uniforms: bounded at 2 sqrt(3) std
    linear = weights["model.layers.0.self_attn.o_proj.weight"]
    assert abs(float(linear.std()) * np.sqrt(linear.shape[1]) - 1.0) < 0.05
    head = weights["lm_head.weight"]
    assert abs(float(head.std()) * np.sqrt(head.shape[1]) - 2.0) < 0.05
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert abs(float(norm.mean()) - 1.0) < 0.05 and 0.05 < float(norm.std()) < 0.15
    # distinct streams: tensors of one shape, seeds, and the rows of one tensor do not repeat each other
    a, b = weights["model.layers.2.mlp.experts.0.up_proj.weight"], weights["model.layers.2.mlp.experts.1.up_proj.weight"]
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, random_weights(cfg, 2)["model.layers.2.mlp.experts.0.up_proj.weight"])
    assert len({row.tobytes() for row in embed}) == embed.shape[0]


def test_seeded_weights_draw_lazily_and_check_without_drawing():
    cfg = PRESETS["tiny"]
    weights = SeededWeights(cfg, 4)
    check_weights(cfg, weights)
    assert not weights._host  # nothing drawn by the check
    assert W.parameter_count(weights) == sum(int(np.prod(s)) for s in W.parameter_shapes(cfg).values())
    assert not weights._host
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    assert weights[name] is weights[name]  # drawn once, kept
    assert set(weights._host) == {name}
    full = weights.materialize(2)
    assert full[name] is weights[name]
    assert all(np.array_equal(full[k], v) for k, v in random_weights(cfg, 4).items())
    with pytest.raises(KeyError):
        weights["model.layers.9.nothing.weight"]
    with pytest.raises(WeightError, match="do not fit"):
        check_weights(PRESETS["small"], weights)


def test_presets_load_as_seeded_weights():
    from kdspec.engine.model.checkpoint import load_model

    cfg, weights = load_model("small", seed=6)
    assert isinstance(weights, SeededWeights) and weights.cfg == cfg and weights.seed == 6
    assert np.array_equal(weights["lm_head.weight"], random_tensor("lm_head.weight", (cfg.vocab_size, 48), 6))


def test_torch_draws_the_host_bits():
    torch = pytest.importorskip("torch")
    weights = SeededWeights(PRESETS["small"], 7)
    for name in weights:
        assert weights.draw(torch, name, "cpu").numpy().tobytes() == weights[name].tobytes(), name
    rows = weights.draw(torch, "model.embed_tokens.weight", "cpu", rows=(123, 201)).numpy()
    assert np.array_equal(rows, weights["model.embed_tokens.weight"][123:201])


@pytest.mark.gpu
def test_the_gpu_draws_the_host_bits():
    """Every tensor of two presets, and row ranges of k2-mini's biggest tensors (flat indices past 2^30), drawn
    on the GPU equal the host's bit for bit."""
    import torch

    for preset in ("tiny", "small"):
        weights = SeededWeights(PRESETS[preset], 11)
        for name in weights:
            assert weights.draw(torch, name).cpu().numpy().tobytes() == weights[name].tobytes(), (preset, name)
    cfg = PRESETS["k2-mini"]
    weights = SeededWeights(cfg, 0)
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.3.mlp.experts.31.down_proj.weight"):
        shape = weights.shapes[name]
        for start in (0, shape[0] - 300):
            rows = (start, start + 300)
            host = np.empty((300,) + shape[1:], np.float32)
            W._fill_rows(W._Numpy(), host, name, shape, 0, *rows)
            assert np.array_equal(weights.draw(torch, name, rows=rows).cpu().numpy(), host), (name, rows)
