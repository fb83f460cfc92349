"""Checkpoint directories that must be refused with a one-line CheckpointError (issue 21, defects 12 and 7)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kdspec.engine.model.checkpoint import CheckpointError, load_model, save_model
from kdspec.engine.model.config import PRESETS


@pytest.fixture
def sharded(tmp_path):
    """tiny saved in several shards (with an index), and a copy of one shard outside the directory."""
    cfg, weights = load_model("tiny")
    directory = tmp_path / "model"
    paths = save_model(directory, cfg, weights, max_shard_bytes=20_000)
    assert len(paths) > 1
    return directory


@pytest.mark.parametrize("where", ["../outside.safetensors", "{abs}", "sub/../../outside.safetensors"])
def test_shards_outside_the_directory_are_refused(sharded, where):
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(index["weight_map"])[0]
    # the shard that holds it, copied outside: a loader that follows the path would load it fine
    (sharded.parent / "outside.safetensors").write_bytes((sharded / index["weight_map"][first]).read_bytes())
    index["weight_map"][first] = where.format(abs=str(sharded.parent / "outside.safetensors"))
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as excinfo:
        load_model(sharded)
    assert "\n" not in str(excinfo.value)


def test_shards_inside_the_directory_still_load(sharded):
    cfg, weights = load_model(sharded)
    assert cfg.num_hidden_layers == PRESETS["tiny"].num_hidden_layers and weights


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10 ** 9), ("num_nextn_predict_layers", 10 ** 12),
                                         ("num_nextn_predict_layers", -3), ("num_nextn_predict_layers", "2")])
def test_absurd_layer_counts_are_refused_before_building_tensor_names(tmp_path, field, value):
    """A config.json claiming 10^9 layers built every tensor name (GBs) before any check: now the checkpoint's
    own tensors bound it."""
    import resource
    import time
    cfg, weights = load_model("tiny")
    directory = tmp_path / "model"
    save_model(directory, cfg, weights)
    config = json.loads((directory / "config.json").read_text())
    config[field] = value
    (directory / "config.json").write_text(json.dumps(config))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=field) as excinfo:
        load_model(directory)
    assert time.monotonic() - start < 5 and "\n" not in str(excinfo.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB
