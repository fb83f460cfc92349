"""Checkpoints: the safetensors reader/writer, BF16 / F16 / FP8-e4m3 number formats, save_model / load_model.

References are independent of the code under test: safetensors files are parsed and written here with raw
struct + json, e4m3 is decoded by its formula and encoded by brute force over the grid, bf16 rounding picks
the nearer of the two neighbouring bf16 values in float64.
"""
import json
import math
import mmap
import struct

import numpy as np
import pytest

from kdspec.engine.model.checkpoint import (
    FP8_QUANTIZATION_CONFIG,
    CheckpointError,
    is_fp8_weight,
    load_model,
    load_model_config,
    save_model,
)
from kdspec.engine.model.config import PRESETS, ModelConfig
from kdspec.engine.model.safetensors_io import (
    SafetensorsError,
    SafetensorsFile,
    bf16_bits_to_float32,
    e4m3_to_float32,
    float32_to_bf16_bits,
    float32_to_e4m3,
    load_file,
    save_file,
)
from kdspec.engine.model.weights import parameter_shapes, random_weights

TINY = PRESETS["tiny"]

# Dimensions past 128 so FP8 weights span several 128x128 blocks, some of them partial.
BLOCKY = ModelConfig(
    name="blocky", vocab_size=64, hidden_size=136, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=130,
    kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=2,
    num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=40, intermediate_size=260,
    first_k_dense_replace=1)


# -- independent references --------------------------------------------------------------------------------
RAW_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F8_E4M3": "u1", "I64": "<i8", "I32": "<i4"}


def raw_read(path):
    """A minimal safetensors parser: name -> (dtype string, stored numpy array), and the metadata."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    metadata = header.pop("__metadata__", None)
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        array = np.frombuffer(blob[8 + n + begin:8 + n + end], dtype=RAW_DTYPES[entry["dtype"]])
        out[name] = (entry["dtype"], array.reshape(entry["shape"]))
    return out, metadata


def raw_write(path, tensors, reverse_data=False):
    """A minimal safetensors writer: name -> (dtype string, array already in storage form). Unpadded header;
    reverse_data lays the bytes out in the opposite order of the header entries."""
    names = list(tensors)[::-1] if reverse_data else list(tensors)
    offsets, data, pos = {}, b"", 0
    for name in names:
        raw = np.ascontiguousarray(tensors[name][1]).astype(RAW_DTYPES[tensors[name][0]]).tobytes()
        offsets[name] = [pos, pos + len(raw)]
        data += raw
        pos += len(raw)
    header = {name: {"dtype": tensors[name][0], "shape": list(np.shape(tensors[name][1])),
                     "data_offsets": offsets[name]} for name in tensors}
    raw_header = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw_header)) + raw_header + data)


def e4m3_formula(code):
    """float8 e4m3fn by its definition: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return math.nan
    magnitude = 2.0 ** -6 * (m / 8) if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -magnitude if s else magnitude


FORMULA_TABLE = np.array([e4m3_formula(c) for c in range(256)])


def e4m3_brute_force(x):
    """Nearest e4m3 code by exhaustive search over the non-negative finite grid; ties to the even code;
    |x| > 448 saturates; sign kept."""
    grid = FORMULA_TABLE[:127]  # codes 0..126
    out = []
    for v in np.asarray(x, dtype=np.float64).ravel():
        if math.isnan(v):
            out.append(None)
            continue
        a = min(abs(v), 448.0)
        dist = np.abs(grid - a)
        best = np.flatnonzero(dist == dist.min())
        code = int(best[0]) if len(best) == 1 else int(next(c for c in best if c % 2 == 0))
        out.append(code | (0x80 if math.copysign(1.0, v) < 0 else 0))
    return out


def bf16_round_reference(x):
    """float32 -> float32 holding the nearest bf16 value (ties to an even bf16 mantissa), for finite x."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    toward_zero = bits & np.uint32(0xFFFF0000)
    away = toward_zero + np.uint32(0x10000)
    lo, hi = toward_zero.view(np.float32).astype(np.float64), away.view(np.float32).astype(np.float64)
    # Past the largest bf16, round as if the exponent were unbounded (IEEE): the next value is 2^128 -> inf.
    hi = np.where(np.isinf(hi), np.copysign(2.0 ** 128, hi), hi)
    d_lo, d_hi = np.abs(x.astype(np.float64) - lo), np.abs(hi - x.astype(np.float64))
    lo_is_even = ((toward_zero >> np.uint32(16)) & np.uint32(1)) == 0
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & lo_is_even)
    return np.where(pick_lo, toward_zero, away).view(np.float32)


# -- number formats ----------------------------------------------------------------------------------------
def test_e4m3_decode_all_codes_match_formula():
    decoded = e4m3_to_float32(np.arange(256, dtype=np.uint8)).astype(np.float64)
    np.testing.assert_array_equal(decoded, FORMULA_TABLE)  # NaN where NaN, -0.0 == 0.0
    assert np.isnan(decoded).sum() == 2 and np.isnan(decoded[[0x7F, 0xFF]]).all()
    assert np.nanmax(decoded) == 448.0 and np.nanmin(decoded) == -448.0
    assert decoded[1] == 2.0 ** -9  # smallest subnormal


def test_e4m3_encode_every_finite_code_round_trips():
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=np.uint8)
    values = FORMULA_TABLE[codes]
    np.testing.assert_array_equal(float32_to_e4m3(values.astype(np.float32)), codes)
    np.testing.assert_array_equal(float32_to_e4m3(values), codes)  # float64 input too


def test_e4m3_encode_midpoints_round_to_even():
    grid = FORMULA_TABLE[:127]
    midpoints = (grid[:-1] + grid[1:]) / 2  # exactly representable in float32 (5 significant bits)
    assert np.all(midpoints.astype(np.float32) == midpoints)
    encoded = float32_to_e4m3(midpoints.astype(np.float32))
    lower = np.arange(126)
    expected = np.where(lower % 2 == 0, lower, lower + 1)
    np.testing.assert_array_equal(encoded, expected)
    np.testing.assert_array_equal(float32_to_e4m3(-midpoints.astype(np.float32)), expected | 0x80)
    # Just off the midpoint goes to the nearer neighbour.
    above = np.nextafter(midpoints.astype(np.float32), np.float32(np.inf))
    np.testing.assert_array_equal(float32_to_e4m3(above), lower + 1)


def test_e4m3_encode_random_values_match_brute_force():
    rng = np.random.default_rng(7)
    x = np.concatenate([
        rng.standard_normal(3000) * np.exp2(rng.uniform(-12, 10, 3000)),  # subnormals .. saturation
        np.array([0.0, -0.0, 448.0, 449.0, 464.0, 465.0, 1e30, -1e30, 2.0 ** -10, 2.0 ** -10 * 1.0001,
                  -(2.0 ** -10), 2.0 ** -6, 3 * 2.0 ** -11]),
    ]).astype(np.float32)
    expected = e4m3_brute_force(x)
    np.testing.assert_array_equal(float32_to_e4m3(x), np.array(expected, dtype=np.uint8))


def test_e4m3_encode_specials():
    x = np.array([np.inf, -np.inf, np.nan, -0.0], dtype=np.float32)
    codes = float32_to_e4m3(x)
    assert codes[0] == 0x7E and codes[1] == 0xFE  # saturate to +-448, no infinities in e4m3fn
    assert np.isnan(e4m3_to_float32(codes[2:3]))[0]
    assert codes[3] == 0x80


def test_bf16_encode_matches_reference():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(20000) * np.exp2(rng.uniform(-100, 100, 20000))).astype(np.float32)
    # Exact ties: a bf16 value plus half its ulp, for even and odd bf16 mantissas.
    base = rng.integers(0x0080, 0x7F00, 2000, dtype=np.uint32) << np.uint32(16)
    ties = (base | np.uint32(0x8000)).view(np.float32)
    specials = np.array([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-40, -1e-40, 1.00390625, 1.01171875],
                        dtype=np.float32)
    for values in (x, ties, -ties, specials):
        got = bf16_bits_to_float32(float32_to_bf16_bits(values))
        np.testing.assert_array_equal(got.view(np.uint32), bf16_round_reference(values).view(np.uint32))


def test_bf16_specials_and_widening():
    bits = float32_to_bf16_bits(np.array([np.inf, -np.inf, np.nan, 3.3961776e38], dtype=np.float32))
    assert bits[0] == 0x7F80 and bits[1] == 0xFF80
    assert np.isnan(bf16_bits_to_float32(bits[2:3]))[0]
    assert bits[3] == 0x7F80  # above the largest bf16 by more than half an ulp: rounds to inf
    every = np.arange(65536, dtype=np.uint16)
    widened = bf16_bits_to_float32(every)
    np.testing.assert_array_equal(widened.view(np.uint32), every.astype(np.uint32) << 16)


# -- safetensors files -------------------------------------------------------------------------------------
def test_safetensors_round_trip_every_dtype(tmp_path):
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    tensors = {"a.f32": f32, "b.f16": f32.astype(np.float16), "c.bf16": f32, "d.fp8": f32,
               "e.i64": np.arange(-3, 9, dtype=np.int64).reshape(4, 3), "f.i32": np.array([7, -2**31], np.int32),
               "g.empty": np.zeros((0, 4), np.float32), "h.scalar": np.array(2.5, np.float32)}
    dtypes = {"c.bf16": "BF16", "d.fp8": "F8_E4M3"}
    path = tmp_path / "x.safetensors"
    save_file(path, tensors, dtypes, metadata={"format": "pt"})
    raw, metadata = raw_read(path)
    assert metadata == {"format": "pt"}
    assert {n: d for n, (d, _) in raw.items()} == {"a.f32": "F32", "b.f16": "F16", "c.bf16": "BF16",
                                                   "d.fp8": "F8_E4M3", "e.i64": "I64", "f.i32": "I32",
                                                   "g.empty": "F32", "h.scalar": "F32"}
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0  # data section 8-byte aligned
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt"} and f.keys() == list(tensors)
    np.testing.assert_array_equal(f.get("a.f32"), f32)
    np.testing.assert_array_equal(f.get("b.f16"), f32.astype(np.float16))
    np.testing.assert_array_equal(f.get_float32("c.bf16"), bf16_round_reference(f32))
    np.testing.assert_array_equal(f.get_float32("d.fp8"),
                                  FORMULA_TABLE[e4m3_brute_force(f32)].reshape(3, 5).astype(np.float32))
    np.testing.assert_array_equal(f.get("e.i64"), tensors["e.i64"])
    np.testing.assert_array_equal(f.get("f.i32"), tensors["f.i32"])
    assert f.get("g.empty").shape == (0, 4) and f.get("h.scalar").shape == ()
    assert f.get("h.scalar") == 2.5
    for name, (_, array) in raw.items():
        np.testing.assert_array_equal(f.get(name), array)
    with pytest.raises(SafetensorsError, match="integer dtype"):
        f.get_float32("e.i64")


def test_reader_memory_maps(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file(path, {"w": np.arange(1000, dtype=np.float32)})
    array = load_file(path)["w"]
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)
    assert not array.flags.writeable
    # Saving over the file does not disturb arrays still mapping the old one.
    save_file(path, {"w": np.zeros(10, dtype=np.float32)})
    np.testing.assert_array_equal(array, np.arange(1000, dtype=np.float32))


def test_reader_accepts_unpadded_reversed_layout(tmp_path):
    path = tmp_path / "x.safetensors"
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1.5, -2.0], np.float16)
    raw_write(path, {"a": ("F32", a), "b": ("F16", b)}, reverse_data=True)
    loaded = load_file(path)
    np.testing.assert_array_equal(loaded["a"], a)
    np.testing.assert_array_equal(loaded["b"], b)


def _raw_file(path, blob):
    path.write_bytes(blob)
    return path


def _header_file(path, header, data=b"", header_len=None):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


@pytest.mark.parametrize("make, words", [
    (lambda p: _raw_file(p, b"\x01\x02\x03"), "truncated"),
    (lambda p: _header_file(p, {"a": 1}, header_len=10 ** 6), "header length"),
    (lambda p: _header_file(p, b"{not json!"), "not valid UTF-8 JSON"),
    (lambda p: _header_file(p, b"\xff\xfe\xfd\xfc"), "not valid UTF-8 JSON"),
    (lambda p: _header_file(p, [1, 2]), "not a JSON object"),
    (lambda p: _header_file(p, {"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
     "unknown dtype 'Q7'"),
    (lambda p: _header_file(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
     "run past the end"),
    (lambda p: _header_file(p, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16),
     "needs 12"),
    (lambda p: _header_file(p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8),
     "data_offsets"),
    (lambda p: _header_file(p, {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
     "shape"),
    (lambda p: _header_file(p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
     "overlap"),
    (lambda p: _header_file(p, {"__metadata__": {"format": 1}}), "__metadata__"),
    (lambda p: _header_file(p, {"w": [1, 2]}), "not an object"),
])
def test_reader_errors(tmp_path, make, words):
    path = make(tmp_path / "bad.safetensors")
    with pytest.raises(SafetensorsError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert str(path) in message and words in message and "\n" not in message


def test_reader_missing_file_and_tensor(tmp_path):
    with pytest.raises(SafetensorsError, match="cannot open"):
        SafetensorsFile(tmp_path / "nope.safetensors")
    save_file(tmp_path / "x.safetensors", {"w": np.zeros(2, np.float32)})
    with pytest.raises(SafetensorsError, match="no tensor v"):
        SafetensorsFile(tmp_path / "x.safetensors").get("v")


def test_writer_refuses_unknown_numpy_dtype(tmp_path):
    with pytest.raises(SafetensorsError, match="complex64"):
        save_file(tmp_path / "x.safetensors", {"w": np.zeros(2, np.complex64)})
    with pytest.raises(SafetensorsError, match="unknown dtype"):
        save_file(tmp_path / "x.safetensors", {"w": np.zeros(2, np.float32)}, {"w": "F4"})


# -- save_model / load_model -------------------------------------------------------------------------------
def assert_same_weights(got, expected):
    assert list(sorted(got)) == list(sorted(expected))
    for name in expected:
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_float32_round_trip_is_exact(tmp_path):
    weights = random_weights(TINY, seed=3)
    paths = save_model(tmp_path / "m", TINY, weights)
    assert [p.name for p in paths] == ["model.safetensors"]
    cfg, loaded = load_model(str(tmp_path / "m"))
    assert cfg == ModelConfig(**{**TINY.__dict__, "name": "m"})
    assert_same_weights(loaded, weights)
    raw, metadata = raw_read(tmp_path / "m" / "model.safetensors")
    assert metadata == {"format": "pt"} and all(d == "F32" for d, _ in raw.values())
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert hf["torch_dtype"] == "float32" and "quantization_config" not in hf


def test_bfloat16_round_trip_equals_independent_rounding(tmp_path):
    weights = random_weights(PRESETS["small"], seed=4)
    save_model(tmp_path, PRESETS["small"], weights, dtype="bfloat16")
    _, loaded = load_model(tmp_path)
    assert_same_weights(loaded, {n: bf16_round_reference(w) for n, w in weights.items()})
    raw, _ = raw_read(tmp_path / "model.safetensors")
    assert all(d == "BF16" for d, _ in raw.values())
    assert any(not np.array_equal(loaded[n], weights[n]) for n in weights)  # rounding happened


def test_float16_round_trip(tmp_path):
    weights = random_weights(TINY, seed=5)
    save_model(tmp_path, TINY, weights, dtype="float16")
    _, loaded = load_model(tmp_path)
    assert_same_weights(loaded, {n: w.astype(np.float16).astype(np.float32) for n, w in weights.items()})


def test_sharded_save_and_load(tmp_path):
    weights = random_weights(TINY, seed=6)
    limit = 20_000
    paths = save_model(tmp_path, TINY, weights, max_shard_bytes=limit)
    count = len(paths)
    assert count >= 3
    assert [p.name for p in paths] == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights)
    total = 0
    for path in paths:
        raw, _ = raw_read(path)
        shard_bytes = sum(a.nbytes for _, a in raw.values())
        assert shard_bytes <= limit or len(raw) == 1  # only a lone tensor may exceed the limit
        total += shard_bytes
        for name in raw:
            assert index["weight_map"][name] == path.name
    assert index["metadata"]["total_size"] == total == sum(w.nbytes for w in weights.values())
    _, loaded = load_model(tmp_path)
    assert_same_weights(loaded, weights)


def test_resave_replaces_previous_layout(tmp_path):
    first, second = random_weights(TINY, seed=1), random_weights(TINY, seed=2)
    save_model(tmp_path, TINY, first, max_shard_bytes=20_000)
    save_model(tmp_path, TINY, second)  # single file now: the old index and shards must go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_weights(load_model(tmp_path)[1], second)
    save_model(tmp_path, TINY, first, max_shard_bytes=20_000)
    assert not (tmp_path / "model.safetensors").exists()
    assert_same_weights(load_model(tmp_path)[1], first)


def blocky_weights(seed=0):
    """Weights whose magnitude changes by powers of 2 from one 128x128 block to the next, so one scale per
    matrix would not do."""
    weights = random_weights(BLOCKY, seed=seed)
    for name, w in weights.items():
        if w.ndim == 2:
            rows, cols = np.indices(w.shape)
            w *= np.exp2(3.0 * (rows // 128) - 5.0 * (cols // 128)).astype(np.float32)
    return weights


def test_fp8_layout(tmp_path):
    weights = blocky_weights()
    save_model(tmp_path, BLOCKY, weights, fp8=True, dtype="bfloat16")
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    raw, _ = raw_read(tmp_path / "model.safetensors")
    fp8_names = {n for n, (d, _) in raw.items() if d == "F8_E4M3"}
    expected_fp8 = {n for n in parameter_shapes(BLOCKY) if n.startswith("model.layers.") and n.endswith("proj.weight")
                    or n.endswith("proj_with_mqa.weight")}
    assert fp8_names == expected_fp8
    assert "model.layers.1.mlp.experts.1.down_proj.weight" in fp8_names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in fp8_names
    assert "model.layers.0.mlp.gate_proj.weight" in fp8_names
    for name, (dtype, array) in raw.items():
        if name.endswith("_scale_inv"):
            assert dtype == "F32"
            out, inp = weights[name[:-len("_scale_inv")]].shape
            assert array.shape == (math.ceil(out / 128), math.ceil(inp / 128))
        elif name not in fp8_names:
            assert dtype == "BF16", name  # embeddings, lm_head, norms, router gate and bias
    assert set(raw) == set(weights) | {n + "_scale_inv" for n in fp8_names}
    assert raw["model.layers.0.mlp.gate_proj.weight_scale_inv"][1].shape == (3, 2)  # 260 x 136
    assert not is_fp8_weight("model.layers.1.mlp.gate.weight") and not is_fp8_weight("lm_head.weight")


def test_fp8_load_equals_independent_dequantisation(tmp_path):
    weights = blocky_weights(seed=9)
    save_model(tmp_path / "fp8", BLOCKY, weights, fp8=True, max_shard_bytes=60_000)
    cfg, loaded = load_model(tmp_path / "fp8")

    # Dequantise here from the raw files, decoding e4m3 by its formula and looping over blocks.
    raw = {}
    for path in sorted((tmp_path / "fp8").glob("*.safetensors")):
        raw.update(raw_read(path)[0])
    expected = {}
    for name, (dtype, array) in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if dtype != "F8_E4M3":
            expected[name] = array.astype(np.float32)
            continue
        values = FORMULA_TABLE[array].astype(np.float32)
        scale_inv = raw[name + "_scale_inv"][1]
        w = np.empty(values.shape, np.float32)
        for bi in range(scale_inv.shape[0]):
            for bj in range(scale_inv.shape[1]):
                block = np.s_[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
                w[block] = values[block] * scale_inv[bi, bj]
                # DeepSeek's quantiser: the block's largest magnitude maps to 448.
                amax = np.abs(weights[name][block]).max()
                assert scale_inv[bi, bj] == np.float32(amax / np.float64(448.0)), name
                assert np.abs(array[block].astype(np.int64) & 0x7F).max() == 0x7E, name
        expected[name] = w
    save_model(tmp_path / "f32", cfg, expected)
    _, reference = load_model(tmp_path / "f32")
    assert_same_weights(loaded, reference)

    # Close to the original within e4m3's precision: half a step of 3 mantissa bits (2^-4 relative) for
    # normals, half the subnormal step 2^-9 times the block scale below.
    worst = 0.0
    for name in (n for n in raw if raw[n][0] == "F8_E4M3"):
        scale = np.repeat(np.repeat(raw[name + "_scale_inv"][1], 128, 0), 128, 1)[:weights[name].shape[0],
                                                                                  :weights[name].shape[1]]
        error = np.abs(loaded[name].astype(np.float64) - weights[name])
        bound = 2.0 ** -4 * np.abs(weights[name]) + 2.0 ** -10 * scale + 1e-6 * np.abs(weights[name])
        assert np.all(error <= bound), name
        worst = max(worst, float((error / np.abs(weights[name]).clip(1e-30)).max()))
    assert worst > 1e-3  # really quantised


def test_hand_written_hf_directory(tmp_path):
    """An HF-style directory written byte by byte: rope_parameters, tied embeddings, no q_lora, two shards with
    an index, BF16 / F16 / F32 mixed, one FP8 weight whose scale sits in the other shard, and a DeepSeek MTP
    layer (num_nextn_predict_layers) that is skipped."""
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 40,
          "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "q_lora_rank": None,
          "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
          "intermediate_size": 24, "first_k_dense_replace": 1, "tie_word_embeddings": True,
          "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, "num_nextn_predict_layers": 1,
          "quantization_config": {"quant_method": "fp8", "weight_block_size": [4, 8]}}
    shapes = {"model.embed_tokens.weight": (40, 16), "model.layers.0.input_layernorm.weight": (16,),
              "model.layers.0.self_attn.q_proj.weight": (12, 16),
              "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (10, 16),
              "model.layers.0.self_attn.kv_a_layernorm.weight": (8,),
              "model.layers.0.self_attn.kv_b_proj.weight": (16, 8), "model.layers.0.self_attn.o_proj.weight": (16, 8),
              "model.layers.0.post_attention_layernorm.weight": (16,),
              "model.layers.0.mlp.gate_proj.weight": (24, 16), "model.layers.0.mlp.up_proj.weight": (24, 16),
              "model.layers.0.mlp.down_proj.weight": (16, 24), "model.norm.weight": (16,)}
    rng = np.random.default_rng(11)
    shard1, shard2, expected = {}, {}, {}
    for i, (name, shape) in enumerate(shapes.items()):
        values = rng.standard_normal(shape).astype(np.float32)
        if name.endswith("down_proj.weight"):  # FP8, 4x8 blocks: 4 x 3 scales
            codes = rng.integers(0, 0x7E, shape, dtype=np.uint8) | rng.choice([0, 0x80], shape).astype(np.uint8)
            scale_inv = np.exp2(rng.integers(-8, 3, (4, 3))).astype(np.float32) * np.float32(1.3)
            shard1[name] = ("F8_E4M3", codes)
            shard2[name + "_scale_inv"] = ("F32", scale_inv)
            expected[name] = (FORMULA_TABLE[codes] * np.repeat(np.repeat(scale_inv, 4, 0), 8, 1)).astype(np.float32)
            continue
        target = shard1 if i % 2 else shard2
        if i % 3 == 0:
            bits = values.view(np.uint32) >> np.uint32(16)  # truncation: exactly representable in bf16
            target[name] = ("BF16", bits.astype(np.uint16))
            expected[name] = (bits << np.uint32(16)).view(np.float32)
        elif i % 3 == 1:
            target[name] = ("F16", values.astype(np.float16))
            expected[name] = values.astype(np.float16).astype(np.float32)
        else:
            target[name] = ("F32", values)
            expected[name] = values
    shard2["model.layers.1.eh_proj.weight"] = ("BF16", np.zeros((16, 32), np.uint16))  # MTP layer
    raw_write(tmp_path / "model-00001-of-00002.safetensors", shard1)
    raw_write(tmp_path / "model-00002-of-00002.safetensors", shard2, reverse_data=True)
    weight_map = {n: "model-00001-of-00002.safetensors" for n in shard1}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in shard2})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(hf))

    cfg, weights = load_model(str(tmp_path))
    assert cfg.q_lora_rank is None and cfg.tie_word_embeddings and cfg.rope_theta == 5000.0
    assert cfg.first_k_dense_replace == 1 and not cfg.has_moe
    assert_same_weights(weights, expected)


def test_single_file_under_another_name(tmp_path):
    weights = random_weights(TINY, seed=8)
    save_model(tmp_path, TINY, weights)
    (tmp_path / "model.safetensors").rename(tmp_path / "consolidated.safetensors")
    assert_same_weights(load_model(tmp_path)[1], weights)


def test_presets_and_config_only():
    cfg, weights = load_model("tiny", seed=5)
    assert cfg is TINY
    assert_same_weights(weights, random_weights(TINY, seed=5))
    assert not np.array_equal(load_model("tiny", seed=6)[1]["lm_head.weight"], weights["lm_head.weight"])
    assert load_model_config("small") is PRESETS["small"]


def test_load_model_config_reads_no_tensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["small"].to_hf_dict()))
    cfg = load_model_config(tmp_path)  # no safetensors at all
    assert cfg == ModelConfig(**{**PRESETS["small"].__dict__, "name": tmp_path.name})


# -- errors ------------------------------------------------------------------------------------------------
def assert_checkpoint_error(model, *words):
    with pytest.raises(CheckpointError) as info:
        load_model(model)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


@pytest.fixture
def saved(tmp_path):
    weights = random_weights(TINY, seed=2)
    save_model(tmp_path, TINY, weights)
    return tmp_path, weights


def rewrite(directory, weights, **dtypes):
    save_file(directory / "model.safetensors", weights, dtypes)


def test_error_missing_directory(tmp_path):
    assert_checkpoint_error(str(tmp_path / "nowhere"), "nowhere", "not a model name")
    with pytest.raises(CheckpointError, match="not a model name"):
        load_model_config(str(tmp_path / "nowhere"))


def test_error_missing_config(saved):
    directory, _ = saved
    (directory / "config.json").unlink()
    assert_checkpoint_error(directory, str(directory), "no config.json")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model_config(directory)


def test_error_missing_safetensors(saved):
    directory, _ = saved
    (directory / "model.safetensors").unlink()
    assert_checkpoint_error(directory, str(directory), "model.safetensors")


def test_error_index_references_missing_shard(tmp_path):
    paths = save_model(tmp_path, TINY, random_weights(TINY), max_shard_bytes=20_000)
    paths[1].unlink()
    assert_checkpoint_error(tmp_path, "model.safetensors.index.json", f"missing shard {paths[1].name}")


def test_error_index_names_tensor_absent_from_shard(tmp_path):
    paths = save_model(tmp_path, TINY, random_weights(TINY), max_shard_bytes=20_000)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    assert index["weight_map"]["model.norm.weight"] != paths[0].name
    index["weight_map"]["model.norm.weight"] = paths[0].name
    index_path.write_text(json.dumps(index))
    assert_checkpoint_error(tmp_path, paths[0].name, "lacks tensor model.norm.weight")


def test_error_missing_tensor(saved):
    directory, weights = saved
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    rewrite(directory, weights)
    assert_checkpoint_error(directory, "lacks tensor model.layers.1.mlp.experts.3.up_proj.weight")


def test_error_unexpected_tensor(saved):
    directory, weights = saved
    weights["model.layers.1.mlp.experts.4.up_proj.weight"] = np.zeros((16, 32), np.float32)
    rewrite(directory, weights)
    assert_checkpoint_error(directory, "model.layers.1.mlp.experts.4.up_proj.weight", "does not use")


def test_error_wrong_shape(saved):
    directory, weights = saved
    weights["model.layers.0.self_attn.kv_b_proj.weight"] = np.zeros((32, 15), np.float32)
    rewrite(directory, weights)
    assert_checkpoint_error(directory, "model.layers.0.self_attn.kv_b_proj.weight", "(32, 15)", "(32, 16)")


def test_error_garbage_safetensors(saved):
    directory, _ = saved
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage garbage")
    assert_checkpoint_error(directory, "model.safetensors", "JSON")


@pytest.fixture
def saved_fp8(tmp_path):
    save_model(tmp_path, TINY, random_weights(TINY), fp8=True)
    raw, _ = raw_read(tmp_path / "model.safetensors")
    return tmp_path, {n: a for n, (_, a) in raw.items()}, {n: d for n, (d, _) in raw.items()}


def test_error_fp8_without_scale(saved_fp8):
    directory, stored, dtypes = saved_fp8
    name = "model.layers.0.self_attn.o_proj.weight"
    del stored[name + "_scale_inv"]
    rewrite(directory, stored, **dtypes)
    assert_checkpoint_error(directory, f"FP8 tensor {name} has no {name}_scale_inv")


def test_error_scale_of_wrong_shape(saved_fp8):
    directory, stored, dtypes = saved_fp8
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    stored[name + "_scale_inv"] = np.ones((1, 2), np.float32)
    rewrite(directory, stored, **dtypes)
    assert_checkpoint_error(directory, f"{name}_scale_inv has shape (1, 2), expected (1, 1)")


def test_error_scale_for_non_fp8_tensor(saved_fp8):
    directory, stored, dtypes = saved_fp8
    name = "model.layers.0.self_attn.o_proj.weight"
    stored[name] = e4m3_to_float32(stored[name])
    dtypes[name] = "F32"
    rewrite(directory, stored, **dtypes)
    assert_checkpoint_error(directory, f"{name}_scale_inv", "not F8_E4M3")


def test_error_scale_without_weight(saved):
    directory, weights = saved
    weights["model.layers.0.self_attn.foo.weight_scale_inv"] = np.ones((1, 1), np.float32)
    rewrite(directory, weights)
    assert_checkpoint_error(directory, "model.layers.0.self_attn.foo.weight_scale_inv", "has no weight")


def test_save_errors(tmp_path):
    weights = random_weights(TINY)
    with pytest.raises(CheckpointError, match="dtype 'int8'"):
        save_model(tmp_path, TINY, weights, dtype="int8")
    with pytest.raises(CheckpointError, match="max_shard_bytes"):
        save_model(tmp_path, TINY, weights, max_shard_bytes=0)
    del weights["model.norm.weight"]
    with pytest.raises(CheckpointError, match="lacks tensor model.norm.weight"):
        save_model(tmp_path, TINY, weights)
    assert not any(tmp_path.iterdir())  # nothing written


def test_quantization_config_constant_is_deepseeks():
    assert FP8_QUANTIZATION_CONFIG == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128]}


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_random_weights_in_threads_equal_one_thread(workers):
    from kdspec.engine.model.weights import random_tensor
    cfg = PRESETS["small"]
    one = random_weights(cfg, 5, workers=1)
    many = random_weights(cfg, 5, workers=workers)
    assert list(one) == list(many)
    assert all(np.array_equal(one[k], many[k]) and one[k].dtype == many[k].dtype for k in one)
    name = [k for k in one if ".experts.3.up_proj" in k][0]   # and each equals its own generator's draw
    assert np.array_equal(many[name], random_tensor(name, many[name].shape, 5))
