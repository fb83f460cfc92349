"""The README's screenshots: `python3 -m tools.screenshots [DIR]` (default docs/screenshots), from the repository root.

Two synthetic traces (engine.bench.synthetic: 400 steps at budget 16, and budget 4 for the compare view) shot by
kdtree_tui.screenshots, and a real recording: the trained pycoder-mini with its trained drafter on the reference
backend (pycoder-*.svg). Here because the app may not import the engine that writes them.
"""
import os
import sys
import tempfile

from kdspec.engine.bench.synthetic import write_synthetic_trace
from kdspec.kdtree_tui import cli
from kdspec.kdtree_tui.screenshots import write_screenshots

# The real recording's shots: its tree at a step that accepts several drafted tokens, and the analytics view.
PYCODER_SHOTS = (("pycoder-tree.svg", (), 5), ("pycoder-analytics.svg", ("6",), 5))


def main(directory: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trace = write_synthetic_trace(os.path.join(tmp, "budget16.h5"), 400)
        compare = write_synthetic_trace(os.path.join(tmp, "budget4.h5"), 400, budget=4, seed=3)
        for path in write_screenshots(directory, trace, compare):
            print(path)
        real = os.path.join(tmp, "pycoder.h5")
        cli.main(["record", "--model", "pycoder-mini", "--backend", "reference", "--mode", "ddtree", "--drafter",
                  "dflash", "--budget", "32", "--prompt", cli.DEMO_PROMPT, "--max-new-tokens", "96", "--out", real])
        for path in write_screenshots(directory, real, None, PYCODER_SHOTS):
            print(path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/screenshots")
