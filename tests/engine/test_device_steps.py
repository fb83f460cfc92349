"""Whole steps on the device (engine/device/step.py) against the same stages run one by one.

- a DDTree step queued as one launch sequence (build, verify, top-k or the choice alone, accept, compaction,
  length) gives the tree, the target's choice, the accepted path, the bonus and the cache rows (every bit) that
  DeviceTreeOps and DeviceModel.forward / compact give stage by stage, over several steps of a noisy drafter (so
  that paths off the first-child chain, and with them real compaction moves, occur), and the device's length
  cell follows;
- AR and DDTree decodes through generate: the same tokens and the same records field by field, and the device
  steps really ran;
- the tree size the step is shaped for equals the reference build's on random drafts;
- where it does not apply (fp32 without batch invariance, T > 0) the loop runs the stages one by one;
- with GPU-clock stamps asked for, every step is stamped once and the tokens do not change.
Under the simulator on `tiny` (eager launches); on a GPU the same tests capture and replay CUDA graphs (each
shape's second step on).
"""
from __future__ import annotations

import numpy as np
import pytest

from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.decode.drafters import NoisyOracleDrafter
from kdspec.engine.decode.loop import generate
from kdspec.engine.device.model import DeviceModel
from kdspec.engine.device.step import DeviceSteps, tree_size
from kdspec.engine.device.tree_ops import DeviceTreeOps
from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.engine.model.config import PRESETS
from kdspec.engine.model.weights import random_weights
from kdspec.numba_kernels.clock import Stamps

PROMPT = np.array([3, 1, 4, 1, 5, 9, 2], dtype=np.int64)


@pytest.fixture(scope="module")
def model(device_backend):
    cfg = PRESETS["tiny"]
    return DeviceModel(cfg, random_weights(cfg, 0), device_backend, batch_invariant=True)


def golden_continuation(model, tokens: int) -> np.ndarray:
    """The model's own greedy continuation of PROMPT (stage by stage), prompt included."""
    result = generate(model, PROMPT, DecodeConfig(tokens), tree_ops=DeviceTreeOps(device_steps=False))
    return np.concatenate([PROMPT, result.tokens])


def prefilled(model, capacity: int):
    cache = model.new_cache(capacity)
    logits = model.forward(cache, PROMPT, np.arange(len(PROMPT)))
    model.commit(cache, len(PROMPT))
    return cache, int(np.argmax(np.asarray(logits)[-1]))


@pytest.mark.sim
@pytest.mark.parametrize("topk", [1, 8])
def test_ddtree_steps_equal_the_stages_one_by_one(model, topk):
    cfg, budget, steps = model.cfg, 9, 5
    drafter = NoisyOracleDrafter(golden_continuation(model, 24), 0.5, 3, 3, budget, cfg.vocab_size)
    capacity = len(PROMPT) + 40
    fused_cache, root = prefilled(model, capacity)
    plain_cache, _ = prefilled(model, capacity)
    plain_root = root
    device, plain = DeviceSteps(model), DeviceTreeOps(device_steps=False)
    moved = 0
    for _ in range(steps):
        prefix = fused_cache.length
        assert plain_cache.length == prefix
        ids, logprobs = drafter.draft(None, root, prefix)
        device.ddtree(fused_cache, logprobs, ids, root, budget, topk)
        tree, logits, choice, accepted, bonus = device.finish()

        want_tree = plain.build_tree(logprobs, ids, plain_root, budget, prefix)
        want_logits = model.forward(plain_cache, want_tree.tokens, want_tree.positions, want_tree.visibility)
        want_choice = plain.choose_tokens(want_logits, 0.0, 0, want_tree.positions + 1)
        want_accepted, want_bonus = plain.accept(want_tree.parents, want_tree.tokens, want_choice)
        model.compact(plain_cache, want_accepted)

        for name in ("tokens", "parents", "depths", "ranks", "positions"):
            assert np.array_equal(getattr(tree, name), getattr(want_tree, name)), name
        assert np.array_equal(tree.scores.view(np.uint32), want_tree.scores.view(np.uint32))
        assert np.array_equal(np.asarray(logits).view(np.uint32), np.asarray(want_logits).view(np.uint32))
        assert np.array_equal(choice, want_choice)
        assert np.array_equal(accepted, want_accepted) and bonus == want_bonus
        assert fused_cache.length == plain_cache.length == prefix + len(accepted)
        assert int(fused_cache.length_cell.copy_to_host()[0]) == fused_cache.length
        rows = fused_cache.length
        assert np.array_equal(fused_cache.kv.copy_to_host()[:, :rows].view(np.uint32),
                              plain_cache.kv.copy_to_host()[:, :rows].view(np.uint32))
        moved += not np.array_equal(accepted, np.arange(len(accepted)))
        root = plain_root = bonus
    assert moved, "no step accepted a path off the first-child chain: compaction was not exercised"


def records(model, config, drafter, device_steps: bool):
    found = []
    ops = DeviceTreeOps(device_steps=device_steps)
    result = generate(model, PROMPT, config, drafter, on_step=found.append, tree_ops=ops)
    return result, found


@pytest.mark.sim
@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_decodes_equal_the_stages_one_by_one(model, mode, monkeypatch):
    cfg = model.cfg
    config = (DecodeConfig(10) if mode == "ar" else DecodeConfig(12, mode="ddtree", block_size=4, budget=6))
    drafter = None if mode == "ar" else NoisyOracleDrafter(golden_continuation(model, 24), 0.6, 1, 3, 6,
                                                            cfg.vocab_size)
    ran = []
    for name in ("finish", "finish_ar"):
        real = getattr(DeviceSteps, name)
        monkeypatch.setattr(DeviceSteps, name,
                            lambda self, *args, _real=real, **kwargs: (ran.append(1), _real(self, *args, **kwargs))[1])
    fused, fused_records = records(model, config, drafter, True)
    assert len(ran) == fused.steps, "the decode did not run its steps on the device"
    ran.clear()
    plain, plain_records = records(model, config, drafter, False)
    assert not ran
    assert np.array_equal(fused.tokens, plain.tokens)
    assert len(fused_records) == len(plain_records)
    for got, want in zip(fused_records, plain_records):
        assert got.keys() == want.keys()
        for field in got:
            if field == "stage_times" or field.startswith("time_"):
                continue
            a, b = np.asarray(got[field]), np.asarray(want[field])
            assert a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), field


@pytest.mark.sim
@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_stamped_steps_are_stamped_once_each(model, mode):
    cfg = model.cfg
    config = (DecodeConfig(6) if mode == "ar" else DecodeConfig(10, mode="ddtree", block_size=4, budget=6))
    drafter = None if mode == "ar" else NoisyOracleDrafter(golden_continuation(model, 16), 0.6, 1, 3, 6,
                                                            cfg.vocab_size)
    ops = DeviceTreeOps()
    plain = generate(model, PROMPT, config, drafter, tree_ops=ops)
    ops.step_stamps = stamps = Stamps(64)
    for _ in range(2):  # on a GPU the second decode replays the stamped graphs
        stamps.clear()
        stamped = generate(model, PROMPT, config, drafter, tree_ops=ops)
        spans = stamps.spans()
        assert len(spans) == stamped.steps
        assert (spans[:, 1] >= spans[:, 0]).all() and (spans[1:, 0] >= spans[:-1, 1]).all()
        assert np.array_equal(stamped.tokens, plain.tokens)


@pytest.mark.sim
def test_tree_size_is_the_reference_builds():
    rng = np.random.default_rng(5)
    for _ in range(40):
        depths, width, budget = int(rng.integers(1, 5)), int(rng.integers(1, 5)), int(rng.integers(0, 40))
        logprobs = np.sort(-rng.random((depths, width)).astype(np.float32), axis=1)[:, ::-1].copy()
        ids = np.tile(np.arange(width, dtype=np.int32), (depths, 1))
        built = ddtree_ref.build_tree(logprobs, ids, 0, budget, 0)
        assert tree_size(depths, width, budget) == built.num_nodes, (depths, width, budget)


@pytest.mark.sim
def test_applies_only_where_it_can(model, device_backend):
    cfg = PRESETS["tiny"]
    fp32 = DeviceModel(cfg, random_weights(cfg, 0), device_backend)
    ops = DeviceTreeOps()
    assert not fp32.batch_invariant
    assert ops.device_steps(fp32, fp32.new_cache(16), 0.0) is None
    assert ops.device_steps(model, model.new_cache(16), 0.5) is None
    assert ops.device_steps(model, model.new_cache(16, hidden_layers=(1,)), 0.0) is None
    assert isinstance(ops.device_steps(model, model.new_cache(16), 0.0), DeviceSteps)
    assert DeviceTreeOps(device_steps=False).device_steps(model, model.new_cache(16), 0.0) is None


@pytest.mark.sim
def test_refuses_a_tree_that_does_not_fit(model):
    cache, root = prefilled(model, len(PROMPT) + 4)  # at least that: maybe a released cache's larger arrays
    room = cache.capacity - cache.length
    ids = np.tile(np.arange(4, dtype=np.int32), (4, 1))  # 340 candidates
    logprobs = np.log(np.full((4, 4), 1 / 4, np.float32))
    with pytest.raises(ValueError, match="does not fit"):
        DeviceSteps(model).ddtree(cache, logprobs, ids, root, room)  # room + 1 nodes


@pytest.mark.gpu
def test_k2_mini_decodes_on_the_device_equal_the_stages_one_by_one():
    """k2-mini (bf16 weights drawn on the GPU): AR and DDTree (oracle, budgets 7 and 63) with whole steps on the
    device, captured as graphs, give the stage-by-stage AR output token for token."""
    from kdspec.engine.decode.drafters import OracleDrafter
    from kdspec.engine.model.weights import SeededWeights
    cfg = PRESETS["k2-mini"]
    k2 = DeviceModel(cfg, SeededWeights(cfg, 0), "cuda", weight_dtype="bfloat16")
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 24)
    plain = generate(k2, prompt, DecodeConfig(24), tree_ops=DeviceTreeOps(device_steps=False)).tokens
    ops = DeviceTreeOps()
    assert np.array_equal(generate(k2, prompt, DecodeConfig(24), tree_ops=ops).tokens, plain)
    golden = np.concatenate([prompt, plain])
    for budget in (7, 63):
        drafter = OracleDrafter(golden, 7, budget, cfg.vocab_size)
        config = DecodeConfig(24, mode="ddtree", block_size=8, budget=budget)
        result = generate(k2, prompt, config, drafter, tree_ops=ops)
        assert np.array_equal(result.tokens, plain), budget
        assert result.mean_tau > 7


@pytest.mark.sim
def test_a_released_cache_lends_its_arrays_to_the_next_one(model):
    """Captured step graphs name the cache's arrays: a new cache reuses a released one's when they fit, never
    those of a cache still held."""
    first = model.new_cache(20)
    kv = first.kv
    held = model.new_cache(20)
    assert held.kv is not kv
    del first, held
    again = model.new_cache(12)
    assert again.kv is not kv and again.capacity >= 12  # `held` was made last: its arrays, not `first`'s
    kept = again.kv
    del again
    reused = model.new_cache(20)
    assert reused.kv is kept and reused.capacity == 20 and reused.length == 0
    assert int(reused.device_length().copy_to_host()[0]) == 0
    del reused
    assert model.new_cache(21).kv is not kept  # does not fit
