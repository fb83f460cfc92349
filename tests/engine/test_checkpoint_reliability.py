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
