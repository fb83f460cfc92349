"""The golden on torch (engine/golden/arrays.py): the same reference math on torch float64 tensors equals the numpy
golden to 1e-12, on the presets and the shipped pycoder-mini, and breaks routing and argmax ties as numpy does.

Run on the CPU (CI has no torch: skipped there); device="cpu" runs the code a CUDA device runs, on CPU tensors;
where torch sees a GPU the equality runs on "cuda" as well.
"""
import dataclasses

import numpy as np
import pytest

from kdspec.engine.decode import api
from kdspec.engine.golden import layers
from kdspec.engine.golden import model as R
from kdspec.engine.golden.sampling import gumbel_noise
from kdspec.engine.model.checkpoint import load_model
from kdspec.engine.model.config import PRESETS, YarnScaling
from kdspec.engine.model.weights import random_weights

torch = pytest.importorskip("torch")

TOL = 1e-12
NEW_TOKENS = 32
# group-limited routing, q_lora_rank, YaRN with mscale != mscale_all_dim, tied embeddings, one dense layer
MIXED = dataclasses.replace(
    PRESETS["small"], name="mixed", q_lora_rank=12, first_k_dense_replace=1, tie_word_embeddings=True,
    norm_topk_prob=True, rope_scaling=YarnScaling(factor=8.0, original_max_position_embeddings=32, beta_fast=32.0,
                                                  beta_slow=1.0, mscale=0.9, mscale_all_dim=0.7))


def _weights(name: str):
    if name == "mixed":
        return MIXED, random_weights(MIXED, seed=5)
    return load_model(name, seed=5)


def _max_cache_diff(a: R.ReferenceCache, b: R.ReferenceCache, rows: int) -> float:
    return max(float(np.abs(x[:rows] - y[:rows]).max()) for x, y in zip(a.c + a.k_pe, b.c + b.k_pe))


# the CPU everywhere torch is; the GPU too where torch sees one (the H200 runs this file as it is)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", ["tiny", "small", "mixed", "pycoder-mini"])
def test_torch_golden_equals_the_numpy_golden(name, temperature, device):
    cfg, weights = _weights(name)
    prompt = np.array([1, 17, 42, 5, 99, 3, 64, 8]) % cfg.vocab_size
    expected = R.decode(R.ReferenceModel(cfg, weights), prompt, NEW_TOKENS, temperature, seed=11)
    on_torch = R.ReferenceModel(cfg, weights, device=device)
    assert all(isinstance(w, torch.Tensor) and w.dtype == torch.float64 for w in on_torch.weights.values())
    assert isinstance(on_torch.new_cache(4).c[0], torch.Tensor)  # the math really ran on torch
    got = R.decode(on_torch, prompt, NEW_TOKENS, temperature, seed=11)
    # what records compare with: numpy float64 on the host, tokens, logits and the cache rows
    assert isinstance(got.logits, np.ndarray) and got.logits.dtype == np.float64
    assert all(isinstance(rows, np.ndarray) for rows in got.cache.c + got.cache.k_pe)
    assert got.cache.length == expected.cache.length == len(prompt) + NEW_TOKENS
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    assert np.abs(got.logits - expected.logits).max() <= TOL
    assert _max_cache_diff(got.cache, expected.cache, expected.cache.length) <= TOL
    positions = len(prompt) + np.arange(NEW_TOKENS)  # token i chosen at P + i: argmax, or Gumbel-max keyed by it
    noise = np.array([gumbel_noise(11, p, cfg.vocab_size) for p in positions]) if temperature else 0.0
    np.testing.assert_array_equal(got.tokens, np.argmax(got.logits / max(temperature, 1.0) + noise, axis=1))


def test_tree_verify_and_compaction_on_torch_equal_numpy():
    """A tree forward (visibility), compaction and the kept hidden states, as the DDTree loop drives a model."""
    weights = random_weights(MIXED, seed=2)
    models = [R.ReferenceModel(MIXED, weights), R.ReferenceModel(MIXED, weights, device="cpu")]
    parents = [-1, 0, 0, 1, 3, 2]
    visibility = np.zeros((6, 6), dtype=bool)
    for i in range(6):
        node = i
        while node != -1:
            visibility[i, node], node = True, parents[node]
    depths = visibility.sum(axis=1) - 1
    results = []
    for model in models:
        cache = model.new_cache(20, hidden_layers=(0, MIXED.num_hidden_layers))
        model.forward(cache, np.array([3, 9, 27, 81]), np.arange(4))
        model.commit(cache, 4)
        logits = model.forward(cache, np.array([5, 6, 7, 8, 9, 10]), 4 + depths, visibility)
        model.compact(cache, np.array([0, 1, 3, 4]))
        results.append((logits, cache.to_host(), model.hidden_rows(cache, cache.length)))
    (want_logits, want_cache, want_hidden), (logits, cache, hidden) = results
    assert cache.length == want_cache.length == 8
    assert np.abs(logits - want_logits).max() <= TOL
    assert _max_cache_diff(cache, want_cache, 8) <= TOL
    assert isinstance(hidden, np.ndarray) and np.abs(hidden - want_hidden).max() <= TOL


def test_routing_ties_go_to_the_lower_expert_on_torch():
    """Every expert scores the same (identical gate rows, zero bias): the groups 0..topk_group-1 and in them the
    lowest experts win, on numpy and on torch alike."""
    cfg = PRESETS["small"]  # 8 experts in 4 groups of 2, the top 2 groups, 3 experts a token
    x = np.random.default_rng(0).standard_normal((5, cfg.hidden_size))
    gate = np.tile(np.random.default_rng(1).standard_normal(cfg.hidden_size), (cfg.n_routed_experts, 1))
    bias = np.zeros(cfg.n_routed_experts)
    want = np.tile([0, 1, 2], (5, 1))  # groups 0 and 1 (experts 0..3) kept; experts 0, 1, 2 in index order
    ids, weights = layers.moe_gate(cfg, x, gate, bias)
    ids_t, weights_t = layers.moe_gate(cfg, torch.from_numpy(x), torch.from_numpy(gate), torch.from_numpy(bias))
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(ids_t.numpy(), want)
    assert np.abs(weights_t.numpy() - weights).max() <= TOL


def test_argmax_ties_go_to_the_lowest_token_on_torch():
    """LM-head rows 10 and 20 are the same vector and all others zero: logits 10 and 20 tie exactly, so every
    greedy token is 10 (their logit positive) or 0 (the lowest of the zeros)."""
    cfg = PRESETS["tiny"]
    weights = dict(random_weights(cfg, seed=3))
    head = np.zeros_like(weights["lm_head.weight"])
    head[10] = head[20] = np.random.default_rng(8).standard_normal(cfg.hidden_size)  # meets both kinds of tie
    weights["lm_head.weight"] = head
    run = R.decode(R.ReferenceModel(cfg, weights, device="cpu"), np.array([1, 2, 3]), 24)
    np.testing.assert_array_equal(run.logits[:, 10], run.logits[:, 20])
    np.testing.assert_array_equal(run.tokens, np.where(run.logits[:, 10] > 0, 10, 0))
    assert set(run.tokens.tolist()) == {0, 10}  # both kinds of tie were met


def test_engine_golden_on_a_torch_device_equals_the_numpy_golden():
    engine = api.load("small", backend="reference", seed=4)
    want = engine.golden("abc", 12)
    got = engine.golden("abc", 12, device="cpu")
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert np.abs(got.logits - want.logits).max() <= TOL


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_weights_drawn_on_the_device_equal_the_host_copy(device):
    """A preset's golden on torch draws its weights on the device (no host copy): the same float64 tensors as
    widening the host's draw."""
    from kdspec.engine.model.weights import SeededWeights

    cfg = PRESETS["small"]
    seeded = SeededWeights(cfg, 9)
    drawn = R.ReferenceModel(cfg, seeded, device=device)
    assert not seeded._host  # nothing drawn on the host
    copied = R.ReferenceModel(cfg, random_weights(cfg, 9), device=device)
    assert drawn.weights.keys() == copied.weights.keys()
    for name, tensor in drawn.weights.items():
        assert tensor.device.type == device and tensor.dtype == torch.float64
        assert torch.equal(tensor, copied.weights[name]), name
