"""A trace of the shipped trained target, pycoder-mini, recorded on the reference backend (the CPU, in CI): it
checks against its golden, and the debugger shows the model's real text from the trace alone (the vocabulary
the trace stores), never <id> placeholders. SVG snapshots of the tree and logits views.
"""
from __future__ import annotations

import h5py
import numpy as np
import pytest
from test_tui_helpers import run_async, settle

from kdspec.engine.model.checkpoint import model_tokenizer
from kdspec.kdtree_tui import cli
from kdspec.kdtree_tui.app import TraceApp
from kdspec.kdtree_tui.session import TraceSession
from kdspec.kdtree_tui.widgets.tree_panel import TreePanel
from kdspec.traces import open_trace

SIZE = (100, 30)


@pytest.fixture(scope="module")
def pycoder_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("pycoder") / "pycoder.h5"
    assert cli.main(["record", "--model", "pycoder-mini", "--backend", "reference", "--mode", "ddtree",
                     "--drafter", "noisy:0.7", "--budget", "16", "--prompt", "def ", "--max-new-tokens", "32",
                     "--out", str(path)]) == 0
    assert cli.main(["check", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def stable_trace(pycoder_trace, tmp_path_factory):
    """The recording with its measured times zeroed and its float64 rounding noise (the reference backend's
    |Δlogit| and |Δcache| against the golden, ~1e-14, which depend on the CPU's BLAS kernels) set to one value,
    so that the pictures are reproducible on any machine."""
    path = tmp_path_factory.mktemp("stable") / "pycoder.h5"
    path.write_bytes(pycoder_trace.read_bytes())
    with h5py.File(path, "r+") as f:
        steps = f["steps"][...]
        for name in steps.dtype.names:
            if name.startswith("time_"):
                steps[name] = 0.0
            elif name in ("logit_max_abs_diff", "cache_max_abs_diff"):
                steps[name] = np.where(np.isfinite(steps[name]), 1e-14, steps[name])
        f["steps"][...] = steps
        for key in ("start_time", "end_time"):
            f.attrs[key] = "2026-12-01T00:00:00+00:00"
    return str(path)


def test_trace_text_is_the_models_own_decoding(pycoder_trace):
    tokenizer = model_tokenizer("pycoder-mini")
    with open_trace(pycoder_trace) as reader:
        output = reader.output_tokens.tolist()
        assert reader.metadata["tokenizer"] == "bpe"
    session = TraceSession(pycoder_trace)
    committed = session.vocabulary.tokens_text(output)
    assert committed == tokenizer.decode(output) and committed.strip()
    assert "<" not in "".join(session.vocabulary.token_text(t) for t in output if t != 0)


def test_tree_view_shows_real_text(stable_trace):
    @run_async
    async def body():
        app = TraceApp(stable_trace)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            app.go_to(1)
            await settle(app, pilot)
            plain = app.query_one(TreePanel).text.plain
            assert "'<" not in plain, plain  # every token of the tree reads as text, not as an id
    body()


def test_snapshot_pycoder_tree_view(snap_compare, stable_trace):
    async def run_before(pilot):
        await settle(pilot.app, pilot)
        pilot.app.go_to(1)
        await settle(pilot.app, pilot)
    assert snap_compare(TraceApp(stable_trace), terminal_size=SIZE, run_before=run_before)


def test_snapshot_pycoder_logits_view(snap_compare, stable_trace):
    async def run_before(pilot):
        await settle(pilot.app, pilot)
        pilot.app.go_to(1)
        await settle(pilot.app, pilot)
        await pilot.press("2")
        await settle(pilot.app, pilot)
    assert snap_compare(TraceApp(stable_trace), terminal_size=SIZE, run_before=run_before)


def test_demo_records_the_trained_target_with_its_trained_drafter(tmp_path):
    out = tmp_path / "demo.h5"
    assert cli.main(["demo", "--no-tui", "--out", str(out), "--max-new-tokens", "16"]) == 0
    assert cli.main(["check", str(out)]) == 0
    with open_trace(out) as reader:
        assert reader.metadata["model_config"]["name"] == "pycoder-mini"
        assert reader.metadata["decode_config"]["drafter"] == "dflash"
        assert reader.metadata["tokenizer"] == "bpe" and reader.num_steps >= 1
