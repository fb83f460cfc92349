"""Write pycoder-mini's held-out prompts (engine/model/presets/pycoder-mini/heldout_prompts.json): the first 32
tokens (the opening <|endoftext|> and 31 more) of the first COUNT held-out files longer than 64 tokens, in the
held-out stream's order (sorted relative path). Files the model never saw in training (engine/train/corpus.py's
split by a hash of the path); the digest of the held-out split is checked against the model's manifest first,
so the prompts come from exactly the split it was trained beside.

    python3 -m tools.pycoder_prompts [--count 64] [--root STDLIB]
"""
from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

from kdspec.engine.model.tokenizer import tokenizer_for
from kdspec.engine.train.corpus import HELDOUT, collect_sources, split_files, split_stats
from kdspec.engine.train.tokenizer import EOD_ID

MODEL = Path(__file__).resolve().parents[1] / "engine" / "model" / "presets" / "pycoder-mini"
PROMPT_TOKENS, MIN_FILE_TOKENS = 32, 64


def heldout_prompts(root: str, count: int) -> dict:
    manifest = json.loads((MODEL / "manifest.json").read_text())
    files, _ = collect_sources(root)
    heldout = split_files(files, HELDOUT)
    digest = split_stats(heldout).sha256
    if digest != manifest["corpus"]["heldout"]["sha256"]:
        raise SystemExit(f"{root}: held-out split digest {digest} is not the model's "
                         f"({manifest['corpus']['heldout']['sha256']}): another Python's standard library")
    tokenizer = tokenizer_for(str(MODEL))
    prompts, sources = [], []
    for f in heldout:
        ids = [EOD_ID] + tokenizer.encode(f.text)
        if len(ids) > MIN_FILE_TOKENS:
            prompts.append(ids[:PROMPT_TOKENS])
            sources.append(f.relpath)
        if len(prompts) == count:
            break
    return {"rule": __doc__.split("\n\n")[0].replace("\n", " "), "heldout_sha256": digest, "sources": sources,
            "prompts": prompts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--root", default=sysconfig.get_paths()["stdlib"])
    args = parser.parse_args()
    out = MODEL / "heldout_prompts.json"
    data = heldout_prompts(args.root, args.count)
    out.write_text(json.dumps(data, indent=0) + "\n")
    print(f"{out}: {len(data['prompts'])} prompts from {len(data['sources'])} held-out files")


if __name__ == "__main__":
    main()
