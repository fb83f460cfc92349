"""The shipped trained target, pycoder-mini: intact, loadable by name, and read the way transformers reads it.

The HF comparison runs where torch and transformers are installed (skipped otherwise, e.g. in CI): transformers'
own DeepseekV3ForCausalLM, in float64 on the CPU, greedy-generates the same tokens from the same directory as
the engine's float64 golden.
"""
import hashlib
import json

import numpy as np
import pytest

from kdspec.engine.decode import api
from kdspec.engine.model.checkpoint import load_model, model_directory
from kdspec.engine.model.tokenizer import BpeTokenizer, tokenizer_for

DIRECTORY = model_directory("pycoder-mini")
MANIFEST = json.loads((DIRECTORY / "manifest.json").read_text())


def test_shipped_files_match_the_manifest_digests():
    for entry in MANIFEST["files"]:
        data = (DIRECTORY / entry["file"]).read_bytes()
        assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]


def test_shipped_model_is_small_and_balanced_with_a_real_bias():
    cfg, weights = load_model("pycoder-mini")
    params = sum(w.size for w in weights.values())
    assert params == MANIFEST["parameters"] and params <= 8.5e6
    assert sum(p.stat().st_size for p in DIRECTORY.iterdir()) <= 16.5e6
    biases = [weights[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
              for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert biases and all(np.ptp(b) > 0 for b in biases)  # the aux-loss-free update left a non-trivial bias


def test_tokenizer_round_trips_source_text():
    tokenizer = tokenizer_for(DIRECTORY, bos_token_id=0)
    assert isinstance(tokenizer, BpeTokenizer)
    text = "def greet(name):\n    return f'héllo {name}'  # ünïcode\n"
    ids = tokenizer.encode(text)
    assert ids[0] == 0 and len(ids) < len(text.encode())  # bos, then fewer tokens than bytes
    assert tokenizer.decode(ids[1:]) == text
    assert b"".join(tokenizer.token_bytes(i) for i in ids[1:]).decode() == text


def test_engine_golden_equals_transformers_greedy_generation():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    prompt = np.array(MANIFEST["samples"][1]["prompt_ids"])  # a held-out function header
    golden = api.load("pycoder-mini", backend="reference").golden(prompt, 24)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DIRECTORY), dtype=torch.float64,
                                                           experts_implementation="eager").eval()
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt.tolist()]), max_new_tokens=24, do_sample=False)
        logits = hf(torch.tensor([prompt.tolist() + list(golden.tokens[:-1])])).logits[0, len(prompt) - 1:]
    assert generated[0, len(prompt):].tolist() == list(golden.tokens)
    assert np.abs(logits.numpy() - np.asarray(golden.logits)).max() < 1e-4


def test_kept_hidden_states_are_transformers_hidden_states():
    # a block drafter reads the residual stream entering layer i (transformers' hidden_states[i]) or, for
    # i == layers, leaving the last layer (transformers gives it normed: compare after the final norm)
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    engine = api.load("pycoder-mini", backend="reference")
    model, layers = engine.reference, engine.cfg.num_hidden_layers
    prompt = np.array(MANIFEST["samples"][0]["prompt_ids"])
    cache = model.new_cache(32, hidden_layers=(0, 2, layers))
    model.forward(cache, prompt, np.arange(len(prompt)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DIRECTORY), dtype=torch.float64,
                                                           experts_implementation="eager").eval()
    with torch.no_grad():
        states = hf(torch.tensor([prompt.tolist()]), output_hidden_states=True).hidden_states
    from kdspec.engine.golden.layers import rms_norm
    kept = list(cache.hidden[:, :len(prompt)])
    kept[2] = rms_norm(kept[2], engine.weights["model.norm.weight"], engine.cfg.rms_norm_eps)
    for slot, index in enumerate((0, 2, layers)):
        # 1e-5: transformers builds its RoPE tables in float32 (seen: up to 2e-6 apart)
        np.testing.assert_allclose(kept[slot], states[index][0].numpy(), atol=1e-5)
