"""The CLI: bad input gives one line on stderr and exit 2, before any training library is needed."""
import pytest

from kdspec.engine.train.target import main


def run_main(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def test_empty_corpus_directory(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, err = run_main(capsys, ["--corpus", str(tmp_path / "empty"), "--out", str(tmp_path / "out")])
    assert code == 2 and err.count("\n") == 1 and "empty" in err
    assert not (tmp_path / "out").exists()


def test_corpus_directory_without_python(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("x")
    code, err = run_main(capsys, ["--corpus", str(tmp_path / "src"), "--out", str(tmp_path / "out")])
    assert code == 2 and err.count("\n") == 1 and "no .py file" in err


@pytest.mark.parametrize("size", ["0", "100"])
def test_bad_vocab_size(tiny_stdlib, tmp_path, capsys, size):
    code, err = run_main(capsys, ["--corpus", str(tiny_stdlib), "--out", str(tmp_path / "out"),
                                  "--vocab-size", size])
    assert code == 2 and err.count("\n") == 1 and "vocab size" in err


def test_existing_out_dir_without_force(tiny_stdlib, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    code, err = run_main(capsys, ["--corpus", str(tiny_stdlib), "--out", str(tmp_path / "out")])
    assert code == 2 and err.count("\n") == 1 and "--force" in err


@pytest.mark.parametrize("args, words", [
    (["--corpus", "{empty}", "--out", "{out}"], "corpus directory is empty"),
    (["--vocab-size", "0", "--out", "{out}"], "vocab size"),
    (["--out", "{exists}"], "exists"),
])
def test_kdtree_train_target_bad_input_is_one_line_exit_2(tmp_path, capsys, args, words):
    from kdspec.kdtree_tui import cli
    (tmp_path / "empty").mkdir()
    (tmp_path / "exists").mkdir()
    paths = {"empty": tmp_path / "empty", "out": tmp_path / "out", "exists": tmp_path / "exists"}
    assert cli.main(["train", "target"] + [a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()
