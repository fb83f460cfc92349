"""The block drafter on the device (engine/device/drafter.py) against its float64 golden (engine/golden/drafter.py
draft_logits): fresh random drafters, hidden states and prefixes at toy size under the simulator; DDTree with it on
the sim backend equals AR; a drafter past the simulator's attention widths is refused in one line; on a GPU the
shipped pycoder-mini drafter against the golden on the held-out prompts."""
import json
from pathlib import Path

import numpy as np
import pytest

from kdspec.engine.decode import api
from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.decode.drafters import BlockDrafter, top_k_rows
from kdspec.engine.golden.drafter import draft_logits, log_softmax
from kdspec.engine.model.checkpoint import model_directory
from kdspec.engine.model.drafter import DrafterConfig, DrafterError
from kdspec.engine.model.safetensors_io import save_file

TOLERANCE = 1e-4  # fp32 against float64, per log-prob (docs/architecture.md: the golden tolerance)


def random_drafter(rng, hidden_size, num_target_layers, **shape):
    """(DrafterConfig, float32 weights) of a random toy drafter; ``shape`` overrides the drawn fields."""
    layers = sorted(rng.choice(num_target_layers + 1, int(rng.integers(1, num_target_layers + 2)), replace=False))
    fields = {"num_layers": int(rng.integers(1, 3)), "num_heads": int(rng.integers(1, 4)),
              "latent_dim": int(rng.choice([8, 16, 32])), "rope_dim": int(rng.choice([2, 4, 8])),
              "intermediate_size": 2 * int(rng.integers(4, 25)), "block_size": int(rng.integers(2, 9))}
    fields.update(shape)
    cfg = DrafterConfig(hidden_size=hidden_size, target_layers=tuple(int(i) for i in layers), **fields)
    weights = {name: (1.0 + 0.3 * rng.standard_normal(size) if name.endswith("norm.weight")
                      else 0.4 * rng.standard_normal(size)).astype(np.float32)
               for name, size in cfg.parameter_shapes().items()}
    return cfg, weights


def target_embed_lm_head(engine):
    weights = engine.weights
    lm_head = weights["model.embed_tokens.weight" if engine.cfg.tie_word_embeddings else "lm_head.weight"]
    return weights["model.embed_tokens.weight"], lm_head


def save_drafter(directory, cfg, weights):
    cfg.save(directory)
    save_file(directory / "model.safetensors", weights)
    return directory


def compare_with_golden(ids, logprobs, golden_logprobs, top_k):
    """Asserts the device draft against the golden's log-probs [L, V] float64; returns (rows compared id by id,
    rows skipped as near-ties)."""
    depths = golden_logprobs.shape[0]
    assert ids.shape == logprobs.shape == (depths, top_k) and ids.dtype == np.int32 and logprobs.dtype == np.float32
    assert np.isfinite(logprobs).all()
    # each token the device chose carries the golden's log-prob of that token, and the values are the golden's
    # sorted top-K (both hold at near-ties too)
    np.testing.assert_allclose(logprobs, np.take_along_axis(golden_logprobs, ids.astype(np.int64), axis=1),
                               atol=TOLERANCE, rtol=0)
    want_ids, want_values = top_k_rows(golden_logprobs, top_k)
    np.testing.assert_allclose(logprobs, want_values, atol=TOLERANCE, rtol=0)
    assert all(len(set(row)) == top_k for row in ids.tolist())
    ordered = -np.sort(-golden_logprobs, axis=1)[:, :top_k + 1]
    near_tie = (np.diff(-ordered, axis=1) <= TOLERANCE).any(axis=1)  # an order the fp32 rounding may swap
    for depth in np.flatnonzero(~near_tie):
        np.testing.assert_array_equal(ids[depth], want_ids[depth])
    return int((~near_tie).sum()), int(near_tie.sum())


@pytest.mark.sim
def test_device_drafts_equal_the_golden_on_random_inputs(device_backend):
    from kdspec.engine.device.drafter import DeviceDrafter
    engine = api.load("tiny", backend=device_backend)
    model, cfg_t = engine.model, engine.cfg
    embed, lm_head = target_embed_lm_head(engine)
    compared = skipped = 0
    paths = set()
    for seed in range(4):
        rng = np.random.default_rng([18, seed])
        cfg, weights = random_drafter(rng, cfg_t.hidden_size, cfg_t.num_hidden_layers)
        top_k = int(rng.choice([1, 3, 16, 24, 40]))  # <= 16: sampling's register top-k; above: radix select
        paths.add(top_k > 16)
        drafter = DeviceDrafter(cfg, weights, model, top_k)
        capacity = 48
        cache = model.new_cache(capacity, hidden_layers=cfg.target_layers)
        for prefix in sorted(rng.choice(np.arange(1, 41), 4, replace=False)):
            prefix = int(prefix)
            hidden = (rng.standard_normal((len(cfg.target_layers), capacity, cfg.hidden_size))
                      * rng.uniform(0.5, 3.0)).astype(np.float32)
            hidden[:, prefix:] = np.nan  # rows past the prefix must not be read
            cache.hidden.copy_to_device(hidden)
            cache.length = prefix
            if drafter.kv_rows is not None:  # the latent rows a draft reads must be its own
                drafter.kv_rows.copy_to_device(np.full(drafter.kv_rows.shape, np.nan, np.float32))
            bonus = int(rng.integers(cfg_t.vocab_size))
            ids, logprobs = drafter.draft(np.zeros(prefix, np.int64), bonus, prefix, cache)
            golden = log_softmax(draft_logits(cfg, weights, embed, lm_head, hidden[:, :prefix], bonus))
            done, near = compare_with_golden(ids, logprobs, golden, top_k)
            compared, skipped = compared + done, skipped + near
    assert paths == {False, True}
    assert compared >= 0.9 * (compared + skipped) and compared > 40


@pytest.mark.sim
def test_ddtree_with_the_device_drafter_equals_ar(tmp_path, device_backend):
    rng = np.random.default_rng(1818)
    engine = api.load("tiny", backend=device_backend)
    cfg, weights = random_drafter(rng, engine.cfg.hidden_size, engine.cfg.num_hidden_layers, block_size=5,
                                  latent_dim=16, rope_dim=8, num_heads=2, num_layers=2)
    directory = save_drafter(tmp_path, cfg, weights)
    # budget 17: K = 17 candidates per depth, past the register top-k (the radix select runs)
    drafter = engine.block_drafter(str(directory), 17)
    assert isinstance(drafter, BlockDrafter) and drafter.device is not None
    drafts = []
    device_draft = drafter.device.draft
    drafter.device.draft = lambda *args: drafts.append(args[2]) or device_draft(*args)
    prompt = np.array([5, 17, 99, 3, 42, 7])
    for temperature in (0.0, 1.0):
        ar = engine.generate(prompt, DecodeConfig(8, mode="ar", temperature=temperature, seed=3))
        config = DecodeConfig(8, mode="ddtree", drafter=f"dflash:{directory}", block_size=5, budget=17,
                              temperature=temperature, seed=3)
        tree = engine.generate(prompt, config, drafter=drafter)
        np.testing.assert_array_equal(tree.tokens, ar.tokens)
    assert len(drafts) >= 2 and drafts[0] == len(prompt)  # every step drafted on the device, from the prompt on


@pytest.mark.sim
def test_the_reference_backend_keeps_the_golden_drafter(tmp_path):
    engine = api.load("tiny", backend="reference")
    cfg, weights = random_drafter(np.random.default_rng(3), engine.cfg.hidden_size, engine.cfg.num_hidden_layers)
    assert engine.block_drafter(str(save_drafter(tmp_path, cfg, weights)), 4).device is None


@pytest.mark.sim
def test_a_drafter_too_wide_for_the_attention_kernels_is_refused(tmp_path, device_backend):
    # the simulator's kernels take c <= 32, r <= 8 (pycoder-mini's drafter has 64 / 16); a GPU's 512 / 64
    from kdspec.numba_kernels.attention.common import MAX_LATENT, MAX_ROPE
    engine = api.load("tiny", backend=device_backend)
    cfg, weights = random_drafter(np.random.default_rng(4), engine.cfg.hidden_size, engine.cfg.num_hidden_layers,
                                  latent_dim=2 * MAX_LATENT, rope_dim=2 * MAX_ROPE)
    with pytest.raises(DrafterError, match=rf"latent_dim {2 * MAX_LATENT} / rope_dim {2 * MAX_ROPE} exceed .* "
                                           rf"backend '{device_backend}'.* 'reference'"):
        engine.block_drafter(str(save_drafter(tmp_path, cfg, weights)), 4)
    with pytest.raises(DrafterError):  # as kdtree record builds it: one line, exit 2, before any file
        engine.make_drafter([1, 2], DecodeConfig(4, mode="ddtree", drafter=f"dflash:{tmp_path}"))


@pytest.mark.sim
def test_draft_checks_its_cache(tmp_path, device_backend):
    from kdspec.engine.device.drafter import DeviceDrafter
    engine = api.load("tiny", backend=device_backend)
    cfg, weights = random_drafter(np.random.default_rng(5), engine.cfg.hidden_size, engine.cfg.num_hidden_layers)
    drafter = DeviceDrafter(cfg, weights, engine.model, 2)
    with pytest.raises(ValueError, match="cache"):
        drafter.draft([1], 1, 1)
    other = tuple(i for i in range(engine.cfg.num_hidden_layers + 1) if i not in cfg.target_layers)[:1] or (0, 1)
    with pytest.raises(ValueError, match="hidden states"):
        drafter.draft([1], 1, 0, engine.model.new_cache(8, hidden_layers=other))
    cache = engine.model.new_cache(8, hidden_layers=cfg.target_layers)
    with pytest.raises(ValueError, match="committed rows"):
        drafter.draft([1], 1, 1, cache)  # nothing committed yet


@pytest.mark.gpu
def test_pycoder_mini_drafter_on_cuda_equals_the_golden_on_heldout_prompts():
    # the shipped drafter on its target's real hidden states (the device model's, float32): the device forward
    # against the float64 golden of the same inputs, at several prefixes of each held-out prompt, K = 8 (the
    # register top-k) and K = 64 (radix select); then DDTree B = 64 with it equals AR on a few prompts
    engine = api.load("pycoder-mini", backend="cuda")
    prompts = json.loads((Path(model_directory("pycoder-mini")) / "heldout_prompts.json").read_text())["prompts"]
    embed, lm_head = target_embed_lm_head(engine)
    drafters = {k: engine.block_drafter(None, k) for k in (8, 64)}
    cfg, weights = drafters[8].cfg, drafters[8].weights
    assert all(d.device is not None for d in drafters.values())
    compared = skipped = 0
    for prompt in prompts:
        cache = engine.model.new_cache(len(prompt) + cfg.block_size, hidden_layers=cfg.target_layers)
        engine.model.forward(cache, np.asarray(prompt), np.arange(len(prompt)))
        engine.model.commit(cache, len(prompt))
        hidden = engine.model.hidden_rows(cache, len(prompt)).astype(np.float64)
        for prefix in (1, len(prompt) // 2, len(prompt) - 1):
            bonus = int(prompt[prefix])
            golden = log_softmax(draft_logits(cfg, weights, embed, lm_head, hidden[:, :prefix], bonus))
            for k, drafter in drafters.items():
                ids, logprobs = drafter.draft(prompt[:prefix], bonus, prefix, cache)
                done, near = compare_with_golden(ids, logprobs, golden, k)
                compared, skipped = compared + done, skipped + near
    assert compared >= 0.9 * (compared + skipped)
    for prompt in prompts[:4]:
        ar = engine.generate(prompt, DecodeConfig(64, mode="ar"))
        tree = engine.generate(prompt, DecodeConfig(64, mode="ddtree", drafter="dflash", block_size=cfg.block_size,
                                                    budget=64))
        np.testing.assert_array_equal(tree.tokens, ar.tokens)
