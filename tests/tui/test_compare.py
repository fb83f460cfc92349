"""The compare view's verdict and header: two traces are identical only when model, prompt and every committed
token agree; the header names each run's drafter, budget, backend, precision and seed and marks what differs.
Real reference-backend recordings (tiny) and synthetic traces; expected facts come from the command lines."""
from __future__ import annotations

import pytest

from kdspec.kdtree_tui import cli
from kdspec.kdtree_tui.app import TraceApp
from kdspec.kdtree_tui.compare import align, compare_runs, run_facts
from kdspec.kdtree_tui.session import TraceSession

from test_tui_helpers import run_async, settle, small_trace

RECORD = ["record", "--backend", "reference", "--max-new-tokens", "24"]


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    d = tmp_path_factory.mktemp("compare")
    runs = {
        "oracle7": RECORD + ["--budget", "7"],
        "noisy16": RECORD + ["--budget", "16", "--drafter", "noisy:0.6"],
        "seed3": RECORD + ["--budget", "7", "--seed", "3"],
        "ar": RECORD + ["--mode", "ar"],   # a preset's seed draws its weights: another model
        "short": RECORD[:-1] + ["16", "--budget", "7"],
        "other_prompt": RECORD + ["--budget", "7", "--prompt", "A forest"],
        "small": RECORD + ["--budget", "7", "--model", "small"],
    }
    out = {}
    for name, argv in runs.items():
        out[name] = str(d / f"{name}.h5")
        assert cli.main(argv + ["--out", out[name]]) == 0
    return out


def loaded(path) -> TraceSession:
    s = TraceSession(path)
    s.install(s.read_columns())
    return s


def comparison(a, b):
    sa, sb = loaded(a), loaded(b)
    return compare_runs(sa, sb, align(sa, sb))


def test_runs_of_one_prompt_that_commit_the_golden_are_identical_whatever_the_drafter(recordings):
    c = comparison(recordings["oracle7"], recordings["noisy16"])
    assert c.identical and c.reasons == ()
    assert set(c.differences) == {"drafter", "budget"}


def test_an_ar_run_and_a_ddtree_run_of_one_prompt_are_identical(recordings):
    # DDTree's last step commits past max_new_tokens and AR's first token is the prefill's: the outputs agree
    c = comparison(recordings["ar"], recordings["oracle7"])
    assert c.identical and set(c.differences) == {"drafter", "mode", "budget", "block"}


@pytest.mark.parametrize("other, reason", [
    ("other_prompt", "different prompts"),
    ("small", "different models (tiny / small)"),
    ("short", "A's output has 24 tokens, B's 16"),
])
def test_unrelated_or_unequal_runs_are_not_identical(recordings, other, reason):
    c = comparison(recordings["oracle7"], recordings[other])
    assert not c.identical and reason in c.reasons


def test_a_preset_of_another_seed_commits_other_tokens(recordings):
    c = comparison(recordings["oracle7"], recordings["seed3"])
    assert not c.identical and c.differences == ("seed",)
    assert any(r.startswith("first differing token at position") for r in c.reasons)


def test_run_facts_name_the_drafter_and_precision(recordings):
    facts = run_facts(loaded(recordings["noisy16"]))
    assert (facts["model"], facts["drafter"], facts["budget"], facts["backend"], facts["precision"],
            facts["seed"]) == ("tiny", "noisy:0.6", 16, "reference", "float64", 0)


@run_async
async def test_compare_of_unrelated_traces_says_they_differ_and_names_each_drafter(recordings, tmp_path):
    synthetic = small_trace(tmp_path, steps=30)   # another model, another prompt, synthetic drafts
    app = TraceApp(recordings["noisy16"], compare=synthetic)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("5")
        await settle(app, pilot)
        header = app.query_one("#compare-panel").header.plain
    a_line, b_line = header.splitlines()[:2]
    assert "drafter noisy:0.6" in a_line and "drafter " in b_line and "drafter noisy" not in b_line
    assert "the runs differ" in header and "identical" not in header
    assert "different model" in header and "different prompts" in header   # synthetic: a tiny-named toy


@run_async
async def test_compare_of_two_drafters_on_one_prompt_says_identical(recordings):
    app = TraceApp(recordings["oracle7"], compare=recordings["noisy16"])
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("5")
        await settle(app, pilot)
        header = app.query_one("#compare-panel").header
    assert "same model and prompt, committed tokens identical" in header.plain
    assert "drafter oracle" in header.plain and "drafter noisy:0.6" in header.plain
    # what differs between the runs is marked: the drafter and budget spans carry a style, the model's not
    styled = {header.plain[span.start:span.end].strip() for span in header.spans if span.style}
    assert {"drafter oracle", "drafter noisy:0.6", "budget 7", "budget 16"} <= styled
    assert "model tiny" not in styled
