"""The `spec` bench suite (pycoder-mini with its trained drafter on held-out prompts) in --quick mode on the
reference backend, and its held-out prompts: from files the corpus split holds out, checked here by the split's
rule itself, not by the file that lists them."""
from __future__ import annotations

import io

import numpy as np
import pytest

from kdspec.engine.bench import runner, spec
from kdspec.engine.train.corpus import is_heldout
from kdspec.engine.train.tokenizer import EOD_ID


def test_heldout_prompts_come_from_heldout_files():
    import json
    from pathlib import Path

    from kdspec.engine.model.checkpoint import model_directory
    data = json.loads((Path(model_directory(spec.MODEL)) / spec.PROMPTS_FILE).read_text())
    assert len(data["prompts"]) >= spec.PROMPTS and len(data["sources"]) == len(data["prompts"])
    assert len(set(data["sources"])) == len(data["sources"])
    assert all(is_heldout(path) for path in data["sources"])
    assert all(len(p) == 32 and p[0] == EOD_ID and EOD_ID not in p[1:] for p in data["prompts"])
    assert spec.heldout_prompts(spec.PROMPTS) == data["prompts"][:spec.PROMPTS]


@pytest.fixture(scope="module")
def quick_rows():
    return runner.run(["spec"], json=True, quick=True, out=io.StringIO())


def test_quick_spec_rows(quick_rows):
    rows = {r["metric"]: r for r in quick_rows}
    assert all(r["suite"] == "spec" for r in quick_rows) and "suite failed" not in rows
    for t in ("T=0", "T=1"):
        assert rows[f"{t} AR tokens/s"]["value"] > 0
        for label in ("chain (top-1, B=7)", "DDTree B=8"):
            assert "stated/measured per (depth, rank): d1 r0 " in rows[f"{t} {label} drafter ECE"]["note"]
            assert rows[f"{t} {label} prompts equal to AR"]["ok"] is True    # lossless at T=0 and T=1
            assert 1.0 <= rows[f"{t} {label} mean tau"]["value"] <= spec.BLOCK_SIZE
            speed = rows[f"{t} {label} tokens/s"]
            assert speed["peer"] == "AR" and speed["ratio"] == pytest.approx(speed["value"] / speed["peer_value"])


class FakeResult:
    def __init__(self, tokens, taus, elapsed):
        self.tokens, self.taus, self.elapsed = np.asarray(tokens), taus, elapsed


def test_totals_combine_prompts_as_one_sample(tmp_path):
    """Acceptance per depth over two prompts equals the share of all their steps reaching each depth, from the
    taus alone; the combined ECE of one prompt is that prompt's own analytics' ECE."""
    from kdspec.engine.decode import api
    from kdspec.engine.decode.config import DecodeConfig
    engine = api.load(spec.MODEL, backend="reference")
    config = DecodeConfig(10, mode="ddtree", block_size=spec.BLOCK_SIZE, budget=8, drafter="dflash")
    total, single, analytics_of, taus = spec._Totals(), spec._Totals(), [], []
    for i, prompt in enumerate(spec.heldout_prompts(2)):
        records = []
        result = engine.generate(prompt, config, golden=False, on_step=records.append)
        analytics = spec._analysed(engine, prompt, config, records, str(tmp_path / f"{i}.h5"))
        total.add(result, result.tokens, analytics)
        if i == 0:
            single.add(result, result.tokens, analytics)
            analytics_of.append(analytics)
        taus += [len(r["accepted_nodes"]) for r in records]
    depths = spec.BLOCK_SIZE - 1
    want = " ".join(f"{d}:{np.mean([t >= d + 1 for t in taus]):.2f}" for d in range(1, depths + 1))
    assert total.acceptance() == want
    assert single.ece() == pytest.approx(analytics_of[0].calibration.ece)
    assert single.ece(top1=True) == pytest.approx(analytics_of[0].calibration.ece_top1)
    c = analytics_of[0].calibration   # one prompt: its own (depth, rank) table
    d1 = f"d1 r0 {c.stated[0, 0]:.2f}/{c.measured[0, 0]:.2f}" if c.count[0, 0] else "d1 r0 -"
    assert single.calibration().startswith(d1)
    assert total.equal == 2 and total.tokens == 20
