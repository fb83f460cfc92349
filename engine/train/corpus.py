"""The training corpus: every .py file under a Python standard library root, split by file into train / held-out.

A file is held out when the first 8 bytes of sha256(relpath), read big-endian, are < 500 modulo 10000 (about
5%); relpath is the POSIX path relative to the root. Files are kept in sorted relpath order. Third-party
code stays out: any path through ``site-packages`` or ``dist-packages`` is skipped, and so is any file that
is not valid UTF-8 (counted). The corpus file is xz-compressed JSON lines: first ``{"manifest": {...}}``
(``CorpusManifest.to_dict``), then one ``{"relpath", "split", "text"}`` object per file, in corpus order.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import TrainError

TRAIN, HELDOUT = "train", "heldout"
SPLITS = (TRAIN, HELDOUT)
HELDOUT_PER_10000 = 500
THIRD_PARTY_DIRS = frozenset({"site-packages", "dist-packages"})
CORPUS_FILE = "corpus.jsonl.xz"


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: its relative path, its text (exact bytes decoded as UTF-8) and its split."""

    relpath: str
    text: str
    split: str

    @property
    def data(self) -> bytes:
        return self.text.encode("utf-8")


@dataclass(frozen=True)
class SplitStats:
    """File count, UTF-8 bytes and digest of one split (see ``split_digest``)."""

    files: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class CorpusManifest:
    """What the corpus is: the Python that built it, where from, and each split's stats."""

    python_version: str
    source_root: str
    heldout_rule: str
    skipped_not_utf8: tuple[str, ...]
    train: SplitStats
    heldout: SplitStats

    def to_dict(self) -> dict:
        d = asdict(self)
        d["skipped_not_utf8"] = list(self.skipped_not_utf8)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CorpusManifest":
        try:
            return cls(python_version=d["python_version"], source_root=d["source_root"],
                       heldout_rule=d["heldout_rule"], skipped_not_utf8=tuple(d["skipped_not_utf8"]),
                       train=SplitStats(**d[TRAIN]), heldout=SplitStats(**d[HELDOUT]))
        except (KeyError, TypeError) as e:
            raise TrainError(f"corpus manifest lacks or mistypes a field ({type(e).__name__}: {e})") from None


HELDOUT_RULE = (f"held out iff int.from_bytes(sha256(relpath).digest()[:8], 'big') % 10000 < {HELDOUT_PER_10000}"
                " (relpath: POSIX path relative to the source root)")


def is_heldout(relpath: str) -> bool:
    """The held-out rule on a POSIX relative path."""
    head = hashlib.sha256(relpath.encode("utf-8")).digest()[:8]
    return int.from_bytes(head, "big") % 10000 < HELDOUT_PER_10000


def split_of(relpath: str) -> str:
    return HELDOUT if is_heldout(relpath) else TRAIN


def collect_sources(root: str | Path) -> tuple[list[SourceFile], list[str]]:
    """(the .py files under ``root`` in sorted relpath order, relpaths skipped as not UTF-8).

    Raises TrainError when ``root`` is not a directory or holds no usable .py file.
    """
    root = Path(root)
    if not root.is_dir():
        raise TrainError(f"{root}: corpus source is not a directory")
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if THIRD_PARTY_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        paths.append((rel.as_posix(), path))
    paths.sort()
    files, skipped = [], []
    for relpath, path in paths:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(relpath)
            continue
        files.append(SourceFile(relpath, text, split_of(relpath)))
    if not files:
        what = f"no UTF-8 .py file ({len(skipped)} not UTF-8)" if skipped else "no .py file"
        raise TrainError(f"{root}: corpus source holds {what}")
    return files, skipped


def split_digest(files: list[SourceFile]) -> str:
    """sha256 over, for each file in order: relpath, NUL, decimal byte length, NUL, the bytes."""
    h = hashlib.sha256()
    for f in files:
        data = f.data
        h.update(f.relpath.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def split_files(files: list[SourceFile], split: str) -> list[SourceFile]:
    return [f for f in files if f.split == split]


def split_stats(files: list[SourceFile]) -> SplitStats:
    return SplitStats(files=len(files), bytes=sum(len(f.data) for f in files), sha256=split_digest(files))


def make_manifest(files: list[SourceFile], skipped: list[str], source_root: str) -> CorpusManifest:
    return CorpusManifest(python_version=platform.python_version(), source_root=source_root,
                          heldout_rule=HELDOUT_RULE, skipped_not_utf8=tuple(skipped),
                          train=split_stats(split_files(files, TRAIN)),
                          heldout=split_stats(split_files(files, HELDOUT)))


def write_corpus(files: list[SourceFile], manifest: CorpusManifest, path: str | Path) -> None:
    """xz-compressed JSON lines: the manifest, then one object per file in corpus order."""
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as out:
        out.write(json.dumps({"manifest": manifest.to_dict()}) + "\n")
        for f in files:
            out.write(json.dumps({"relpath": f.relpath, "split": f.split, "text": f.text}, ensure_ascii=False))
            out.write("\n")


def read_corpus(path: str | Path) -> tuple[list[SourceFile], CorpusManifest]:
    """The files of a corpus file and its manifest, each split checked against the rule and the digests."""
    path = Path(path)
    try:
        with lzma.open(path, "rt", encoding="utf-8") as src:
            records = [json.loads(line) for line in src if line.strip()]
    except FileNotFoundError:
        raise TrainError(f"{path}: no such corpus file") from None
    except (lzma.LZMAError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TrainError(f"{path}: not an xz JSON-lines corpus ({type(e).__name__}: {e})") from None
    if not records or not isinstance(records[0], dict) or not isinstance(records[0].get("manifest"), dict):
        raise TrainError(f"{path}: corpus file does not open with a manifest record")
    manifest = CorpusManifest.from_dict(records[0]["manifest"])
    files = []
    for i, r in enumerate(records[1:], start=1):
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str) for k in ("relpath", "split", "text")):
            raise TrainError(f"{path}: record {i} lacks string fields relpath, split, text")
        if r["split"] != split_of(r["relpath"]):
            raise TrainError(f"{path}: record {i} ({r['relpath']}) is in split {r['split']!r}, the rule says "
                             f"{split_of(r['relpath'])!r}")
        files.append(SourceFile(r["relpath"], r["text"], r["split"]))
    if not files:
        raise TrainError(f"{path}: corpus file holds no file")
    for split in SPLITS:
        if split_stats(split_files(files, split)) != getattr(manifest, split):
            raise TrainError(f"{path}: the {split} split's files do not match the manifest's count, bytes, sha256")
    return files, manifest


def build_corpus(root: str | Path, out_path: str | Path) -> tuple[list[SourceFile], CorpusManifest]:
    """Collect ``root``'s .py files, write them to ``out_path``; return the files and their manifest."""
    files, skipped = collect_sources(root)
    manifest = make_manifest(files, skipped, str(root))
    write_corpus(files, manifest, out_path)
    return files, manifest
