"""The device model (Numba kernels) against the float64 golden: AR and DDTree, token-exact.

Under the CUDA simulator (CI) on the `tiny` and `small` presets; on a GPU the same tests run for real, and the
`gpu` tests add k2-mini (Kimi K2 per-layer dimensions) with 64 new tokens and budgets 16 / 64 / 256.
"""
from __future__ import annotations

import numpy as np
import pytest

from kdspec.engine.decode import api
from kdspec.engine.decode.config import DecodeConfig

PROMPT = "The tree"
LOGIT_TOL = 1e-4   # fp32 engine vs float64 golden, per committed position
CACHE_TOL = 1e-4   # compacted cache rows vs the golden AR cache


def _check_records(records, golden_tokens_after_prompt):
    for record in records:
        assert np.array_equal(record["committed_tokens"], record["golden_tokens"]), record["prefix_len"]
        assert np.all(record["logit_max_abs_diff"] <= LOGIT_TOL), record["logit_max_abs_diff"]
        assert record["cache_max_abs_diff"] <= CACHE_TOL


@pytest.fixture(scope="module", params=["tiny", "small"])
def engine_and_golden(request, device_backend):
    engine = api.load(request.param, backend=device_backend, seed=0)
    golden = engine.golden(PROMPT, 24 + 8)
    return engine, golden


@pytest.mark.sim
@pytest.mark.slow
def test_ar_equals_golden(engine_and_golden):
    engine, golden = engine_and_golden
    records = []
    result = engine.generate(PROMPT, DecodeConfig(24, mode="ar"), golden=golden, on_step=records.append)
    assert result.golden_match, (result.tokens, golden.tokens[:24])
    assert len(records) == 23  # the first token comes from the prefill
    _check_records(records, golden.tokens)


@pytest.mark.sim
@pytest.mark.slow
def test_ddtree_oracle_equals_golden_with_full_acceptance(engine_and_golden):
    engine, golden = engine_and_golden
    records = []
    config = DecodeConfig(24, mode="ddtree", drafter="oracle", block_size=8, budget=7)
    result = engine.generate(PROMPT, config, golden=golden, on_step=records.append)
    assert result.golden_match
    # the prefill gives token 1; steps of 8 then cover the other 23 (the last one truncated)
    assert result.taus == [8, 8, 8]
    assert result.mean_tau == 8.0
    _check_records(records, golden.tokens)


@pytest.mark.sim
@pytest.mark.slow
def test_ddtree_noisy_equals_golden_with_partial_acceptance(engine_and_golden):
    engine, golden = engine_and_golden
    records = []
    result = engine.generate(PROMPT, DecodeConfig(24, mode="ddtree", drafter="noisy:0.6"), golden=golden,
                             on_step=records.append)
    assert result.golden_match
    assert 1.0 < result.mean_tau < 8.0
    _check_records(records, golden.tokens)


@pytest.mark.sim
@pytest.mark.slow
def test_ddtree_sampling_equals_ar_sampling(engine_and_golden):
    engine, _ = engine_and_golden
    ar = engine.generate(PROMPT, DecodeConfig(16, mode="ar", temperature=1.0, seed=5))
    tree = engine.generate(PROMPT, DecodeConfig(16, mode="ddtree", drafter="noisy:0.7", temperature=1.0, seed=5))
    assert np.array_equal(ar.tokens, tree.tokens)
    golden = engine.golden(PROMPT, 16, temperature=1.0, seed=5)
    assert np.array_equal(ar.tokens, golden.tokens)


# ----------------------------------------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def k2_mini():
    engine = api.load("k2-mini", backend="cuda", seed=0)  # the golden widens its weights to float64 once
    golden = engine.golden(PROMPT, 64 + 8)
    return engine, golden


@pytest.mark.gpu
def test_k2_mini_ar_and_ddtree_oracle(k2_mini):
    engine, golden = k2_mini
    records = []
    ar = engine.generate(PROMPT, DecodeConfig(64, mode="ar"), golden=golden, on_step=records.append)
    worst = max(float(np.max(r["logit_max_abs_diff"])) for r in records)
    print(f"k2-mini AR: golden match {ar.golden_match}, max |dlogit| {worst:.2e}")
    assert ar.golden_match
    _check_records(records, golden.tokens)
    records = []
    tree = engine.generate(PROMPT, DecodeConfig(64, mode="ddtree", drafter="oracle"), golden=golden,
                           on_step=records.append)
    print(f"k2-mini DDTree oracle: golden match {tree.golden_match}, mean tau {tree.mean_tau:.2f}, "
          f"steps {tree.steps}")
    assert tree.golden_match and tree.mean_tau == 8.0
    _check_records(records, golden.tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_k2_mini_ddtree_noisy_budgets(k2_mini, budget):
    engine, golden = k2_mini
    records = []
    config = DecodeConfig(64, mode="ddtree", drafter="noisy:0.7", budget=budget)
    result = engine.generate(PROMPT, config, golden=golden, on_step=records.append)
    print(f"k2-mini DDTree noisy:0.7 budget {budget}: golden match {result.golden_match}, "
          f"mean tau {result.mean_tau:.2f}, steps {result.steps}")
    assert result.golden_match
    assert 1.0 < result.mean_tau <= 8.0
    _check_records(records, golden.tokens)


@pytest.mark.sim
def test_device_logits_topk_and_rows_equal_the_host_versions():
    from numba import cuda

    from kdspec.engine.decode import records
    from kdspec.engine.device.logits import DeviceLogits

    rng = np.random.default_rng(4)
    host = rng.standard_normal((5, 300)).astype(np.float32)
    host[1, 7] = host[1, 9] = host[1].max() + 1  # a tie at the top: the lower id wins
    logits = DeviceLogits(cuda.to_device(host), lambda a: a.copy_to_host())
    np.testing.assert_array_equal(logits.rows([3, 0]), host[[3, 0]])  # before any full host copy exists
    for ours, theirs in zip(records.target_topk(logits), records.target_topk(host)):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_cuda_graph_replays_equal_the_eager_forward(preset):
    """The captured segments (engine/cuda_graphs.py) give the eager forward's logits, step after step, for AR
    (s = 1) and a verify shape, and are really used (a capture exists for each shape)."""
    from kdspec.engine.device.model import DeviceModel
    from kdspec.engine.model.config import PRESETS
    from kdspec.engine.model.weights import random_weights

    cfg = PRESETS[preset]
    weights = random_weights(cfg, 0)
    graphed, eager = (DeviceModel(cfg, weights, "cuda", graphs=g) for g in (True, False))
    rng = np.random.default_rng(0)
    caches = [m.new_cache(64) for m in (graphed, eager)]
    prompt = rng.integers(0, cfg.vocab_size, 8)
    for model, cache in zip((graphed, eager), caches):
        model.forward(cache, prompt, np.arange(8))
        model.commit(cache, 8)
    visibility = np.tril(np.ones((5, 5), bool))
    visibility[3, 1:3] = visibility[4, 1:4] = False  # a small tree: 0 <- 1 <- 2, 0 <- 3 <- 4
    for step in range(6):
        tokens = rng.integers(0, cfg.vocab_size, 1 if step % 2 == 0 else 5)
        for model, cache in zip((graphed, eager), caches):
            positions = cache.length + (np.arange(len(tokens)) if len(tokens) == 1 else np.array([0, 1, 2, 1, 2]))
            out = model.forward(cache, tokens, positions, None if len(tokens) == 1 else visibility)
            model.commit(cache, len(tokens))
            if model is graphed:
                got = np.asarray(out)
            else:
                want = np.asarray(out)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max())))
    assert set(graphed._graphs) == {1, 5}  # each shape captured on its second use
    for model, cache in zip((graphed, eager), caches):
        np.testing.assert_allclose(cache.kv.copy_to_host()[:, :cache.length],
                                   caches[1].kv.copy_to_host()[:, :cache.length], atol=1e-5)


@pytest.mark.sim
def test_greedy_choice_keeps_the_top_k_the_record_reads():
    """Token choice at T = 0 runs the top-k once; the choice is its first id and the record's top-k is the host
    version's (ties -> lower id), whether or not the choice ran first."""
    from numba import cuda

    from kdspec.engine.decode import records
    from kdspec.engine.device.logits import DeviceLogits
    from kdspec.engine.device.tree_ops import DeviceTreeOps
    from kdspec.engine.golden import sampling as sampling_ref

    rng = np.random.default_rng(5)
    host = rng.integers(-4, 4, (3, 50)).astype(np.float32)  # many ties
    logits = DeviceLogits(cuda.to_device(host), lambda a: a.copy_to_host())
    chosen = DeviceTreeOps.choose_tokens(logits, 0.0, 0, np.arange(3))
    assert logits._topk is not None
    np.testing.assert_array_equal(chosen, [sampling_ref.choose_token(row, 0.0, 0, 0) for row in host])
    for ours, theirs in zip(records.target_topk(logits), records.target_topk(host)):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.sim
@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_expert_stacks_hold_every_experts_weights_in_order(device_backend, weight_dtype):
    """The routed experts go to the device block by block ([e, 2f, d] gate|up, [e, d, f] down): the same arrays a
    host-side stack gives, in bf16 bits for bf16 weights."""
    from kdspec.engine.device.model import DeviceModel
    from kdspec.engine.model.config import PRESETS
    from kdspec.engine.model.safetensors_io import float32_to_bf16_bits
    from kdspec.engine.model.weights import random_weights

    cfg = PRESETS["tiny"]
    weights = random_weights(cfg, 1)
    model = DeviceModel(cfg, weights, device_backend, weight_dtype)
    as_stored = float32_to_bf16_bits if weight_dtype == "bfloat16" else (lambda a: a)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert moe_layers
    for i in moe_layers:
        w = lambda e, name: weights[f"model.layers.{i}.mlp.experts.{e}.{name}.weight"]  # noqa: E731
        gate_up = np.stack([np.concatenate([w(e, "gate_proj"), w(e, "up_proj")]) for e in range(cfg.n_routed_experts)])
        down = np.stack([w(e, "down_proj") for e in range(cfg.n_routed_experts)])
        assert np.array_equal(model.layers[i]["experts_gate_up"].copy_to_host(), as_stored(gate_up))
        assert np.array_equal(model.layers[i]["experts_down"].copy_to_host(), as_stored(down))


def _on_host(x) -> np.ndarray:
    """A device weight (Numba array, or torch tensor: bf16 widened exactly) as a host array."""
    return x.copy_to_host() if hasattr(x, "copy_to_host") else x.float().cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["tiny", "small", "tiny-f32"])
def test_weights_drawn_on_the_gpu_build_the_model_the_host_weights_build(preset, weight_dtype):
    """A seeded preset on cuda is drawn on the GPU (SeededWeights): every device weight, and the logits of a
    prefill and a step, equal those of the model built from the host's draw, bit for bit. tiny-f32 (tiny with f
    = 32) runs its routed experts on the tensor cores in bf16, their weights laid out by torch on the GPU for the
    one and by numpy on the host for the other (asked for by name: bf16's default is torch's grouped GEMM)."""
    import dataclasses

    from kdspec.engine.device.model import DeviceModel
    from kdspec.engine.model.config import PRESETS
    from kdspec.engine.model.weights import SeededWeights, random_weights

    cfg = (dataclasses.replace(PRESETS["tiny"], moe_intermediate_size=32) if preset == "tiny-f32"
           else PRESETS[preset])
    tensor_cores = preset == "tiny-f32" and weight_dtype == "bfloat16"  # (bf16 otherwise: the grouped GEMM's)
    seeded = SeededWeights(cfg, 3)
    drawn = DeviceModel(cfg, seeded, "cuda", weight_dtype, graphs=False, tensor_core_experts=tensor_cores or None)
    copied = DeviceModel(cfg, random_weights(cfg, 3), "cuda", weight_dtype, graphs=False,
                         tensor_core_experts=tensor_cores or None)
    assert drawn._drawn and not copied._drawn and not seeded._host
    assert drawn.tensor_core_experts == copied.tensor_core_experts == tensor_cores
    for attribute in ("embed", "final_norm", "lm_head"):
        assert np.array_equal(_on_host(getattr(drawn, attribute)), _on_host(getattr(copied, attribute))), attribute
    for i, (ours, theirs) in enumerate(zip(drawn.layers, copied.layers)):
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert np.array_equal(_on_host(ours[key]), _on_host(theirs[key])), (i, key)
    prompt = np.arange(7) * 13 % cfg.vocab_size
    caches = [model.new_cache(16) for model in (drawn, copied)]
    logits = [np.asarray(model.forward(cache, prompt, np.arange(7))) for model, cache in zip((drawn, copied), caches)]
    assert np.array_equal(*logits)
