"""Batch invariance of the device model (bf16 weights): a random tree verified in one forward gives every node
the logits, bit for bit, of the 1-row AR forwards that decode its root -> node path one token at a time after
the same prompt. This is what makes DDTree's output the engine's own AR output in bf16 (issue #19).

Under the CUDA simulator on `tiny` and `small` (odd head count), and `tiny` with attention on the tensor cores
(invariant_tc.py, the bf16 model's on a GPU); on a GPU the same tests run for real, and the `gpu` case runs
k2-mini (Kimi K2 per-layer dimensions, bf16 weights drawn on the GPU) with trees of 64, 256 and 300 nodes (one,
two and three of the dense products' fixed-size row chunks), with the routed experts on the SIMT kernels and on
the tensor cores (attention on the tensor cores, the default there).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kdspec.engine.device.model import DeviceModel
from kdspec.engine.model.config import PRESETS
from kdspec.engine.model.weights import SeededWeights, random_weights


def random_tree(rng, nodes: int):
    """parents (parent[0] = -1; half the nodes extend the previous one, so some paths run deep) and the bool
    [s, s] visibility: node i sees itself and its ancestors."""
    parents = np.full(nodes, -1)
    visible = np.eye(nodes, dtype=bool)
    for i in range(1, nodes):
        parents[i] = i - 1 if rng.random() < 0.5 else rng.integers(0, i)
        visible[i] |= visible[parents[i]]
    return parents, visible


def assert_tree_rows_equal_ar_steps(model: DeviceModel, prompt_len: int, nodes: int, seed: int) -> None:
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, prompt_len)
    parents, visible = random_tree(rng, nodes)
    depths = visible.sum(axis=1) - 1
    tokens = rng.integers(0, cfg.vocab_size, nodes)
    cache = model.new_cache(prompt_len + nodes + 1)
    model.forward(cache, prompt, np.arange(prompt_len))
    model.commit(cache, prompt_len)
    verified = np.array(np.asarray(model.forward(cache, tokens, prompt_len + depths, visible)))  # not committed
    assert np.isfinite(verified).all()
    for node in range(nodes):
        path = np.flatnonzero(visible[node])  # root .. node, ascending
        for step, row in enumerate(path):
            logits = model.forward(cache, tokens[row:row + 1], np.array([prompt_len + step]))
            model.commit(cache, 1)
        alone = np.asarray(logits)[0]
        cache.length = prompt_len  # the next path starts after the prompt again
        differing = np.flatnonzero(alone.view(np.uint32) != verified[node].view(np.uint32))
        assert differing.size == 0, (f"node {node} (depth {depths[node]}): {differing.size} logits differ, max "
                                     f"|diff| {np.abs(alone - verified[node]).max():.3g}")


@pytest.mark.sim
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_tree_verify_equals_ar_steps_bit_for_bit(preset, device_backend):
    cfg = PRESETS[preset]
    model = DeviceModel(cfg, random_weights(cfg, 0), device_backend, weight_dtype="bfloat16")
    assert model.batch_invariant
    assert model.tensor_core_attention == (device_backend == "cuda")  # invariant_tc.py on a GPU, invariant.py here
    assert_tree_rows_equal_ar_steps(model, prompt_len=7, nodes=10, seed=1)


@pytest.mark.sim
def test_tree_verify_equals_ar_steps_with_tensor_core_attention(device_backend):
    """attention/invariant_tc.py, as the bf16 model runs it on a GPU (asked for by name under the simulator)."""
    cfg = PRESETS["tiny"]
    model = DeviceModel(cfg, random_weights(cfg, 0), device_backend, weight_dtype="bfloat16",
                        tensor_core_attention=True)
    assert_tree_rows_equal_ar_steps(model, prompt_len=7, nodes=10, seed=1)


@pytest.mark.sim
def test_tree_verify_equals_ar_steps_with_tensor_core_experts(device_backend):
    """tiny with f = 32: the routed experts run experts_tc.py's kernels (whole 32-column chunks)."""
    cfg = dataclasses.replace(PRESETS["tiny"], moe_intermediate_size=32)
    model = DeviceModel(cfg, random_weights(cfg, 0), device_backend, weight_dtype="bfloat16", tensor_core_experts=True)
    assert_tree_rows_equal_ar_steps(model, prompt_len=5, nodes=6, seed=4)


@pytest.mark.sim
def test_tensor_core_attention_is_the_bf16_models_and_refused_elsewhere():
    cfg = PRESETS["tiny"]
    assert not DeviceModel(cfg, random_weights(cfg, 0), "sim").tensor_core_attention  # fp32: invariant.py, if any
    with pytest.raises(ValueError, match="tensor_core_attention needs bf16 weights"):
        DeviceModel(cfg, random_weights(cfg, 0), "sim", batch_invariant=True, tensor_core_attention=True)
    with pytest.raises(ValueError, match="multiple of 4"):
        odd = dataclasses.replace(cfg, qk_rope_head_dim=2)  # c + r = 18: not 16-byte pieces
        DeviceModel(odd, random_weights(odd, 0), "sim", weight_dtype="bfloat16", tensor_core_attention=True)


@pytest.mark.sim
def test_tensor_core_experts_refuse_what_they_cannot_run():
    cfg = PRESETS["tiny"]  # f = 16: not whole 32-column chunks
    with pytest.raises(ValueError, match="tensor_core_experts needs"):
        DeviceModel(cfg, random_weights(cfg, 0), "sim", weight_dtype="bfloat16", tensor_core_experts=True)


@pytest.mark.sim
def test_grouped_experts_refuse_what_they_cannot_run():
    cfg = PRESETS["tiny"]
    with pytest.raises(ValueError, match="grouped_experts needs"):  # torch's grouped GEMM: cuda only
        DeviceModel(cfg, random_weights(cfg, 0), "sim", weight_dtype="bfloat16", grouped_experts=True)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["grouped", "tensor-cores", "simt"])
def test_k2_mini_tree_verify_equals_ar_steps_bit_for_bit(experts):
    """k2-mini bf16 with each kind of routed experts: torch's grouped GEMM (the default on a GPU), the Numba
    tensor-core kernels and the SIMT kernels."""
    cfg = PRESETS["k2-mini"]
    options = {"grouped": {}, "tensor-cores": dict(tensor_core_experts=True),
               "simt": dict(tensor_core_experts=False, grouped_experts=False)}[experts]
    model = DeviceModel(cfg, SeededWeights(cfg, 0), "cuda", weight_dtype="bfloat16", **options)
    assert (model.grouped_experts, model.tensor_core_experts) == (experts == "grouped", experts == "tensor-cores")
    for nodes, seed in ((64, 1), (256, 2), (300, 3)):
        assert_tree_rows_equal_ar_steps(model, prompt_len=40, nodes=nodes, seed=seed)
