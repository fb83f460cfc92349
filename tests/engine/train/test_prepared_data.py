"""A prepared data directory that is not one: one TrainError line, never a traceback (engine/train/prepare.py)."""
import json

import numpy as np
import pytest

from kdspec.engine.train.errors import TrainError
from kdspec.engine.train.prepare import file_sha256, load_prepared


def _damage(kind, tmp_path):
    """A path to hand load_prepared, damaged as ``kind`` says."""
    root = tmp_path / "data"
    root.mkdir()
    if kind == "a file":
        (tmp_path / "file").write_text("x")
        return tmp_path / "file", "no such prepared data directory"
    if kind == "missing":
        return tmp_path / "absent", "no such prepared data directory"
    manifest = root / "data_manifest.json"
    if kind == "manifest not UTF-8":
        manifest.write_bytes(b"\xff\xfe{")
        return root, "not a data manifest"
    if kind == "manifest a directory":
        manifest.mkdir()
        return root, "cannot read"
    if kind == "manifest a list":
        manifest.write_text("[]")
        return root, "not a data manifest"
    # a stream file whose digest the manifest records but which is no .npy array
    for name in ("tokenizer.json", "baselines.json"):
        (root / name).write_text("{}")
    (root / "train_tokens.npy").write_bytes(b"not numpy")
    np.save(root / "heldout_tokens.npy", np.array([0, 5, 0], dtype=np.uint16))
    streams = {s: {"file": f"{s}_tokens.npy", "sha256": file_sha256(root / f"{s}_tokens.npy")}
               for s in ("train", "heldout")}
    manifest.write_text(json.dumps({"tokenizer": {"file": "tokenizer.json",
                                                  "sha256": file_sha256(root / "tokenizer.json")},
                                    "streams": streams, "baselines_file": "baselines.json"}))
    return root, "not a numpy array file"


@pytest.mark.parametrize("kind", ["a file", "missing", "manifest not UTF-8", "manifest a directory",
                                  "manifest a list", "stream not numpy"])
def test_damaged_data_directories_are_one_line(tmp_path, kind):
    path, words = _damage(kind, tmp_path)
    with pytest.raises(TrainError, match=words) as e:
        load_prepared(path)
    assert "\n" not in str(e.value)
