"""--save-logits on a real recording: each step stores the engine's and the golden's full logits at its committed
positions; the golden's equal an independently computed golden run of the same prompt, their max difference is
the step's recorded |dlogit| (to float32 rounding), and the logits view shows both distributions."""
from __future__ import annotations

import numpy as np

from kdspec.engine.decode import api
from kdspec.kdtree_tui import cli
from kdspec.kdtree_tui.palette import palette
from kdspec.kdtree_tui.session import BYTES
from kdspec.kdtree_tui.widgets.logits_panel import render_distributions
from kdspec.traces import open_trace


def test_saved_golden_logits_are_the_golden_runs(tmp_path):
    out = tmp_path / "t.h5"
    assert cli.main(["record", "--backend", "reference", "--drafter", "noisy:0.6", "--save-logits",
                     "--max-new-tokens", "20", "--out", str(out)]) == 0
    with open_trace(out) as reader:
        prompt = list(reader.prompt_tokens)
        golden = api.load("tiny", backend="reference").golden(prompt, 20 + 8)
        steps = [reader.step(i) for i in range(reader.num_steps)]
    assert len(steps) > 2
    for s in steps:
        assert s.logits.shape == s.golden_logits.shape == (s.tau, 256)
        for j in range(s.tau):
            i = s.prefix_len + 1 + j - len(prompt)      # golden.logits[i] chose the token at prompt_len + i
            np.testing.assert_array_equal(s.golden_logits[j], golden.logits[i])
            # the stored engine logits are float32: within their rounding of the recorded float64 difference
            diff = np.max(np.abs(s.logits[j].astype(np.float64) - s.golden_logits[j]))
            rounding = np.abs(s.golden_logits[j]).max() * 2.0 ** -23
            assert abs(diff - float(s.logit_max_abs_diff[j])) <= rounding
    text = render_distributions(steps[1], BYTES, palette(True), width=120).plain
    assert "TV " in text and "engine p" in text and "golden p" in text and "not stored" not in text
