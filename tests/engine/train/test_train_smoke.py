"""A few CPU steps of the real trainer at toy size: the model directory it writes, end to end."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from kdspec.engine.train.prepare import load_prepared, prepare_data  # noqa: E402
from kdspec.engine.train.recipe import ModelShape  # noqa: E402
from kdspec.engine.train.target import main  # noqa: E402


def test_smoke_training_writes_a_loadable_model_directory(tiny_stdlib, tmp_path, capsys):
    import torch
    import transformers
    from safetensors import safe_open

    data = tmp_path / "data"
    prepare_data(tiny_stdlib, data, vocab_size=300, log=lambda line: None)
    out = tmp_path / "model"
    code = main(["--corpus", str(data), "--out", str(out), "--shape", "smoke", "--max-steps", "3",
                 "--time-budget", "60", "--device", "cpu", "--seed", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "tok/s" in printed and "held-out" in printed
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "generation_config.json",
                                               "tokenizer.json", "manifest.json", "train.log"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["steps"] == 3 and len(manifest["loss_curve"]) == 3
    assert all(point["heldout_expert_cv"] >= 0 for point in manifest["loss_curve"])
    assert manifest["heldout"]["predictions"] == len(load_prepared(data).heldout) - 1
    assert manifest["baselines"]["this_run"]["xz_per_file"] == manifest["baselines"]["data_dir"]["xz_per_file"]
    assert len(manifest["samples"]) >= 1 and all("continuation" in s for s in manifest["samples"])
    assert manifest["parameters"] == ModelShape(**manifest["recipe"]["shape"]).parameter_count()

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        assert bias.dtype == torch.float32 and bias.abs().max() > 0  # the balancing moved it
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.embed_tokens.weight")[0].abs().max() > 0  # EOD's row is trained (no pad row)
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = reloaded.model.layers[1].mlp.gate.e_score_correction_bias
    assert got.tolist() == pytest.approx(manifest["e_score_correction_bias"]["values"][0])
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["n_group"] == 2
