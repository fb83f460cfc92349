"""Anomaly thresholds on the command line and in the app, on a real bf16 recording: its precision's defaults do
not flag it on every step, fp32's do; bad values are one line; the app's thresholds screen changes the flags."""
from __future__ import annotations

import json

import pytest
from test_tui_helpers import run_async

from kdspec.kdtree_tui import cli
from kdspec.traces.thresholds import DLOGIT, PRECISION_THRESHOLDS, thresholds_for


@pytest.fixture(scope="module")
def bf16_trace(tmp_path_factory):
    """tiny on the simulator with bf16 weights and a noisy drafter: a real recording whose logits carry bf16's
    rounding (tens of millis per logit) yet equal the golden's tokens. Seed 1: with seed 0's weights bf16
    rounding flips a near-tie at the second step, and a diverged run is flagged for what it is."""
    out = tmp_path_factory.mktemp("bf16") / "bf16.h5"
    assert cli.main(["record", "--backend", "sim", "--weight-dtype", "bfloat16", "--drafter", "noisy:0.7",
                     "--max-new-tokens", "32", "--seed", "1", "--out", str(out)]) == 0
    return out


def test_a_bf16_trace_is_not_flagged_on_every_step(bf16_trace, capsys):
    capsys.readouterr()
    assert cli.main(["info", str(bf16_trace), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["thresholds"]["precision"] == "bfloat16"
    steps = info["num_steps"]
    assert info["max_logit_diff"] > PRECISION_THRESHOLDS["float32"][0]   # bf16 noise is there ...
    assert info["anomalies"]["dlogit"] == 0 and info["anomalies"]["cache"] == 0   # ... and not flagged
    # Judged by fp32's thresholds instead, the same trace is flagged at every step.
    assert cli.main(["info", str(bf16_trace), "--json", "--dlogit-threshold", "1e-4", "--cache-threshold",
                     "1e-4"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["thresholds"]["precision"] == "custom" and info["anomalies"]["dlogit"] == steps
    assert cli.main(["info", str(bf16_trace)]) == 0
    assert "anomalies  diverged 0, dlogit 0" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [("--dlogit-threshold", "nan"), ("--cache-threshold", "-1"),
                                         ("--min-tau", "-2"), ("--dlogit-threshold", "inf")])
def test_bad_thresholds_on_the_command_line_are_one_line(bf16_trace, capsys, flag, value):
    for command in ("info", "tui"):
        capsys.readouterr()
        assert cli.main([command, str(bf16_trace), flag, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("threshold" in err[0] or "tau" in err[0]), err


@run_async
async def test_the_app_follows_the_traces_precision_and_the_thresholds_screen(bf16_trace):
    from kdspec.kdtree_tui.app import TraceApp
    app = TraceApp(str(bf16_trace), threshold_overrides={"min_tau": 1})
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        while not app.session.loaded:
            await pilot.pause(0.05)
        s = app.session
        assert (s.thresholds.dlogit, s.thresholds.min_tau) == (PRECISION_THRESHOLDS["bfloat16"][0], 1)
        assert not (s.flags & DLOGIT).any()
        await pilot.press("t")
        await pilot.pause()
        field = app.screen.query_one("#threshold-dlogit")
        field.value = "1e-4"
        await pilot.press("enter")
        await pilot.pause()
        assert s.thresholds.dlogit == 1e-4 and s.thresholds.precision == "custom"
        assert (s.flags & DLOGIT).all()   # every step of the bf16 trace is over fp32's threshold
        await pilot.press("t")
        await pilot.pause()
        app.screen.query_one("#threshold-cache").value = "not a number"
        await pilot.press("enter")
        await pilot.pause()
        assert "not a number" in str(app.screen.query_one("#thresholds-error").render())
        await pilot.press("ctrl+r")   # the precision's defaults
        await pilot.pause()
        assert s.thresholds == thresholds_for(s.metadata) and not (s.flags & DLOGIT).any()
