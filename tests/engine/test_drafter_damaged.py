"""A damaged drafter directory is one line and exit 2 from `kdtree record`, before any output file exists."""
from __future__ import annotations

import json
import shutil

import pytest

from kdspec.engine.model.checkpoint import model_directory
from kdspec.kdtree_tui import cli

SHIPPED = model_directory("pycoder-mini") / "drafter"


def config_edit(**changes):
    def make(d):
        data = json.loads((SHIPPED / "config.json").read_text())
        data.update(changes)
        (d / "config.json").write_text(json.dumps(data))
    return make


def deep(d):
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)


DAMAGE = {
    "a file, not a directory": lambda d: (shutil.rmtree(d), d.write_text("x")),
    "config.json a directory": lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()),
    "config.json a JSON list": lambda d: (d / "config.json").write_text("[1, 2]"),
    "config.json not UTF-8": lambda d: (d / "config.json").write_bytes(b"{\"a\": \"\xff\xfe\"}"),
    "config.json nested 100,000 deep": deep,
    "config.json truncated": lambda d: (d / "config.json").write_text('{"architecture": '),
    "another architecture": config_edit(architecture="llama"),
    "target_layers of strings": config_edit(target_layers=["a", "b"]),
    "num_layers a string": config_edit(num_layers="two"),
    "block_size 1": config_edit(block_size=1),
    "a shape the weights lack": config_edit(num_heads=7),
    "no weights": lambda d: (d / "model.safetensors").unlink(),
    "garbage weights": lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64),
    "weights a directory": lambda d: ((d / "model.safetensors").unlink(), (d / "model.safetensors").mkdir()),
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_drafter_is_one_line(tmp_path, capsys, damage):
    drafter = tmp_path / "drafter"
    shutil.copytree(SHIPPED, drafter)
    DAMAGE[damage](drafter)
    out = tmp_path / "t.h5"
    code = cli.main(["record", "--model", "pycoder-mini", "--backend", "reference", "--drafter", f"dflash:{drafter}",
                     "--max-new-tokens", "4", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("kdtree record: error:"), err
    assert not out.exists() and not list(tmp_path.glob("*.h5*")) and not list(tmp_path.glob(".t.h5*"))
