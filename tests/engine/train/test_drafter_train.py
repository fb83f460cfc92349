"""The drafter trainer end to end on a tiny random DeepseekV3 target (CPU), and its one-line input errors."""
import hashlib
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kdspec.engine.model.drafter import DrafterConfig  # noqa: E402
from kdspec.engine.model.safetensors_io import load_file  # noqa: E402
from kdspec.engine.train.drafter_data import build_sets, usable_anchors  # noqa: E402
from kdspec.engine.train.drafter_train import main  # noqa: E402
from kdspec.engine.train.recipe import SMOKE  # noqa: E402

VOCAB = SMOKE.vocab_size


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**SMOKE.hf_config_kwargs(0))
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A prepared-data directory by hand: two uint16 streams of random documents, EOD around each."""
    out = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    streams = {}
    for split, docs in (("train", 40), ("heldout", 8)):
        parts = [[0]]
        for _ in range(docs):
            parts.append(list(rng.integers(1, VOCAB, size=int(rng.integers(20, 60)))) + [0])
        stream = np.array([t for p in parts for t in p], dtype=np.uint16)
        np.save(out / f"{split}_tokens.npy", stream)
        streams[split] = {"file": f"{split}_tokens.npy", "tokens": len(stream),
                          "sha256": _sha(out / f"{split}_tokens.npy")}
    (out / "tokenizer.json").write_text("{}")
    (out / "baselines.json").write_text("{}")
    manifest = {"tokenizer": {"file": "tokenizer.json", "sha256": _sha(out / "tokenizer.json"), "vocab_size": VOCAB,
                              "requested_vocab_size": VOCAB, "eod_id": 0},
                "streams": streams, "baselines_file": "baselines.json"}
    (out / "data_manifest.json").write_text(json.dumps(manifest))
    return out


def _with_tokenizer(target, copy, text):
    """A copy of ``target`` that ships a tokenizer.json with ``text``."""
    import shutil
    shutil.copytree(target, copy)
    (copy / "tokenizer.json").write_text(text)
    return copy


SMALL = ["--train-sequences", "6", "--val-sequences", "2", "--heldout-sequences", "3", "--new-tokens", "20",
         "--prompt-min", "5", "--prompt-max", "9", "--gen-batch", "4", "--batch-sequences", "2", "--anchors-per-sequence", "3",
         "--eval-anchors-per-sequence", "4", "--tree-blocks", "8", "--device", "cpu", "--time-budget", "60"]


def test_two_steps_write_the_drafter_directory(tiny_target, tiny_data, tmp_path, capsys):
    out = tmp_path / "drafter"
    code = main(["--target", str(tiny_target), "--data", str(tiny_data), "--out", str(out), "--max-steps", "2",
                 "--num-layers", "1", "--block-size", "4", "--gamma", "3", *SMALL])
    assert code == 0
    printed = capsys.readouterr().out
    assert "blocks/s" in printed and "validation tau" in printed and "bigram_corpus" in printed
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "manifest.json", "train.log"}
    cfg = DrafterConfig.load(out)
    assert cfg.hidden_size == SMOKE.hidden_size and cfg.num_layers == 1 and cfg.block_size == 4
    assert cfg.target_layers == (0, 1, 2)  # a 2-layer target: embedding output, after layer 0, after layer 1
    assert cfg.target["model_safetensors_sha256"] == _sha(tiny_target / "model.safetensors")
    tensors = load_file(out / "model.safetensors")
    assert {name: tuple(t.shape) for name, t in tensors.items()} == cfg.parameter_shapes()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["steps"] == 2 and len(manifest["loss_curve"]) == 1
    assert manifest["recipe"]["gamma"] == 3.0 and "fp32 greedy chain" in manifest["recipe"]["labels"]
    assert manifest["data"]["train_stream_sha256"] == _sha(tiny_data / "train_tokens.npy")
    generated = manifest["data"]["generated"]
    assert (generated["train"]["sequences"], generated["validation"]["sequences"],
            generated["heldout"]["sequences"]) == (6, 2, 3)
    assert manifest["best_step"] == 2
    held = manifest["heldout"]
    assert 0.5 <= held["temperature"]["temperature"] <= 4.0
    for name in ("drafter", "drafter_before_temperature", "bigram_target_generated", "bigram_corpus"):
        report = held[name]
        assert 1.0 <= report["tau_chain"] <= 4.0 and len(report["chain_acceptance_per_depth"]) == 3
        assert report["blocks"] == held["drafter"]["blocks"] > 0
        assert set(report["tree_tau_estimate"]) >= {"8", "64", "256"}
    assert [f["file"] for f in manifest["files"]] == ["config.json", "model.safetensors"]


def test_heldout_prompts_come_from_the_heldout_stream_only(tiny_target):
    """Training prompts from the training stream, held-out prompts from the held-out stream (disjoint tokens
    here), generated in one batch; continuations are the target's greedy choices."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    train_stream = np.concatenate([[0], rng.integers(1, 150, 400), [0]]).astype(np.uint16)
    heldout_stream = np.concatenate([[0], rng.integers(150, VOCAB, 400), [0]]).astype(np.uint16)
    train, heldout = build_sets(model, train_stream, heldout_stream, train_sequences=5, heldout_sequences=3,
                                new_tokens=6, prompt_min=4, prompt_max=7, gen_batch=4, depths=2, layers=(1, 2),
                                seed=0, device=torch.device("cpu"), autocast=False, log=lambda line: None)
    assert (train.sequences, heldout.sequences) == (5, 3)
    for gen, lo, hi in ((train, 1, 149), (heldout, 150, VOCAB - 1)):
        for s in range(gen.sequences):
            prompt = gen.tokens[s, :int(gen.prompt_lengths[s])]
            assert int(prompt.min()) >= lo and int(prompt.max()) <= hi
            assert int(gen.lengths[s]) == int(gen.prompt_lengths[s]) + 6
    seq = heldout.tokens[0, :int(heldout.lengths[0])]
    with torch.no_grad():
        out = model(input_ids=seq[None], output_hidden_states=True)
        argmax = out.logits[0].argmax(-1)
        d = SMOKE.hidden_size
        taps = heldout.hidden[0, :len(seq)]
        # tap 1 = transformers' hidden_states[1]; tap 2 (the last layer) is the state BEFORE the final norm
        torch.testing.assert_close(taps[:, :d], out.hidden_states[1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.model.norm(taps[None, :, d:])[0], out.hidden_states[2][0], atol=1e-5,
                                   rtol=1e-5)
    assert torch.equal(seq[int(heldout.prompt_lengths[0]):], argmax[int(heldout.prompt_lengths[0]) - 1:-1])
    assert heldout.hidden.shape == (3, 7 + 6, 2 * SMOKE.hidden_size)


def test_usable_anchors_need_room_and_greedy_rows():
    greedy = torch.ones(2, 10, dtype=torch.bool)
    greedy[1, 6] = False
    ok = usable_anchors(greedy, torch.tensor([10, 9]), torch.tensor([3, 2]), depths=2)
    assert ok[0].nonzero().flatten().tolist() == [3, 4, 5, 6, 7]
    assert ok[1].nonzero().flatten().tolist() == [2, 3]  # P + 2 <= 8 and rows P..P+2 avoid row 6


@pytest.mark.parametrize("change, message", [
    (lambda a, t, d, o: a.__setitem__(1, str(t / "missing")), "no such target"),
    (lambda a, t, d, o: o.mkdir(), "exists"),
    (lambda a, t, d, o: a.extend(["--block-size", "1"]), "block-size"),
    (lambda a, t, d, o: a.__setitem__(1, str(_with_tokenizer(t, o.parent / "target", '{"model": "another"}'))),
     "tokenizer.json differs from the target's"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_target, tiny_data, tmp_path, capsys, change, message):
    out = tmp_path / "drafter"
    args = ["--target", str(tiny_target), "--data", str(tiny_data), "--out", str(out), *SMALL]
    change(args, tiny_target, tiny_data, out)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
