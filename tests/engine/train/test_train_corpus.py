"""corpus.py: file selection, the held-out hash rule, split digests, the corpus file, bad input."""
import hashlib
import lzma

import pytest
from train_helpers import heldout_by_hand, module_relpaths

from kdspec.engine.train.corpus import (HELDOUT, TRAIN, build_corpus, collect_sources, is_heldout, read_corpus,
                                 split_digest, split_files)
from kdspec.engine.train.errors import TrainError


def test_collect_keeps_stdlib_py_sorted_and_skips_the_rest(tiny_stdlib):
    files, skipped = collect_sources(tiny_stdlib)
    relpaths = [f.relpath for f in files]
    assert relpaths == sorted(module_relpaths())
    assert skipped == ["latin1.py"]
    assert not any("site-packages" in r for r in relpaths)


def test_heldout_rule_matches_sha256_by_hand(tiny_stdlib):
    files, _ = collect_sources(tiny_stdlib)
    for f in files:
        assert (f.split == HELDOUT) == heldout_by_hand(f.relpath) == is_heldout(f.relpath)
    assert split_files(files, HELDOUT) and split_files(files, TRAIN)


def test_heldout_rule_is_about_five_percent():
    held = sum(is_heldout(f"dir/file_{i}.py") for i in range(20000))
    assert 900 < held < 1100


def test_split_is_deterministic_and_digest_recomputes(tiny_stdlib):
    a, _ = collect_sources(tiny_stdlib)
    b, _ = collect_sources(tiny_stdlib)
    assert a == b
    heldout = split_files(a, HELDOUT)
    h = hashlib.sha256()
    for f in heldout:
        data = f.text.encode()
        h.update(f.relpath.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    assert split_digest(heldout) == h.hexdigest()


def test_corpus_file_round_trips_with_manifest(tiny_stdlib, tmp_path):
    files, manifest = build_corpus(tiny_stdlib, tmp_path / "corpus.jsonl.xz")
    again, manifest_again = read_corpus(tmp_path / "corpus.jsonl.xz")
    assert again == files and manifest_again == manifest
    assert manifest.train.files + manifest.heldout.files == len(files)
    assert manifest.heldout.bytes == sum(len(f.text.encode()) for f in split_files(files, HELDOUT))
    assert manifest.skipped_not_utf8 == ("latin1.py",)


def test_corpus_file_with_a_moved_file_is_refused(tiny_stdlib, tmp_path):
    path = tmp_path / "corpus.jsonl.xz"
    build_corpus(tiny_stdlib, path)
    lines = lzma.open(path, "rt").read().splitlines()
    tampered = tmp_path / "tampered.jsonl.xz"
    with lzma.open(tampered, "wt") as f:
        f.write("\n".join(lines[:1] + lines[2:]) + "\n")  # drop one file
    with pytest.raises(TrainError, match="do not match the manifest"):
        read_corpus(tampered)


@pytest.mark.parametrize("make, message", [
    (lambda p: p, "no .py file"),
    (lambda p: (p / "a.txt").write_text("x") and p, "no .py file"),
    (lambda p: (p / "bad.py").write_bytes(b"\xff\xfe") and p, "not UTF-8"),
    (lambda p: p / "missing", "not a directory"),
])
def test_bad_corpus_sources_raise_train_error(tmp_path, make, message):
    root = make(tmp_path)
    with pytest.raises(TrainError, match=message) as info:
        collect_sources(root)
    assert "\n" not in str(info.value)
