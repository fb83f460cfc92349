"""The trained block drafter in the decode loop: parsed from --drafter, fed the target's kept hidden states
through the cache, lossless at T = 0, and the same drafts on the device model (simulator) as on the golden."""
import numpy as np
import pytest

from kdspec.engine.decode import api
from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.decode.drafters import BlockDrafter, DrafterSpec, parse_drafter, top_k_rows
from kdspec.engine.model.drafter import DrafterConfig, DrafterError
from kdspec.engine.model.safetensors_io import save_file


def random_drafter_dir(tmp_path, hidden_size, target_layers, seed=0):
    cfg = DrafterConfig(hidden_size=hidden_size, target_layers=target_layers, num_layers=2, num_heads=2,
                        latent_dim=8, rope_dim=4, intermediate_size=24, block_size=5)
    rng = np.random.default_rng(seed)
    weights = {name: (1.0 + 0.3 * rng.standard_normal(shape) if name.endswith("norm.weight")
                      else 0.4 * rng.standard_normal(shape)).astype(np.float32)
               for name, shape in cfg.parameter_shapes().items()}
    cfg.save(tmp_path)
    save_file(tmp_path / "model.safetensors", weights)
    return tmp_path


def test_parse_dflash_keeps_the_directory_as_written():
    assert parse_drafter("dflash") == DrafterSpec("dflash")
    assert str(parse_drafter("DFlash:/Some/Dir")) == "dflash:/Some/Dir"
    assert not parse_drafter("dflash").needs_golden and parse_drafter("noisy:0.5").needs_golden
    with pytest.raises(ValueError, match="needs a directory"):
        parse_drafter("dflash:")


def test_top_k_rows_sorted_with_ties_to_the_lower_id():
    logprobs = np.log(np.array([[0.1, 0.4, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1]]))
    ids, values = top_k_rows(logprobs, 3)
    assert ids.tolist() == [[1, 2, 0], [0, 1, 2]] and np.all(np.diff(values, axis=1) <= 0)


def test_shipped_drafter_is_lossless_and_drafts_real_tokens():
    engine = api.load("pycoder-mini", backend="reference")
    prompt = engine.encode_prompt("def parse(text):\n    ")
    config = DecodeConfig(16, mode="ddtree", drafter="dflash", block_size=8, budget=16)
    result = engine.generate(prompt, config, golden=True)
    assert result.golden_match  # DDTree with a trained drafter commits the golden AR tokens at T = 0
    assert max(result.taus) > 1  # and the drafter's tokens are accepted at least once


def test_a_drafter_for_another_target_is_refused(tmp_path):
    engine = api.load("tiny", backend="reference")
    directory = random_drafter_dir(tmp_path, hidden_size=48, target_layers=(0, 2))
    with pytest.raises(DrafterError, match="hidden_size"):
        engine.block_drafter(str(directory), 4)


@pytest.mark.sim
def test_device_model_keeps_the_hidden_states_the_golden_keeps(tmp_path, device_backend):
    # drafts read the cache's kept hidden states, which the verify writes and compaction moves: the same
    # drafts (so the same taus and tokens) on the simulated device model as on the golden
    directory = random_drafter_dir(tmp_path, hidden_size=32, target_layers=(0, 1, 2))
    config = DecodeConfig(12, mode="ddtree", drafter=f"dflash:{directory}", block_size=5, budget=6)
    prompt = np.array([5, 17, 99, 3, 42])
    runs, records = {}, {}
    for backend in ("reference", device_backend):
        engine = api.load("tiny", backend=backend)
        records[backend] = []
        runs[backend] = engine.generate(prompt, config, golden=True, on_step=records[backend].append)
        assert isinstance(engine.block_drafter(str(directory), 4), BlockDrafter)
    assert runs[device_backend].golden_match and runs["reference"].golden_match
    assert runs[device_backend].taus == runs["reference"].taus
    assert len(records[device_backend]) == len(records["reference"]) > 2
    for on_device, golden in zip(records[device_backend], records["reference"]):
        # the drafts of every step, from hidden states the device kept (float32) and the golden kept (float64)
        np.testing.assert_array_equal(on_device["draft_ids"], golden["draft_ids"])
        np.testing.assert_allclose(on_device["draft_logprobs"], golden["draft_logprobs"], atol=1e-4)


@pytest.mark.sim
def test_device_hidden_rows_follow_verify_and_compaction_like_the_golden(device_backend):
    # a prefill, then a verify over a branching tree and a compaction that moves rows: the kept hidden states
    # of the committed rows match the golden's (float32 vs float64)
    from kdspec.engine.golden import ddtree
    layers = (0, 1, 2)
    device, golden = api.load("tiny", backend=device_backend).model, api.load("tiny", backend="reference").model
    parents = np.array([-1, 0, 0, 1, 2, 4])
    tokens = np.array([7, 8, 9, 10, 11, 12])
    depths = np.array([0, 1, 1, 2, 2, 3])
    visibility = ddtree.visibility_from_parents(parents)
    accepted = np.array([0, 2, 4, 5])
    kept = {}
    for name, model in (("device", device), ("reference", golden)):
        cache = model.new_cache(32, hidden_layers=layers)
        prompt = np.array([3, 1, 4, 1, 5])
        model.forward(cache, prompt, np.arange(5))
        model.commit(cache, 5)
        model.forward(cache, tokens, 5 + depths, visibility)
        model.compact(cache, accepted)
        kept[name] = np.asarray(model.hidden_rows(cache, cache.length), dtype=np.float64)
    assert kept["device"].shape == (3, 9, 32)
    np.testing.assert_allclose(kept["device"], kept["reference"], atol=1e-4, rtol=1e-4)


@pytest.mark.sim
@pytest.mark.parametrize("accepted, launches", [([0, 1, 2], 0), ([0], 0), ([0, 2, 4], 2)])
def test_compaction_of_a_path_already_in_place_launches_nothing(monkeypatch, device_backend, accepted, launches):
    """accepted = 0, 1, .., tau-1 (the root and a chain of first-numbered children): the rows are where
    compaction would put them, so no kernel runs; the cache then equals the golden's, as after a moving one."""
    from kdspec.engine.device import model as device_model
    from kdspec.engine.golden import ddtree
    calls = []
    real = device_model.kv_compact.compact_rows
    monkeypatch.setattr(device_model.kv_compact, "compact_rows", lambda *a, **k: (calls.append(1), real(*a, **k)))
    parents = np.array([-1, 0, 1, 0, 2, 3])   # nodes 0 -> 1 -> 2 -> 4 and 0 -> 3 -> 5
    depths = np.array([0, 1, 2, 1, 3, 2])
    tokens = np.array([7, 8, 9, 10, 11, 12])
    kept = {}
    for name in (device_backend, "reference"):
        model = api.load("tiny", backend=name).model
        cache = model.new_cache(32, hidden_layers=(0, 2))
        model.forward(cache, np.array([3, 1, 4, 1, 5]), np.arange(5))
        model.commit(cache, 5)
        model.forward(cache, tokens, 5 + depths, ddtree.visibility_from_parents(parents))
        model.compact(cache, np.array(accepted))
        assert cache.length == 5 + len(accepted)
        kept[name] = np.asarray(model.hidden_rows(cache, cache.length), dtype=np.float64)
    assert len(calls) == launches   # the kv rows and the kept hidden states: one launch each when rows move
    np.testing.assert_allclose(kept[device_backend], kept["reference"], atol=1e-4, rtol=1e-4)
