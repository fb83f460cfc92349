"""--force replaces an earlier run's output and nothing else (engine/train/outputs.py)."""
import pytest

from kdspec.engine.train.errors import TrainError
from kdspec.engine.train.outputs import check_output_dir, replace_output_dir

OURS = ("config.json", "model.safetensors", "manifest.json", "train.log")


def test_an_earlier_runs_output_is_replaced_only_with_force(tmp_path):
    out = tmp_path / "drafter"
    out.mkdir()
    for name in OURS:
        (out / name).write_text("old")
    with pytest.raises(TrainError, match="--force"):
        check_output_dir(out, False, OURS)
    replace_output_dir(out, True, OURS)
    assert out.is_dir() and list(out.iterdir()) == []


def test_an_absent_directory_needs_no_force_an_existing_one_does(tmp_path):
    replace_output_dir(tmp_path / "new" / "deep", False, OURS)
    assert (tmp_path / "new" / "deep").is_dir()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TrainError, match="--force"):
        replace_output_dir(empty, False, OURS)
    replace_output_dir(empty, True, OURS)
    assert empty.is_dir()


@pytest.mark.parametrize("extra", ["notes.txt", "drafter/", "link"])
def test_a_directory_holding_anything_else_is_never_deleted(tmp_path, extra):
    # a mistyped --out (a home directory, a model directory with its drafter inside) must survive --force
    out = tmp_path / "home"
    out.mkdir()
    (out / "config.json").write_text("keep")
    if extra == "drafter/":
        (out / "drafter").mkdir()
    elif extra == "link":
        (tmp_path / "elsewhere").write_text("x")
        (out / "train.log").symlink_to(tmp_path / "elsewhere")
    else:
        (out / extra).write_text("keep")
    with pytest.raises(TrainError, match="not replacing it"):
        replace_output_dir(out, True, OURS)
    assert (out / "config.json").read_text() == "keep"


def test_a_file_in_the_way_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("keep")
    with pytest.raises(TrainError, match="not a directory"):
        replace_output_dir(path, True, OURS)
    assert path.read_text() == "keep"
