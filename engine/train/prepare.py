"""The prepared data directory: everything a training run reads, made on a machine with the full stdlib.

A data directory holds the corpus file, tokenizer.json (fitted on the training split only), the two splits'
uint16 token streams (``train_tokens.npy``, ``heldout_tokens.npy``), the held-out compressor baselines
(``baselines.json``), and ``data_manifest.json`` tying them together (corpus manifest, digests, token counts,
the held-out function headers used as sample prompts, already encoded). Loading it needs numpy alone.

    python -m engine.train.prepare --source STDLIB_DIR --data-dir .train_data [--vocab-size N] [--force]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from . import corpus as corpus_mod
from .baselines import measure_baselines
from .corpus import HELDOUT, TRAIN, CorpusManifest, SourceFile
from .errors import TrainError
from .outputs import replace_output_dir
from .tokenizer import (EOD_ID, TOKENIZER_FILE, ByteLevelDecoder, check_vocab_size, document_bounds, encode_texts,
                        fit_tokenizer, token_stream)

DATA_MANIFEST = "data_manifest.json"
BASELINES_FILE = "baselines.json"
STREAM_FILES = {TRAIN: "train_tokens.npy", HELDOUT: "heldout_tokens.npy"}
DEFAULT_VOCAB_SIZE = 4096
SAMPLE_PROMPTS = 5


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def function_headers(files: list[SourceFile], count: int = SAMPLE_PROMPTS) -> list[dict]:
    """``count`` one-line top-level ``def`` headers (line starts with 'def ', ends with ':'), evenly spaced
    over all of them in corpus order: [{"relpath", "line" (1-based), "header"}]."""
    found = []
    for f in files:
        for number, line in enumerate(f.text.splitlines(), start=1):
            header = line.rstrip()
            if header.startswith("def ") and header.endswith(":"):
                found.append({"relpath": f.relpath, "line": number, "header": header})
    if len(found) <= count:
        return found
    return [found[round(i * (len(found) - 1) / (count - 1))] for i in range(count)] if count > 1 else found[:1]


def default_stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def prepare_data(source: str | Path, data_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 force: bool = False, log=print) -> dict:
    """Build ``data_dir`` from a source root (a stdlib directory) or a corpus file; returns the data manifest."""
    check_vocab_size(vocab_size)
    source, data_dir = Path(source), Path(data_dir)
    if source.is_dir():
        files, skipped = corpus_mod.collect_sources(source)
        manifest = corpus_mod.make_manifest(files, skipped, str(source))
    elif source.is_file():
        files, manifest = corpus_mod.read_corpus(source)
    else:
        raise TrainError(f"{source}: corpus source is neither a directory nor a corpus file")
    train, heldout = corpus_mod.split_files(files, TRAIN), corpus_mod.split_files(files, HELDOUT)
    if not train or not heldout:
        raise TrainError(f"{source}: corpus needs files in both splits, got {len(train)} train and "
                         f"{len(heldout)} held-out")
    replace_output_dir(data_dir, force, (corpus_mod.CORPUS_FILE, TOKENIZER_FILE, *STREAM_FILES.values(),
                                         BASELINES_FILE, DATA_MANIFEST), what="data directory")
    corpus_path = data_dir / corpus_mod.CORPUS_FILE
    corpus_mod.write_corpus(files, manifest, corpus_path)
    log(f"corpus: {manifest.train.files} train files ({manifest.train.bytes} B), {manifest.heldout.files} "
        f"held-out ({manifest.heldout.bytes} B), {len(manifest.skipped_not_utf8)} skipped as not UTF-8")

    tokenizer = fit_tokenizer([f.text for f in train], vocab_size)
    tokenizer.save(str(data_dir / TOKENIZER_FILE))
    streams = {}
    for split, split_list in ((TRAIN, train), (HELDOUT, heldout)):
        stream = token_stream(tokenizer, [f.text for f in split_list])
        np.save(data_dir / STREAM_FILES[split], stream)
        raw = sum(len(f.data) for f in split_list)
        streams[split] = {"file": STREAM_FILES[split], "tokens": int(len(stream)), "documents": len(split_list),
                          "raw_bytes": raw, "bytes_per_token": raw / (len(stream) - len(split_list) - 1),
                          "sha256": file_sha256(data_dir / STREAM_FILES[split])}
        log(f"{split}: {len(stream)} tokens, {streams[split]['bytes_per_token']:.3f} bytes/token")

    baselines = measure_baselines([f.data for f in heldout])
    (data_dir / BASELINES_FILE).write_text(json.dumps(baselines, indent=2) + "\n")
    log(f"held-out baselines (bits/byte): gzip per file {baselines['gzip_per_file']:.4f}, xz per file "
        f"{baselines['xz_per_file']:.4f}, xz whole {baselines['xz_whole']:.4f}")

    prompts = function_headers(heldout)
    for p, ids in zip(prompts, encode_texts(tokenizer, [p["header"] for p in prompts])):
        p["ids"] = [EOD_ID] + ids
    data_manifest = {
        "corpus": manifest.to_dict(),
        "corpus_file": {"file": corpus_mod.CORPUS_FILE, "sha256": file_sha256(corpus_path)},
        "tokenizer": {"file": TOKENIZER_FILE, "requested_vocab_size": vocab_size,
                      "vocab_size": tokenizer.get_vocab_size(), "eod_id": EOD_ID,
                      "sha256": file_sha256(data_dir / TOKENIZER_FILE)},
        "streams": streams,
        "baselines_file": BASELINES_FILE,
        "sample_prompts": prompts,
    }
    (data_dir / DATA_MANIFEST).write_text(json.dumps(data_manifest, indent=2) + "\n")
    return data_manifest


@dataclass(frozen=True)
class PreparedData:
    """A loaded data directory. Streams are uint16 [n] laid out as in tokenizer.py."""

    data_dir: Path
    manifest: dict
    train: np.ndarray
    heldout: np.ndarray
    baselines: dict

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def requested_vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["requested_vocab_size"])

    @property
    def heldout_raw_bytes(self) -> int:
        return int(self.manifest["corpus"][HELDOUT]["bytes"])

    @property
    def corpus_manifest(self) -> CorpusManifest:
        return CorpusManifest.from_dict(self.manifest["corpus"])

    @property
    def tokenizer_path(self) -> Path:
        return self.data_dir / self.manifest["tokenizer"]["file"]

    @property
    def corpus_path(self) -> Path:
        return self.data_dir / self.manifest["corpus_file"]["file"]

    def decoder(self) -> ByteLevelDecoder:
        return ByteLevelDecoder.from_file(self.tokenizer_path)


def load_prepared(data_dir: str | Path) -> PreparedData:
    """Read a data directory, checking each file against the digest the manifest records."""
    data_dir = Path(data_dir)
    manifest_path = data_dir / DATA_MANIFEST
    if not data_dir.is_dir():
        raise TrainError(f"{data_dir}: no such prepared data directory (python -m kdspec.engine.train.prepare "
                         f"--data-dir DIR makes one)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        checks = [(manifest["tokenizer"]["file"], manifest["tokenizer"]["sha256"])] + \
            [(manifest["streams"][s]["file"], manifest["streams"][s]["sha256"]) for s in (TRAIN, HELDOUT)]
        baselines = json.loads((data_dir / manifest["baselines_file"]).read_text())
    except FileNotFoundError as e:
        raise TrainError(f"{data_dir}: prepared data lacks {Path(e.filename).name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as e:
        raise TrainError(f"{manifest_path}: not a data manifest ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise TrainError(f"{data_dir}: cannot read the prepared data ({e.strerror or e})") from None
    for name, digest in checks:
        if not (data_dir / name).is_file():
            raise TrainError(f"{data_dir}: prepared data lacks {name}")
        if file_sha256(data_dir / name) != digest:
            raise TrainError(f"{data_dir / name}: sha256 differs from {DATA_MANIFEST}")
    try:
        streams = {s: np.load(data_dir / manifest["streams"][s]["file"]) for s in (TRAIN, HELDOUT)}
    except (ValueError, OSError, EOFError) as e:  # not an .npy array (pickles are refused: allow_pickle is off)
        raise TrainError(f"{data_dir}: a token stream is not a numpy array file ({e})") from None
    for split, stream in streams.items():
        if stream.dtype != np.uint16 or stream.ndim != 1:
            raise TrainError(f"{data_dir}: {split} stream must be 1-D uint16, got {stream.dtype} {stream.shape}")
        document_bounds(stream)
    return PreparedData(data_dir, manifest, streams[TRAIN], streams[HELDOUT], baselines)


def resolve_data(corpus: str | Path, vocab_size: Optional[int], scratch_dir: Path, log=print) -> PreparedData:
    """The data for ``--corpus``: a prepared data directory (or its corpus file / manifest) when its vocabulary
    matches ``vocab_size`` (None: any), else prepared afresh into ``scratch_dir`` from a source root or corpus
    file (this needs ``tokenizers``)."""
    corpus = Path(corpus)
    prepared_dir = None
    if corpus.is_dir() and (corpus / DATA_MANIFEST).is_file():
        prepared_dir = corpus
    elif corpus.is_file() and (corpus.parent / DATA_MANIFEST).is_file() and \
            corpus.name in (DATA_MANIFEST, corpus_mod.CORPUS_FILE):
        prepared_dir = corpus.parent
    if prepared_dir is not None:
        data = load_prepared(prepared_dir)
        if vocab_size is None or data.requested_vocab_size == vocab_size:
            return data
        log(f"{prepared_dir}: prepared for vocab size {data.requested_vocab_size}, refitting for {vocab_size}")
        corpus = data.corpus_path
    elif not corpus.exists():
        raise TrainError(f"{corpus}: no such corpus directory or file")
    prepare_data(corpus, scratch_dir, DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size, force=True, log=log)
    return load_prepared(scratch_dir)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.train.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(default_stdlib()),
                        help="a Python stdlib directory or a corpus.jsonl.xz (default: this Python's stdlib)")
    parser.add_argument("--data-dir", required=True, help="directory to write the prepared data into")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--force", action="store_true",
                        help="replace an existing data directory (only what an earlier run wrote)")
    args = parser.parse_args(argv)
    try:
        prepare_data(args.source, args.data_dir, args.vocab_size, force=args.force)
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
