"""The README's screenshots: `python3 -m tools.screenshots [DIR]` (default docs/screenshots), from the repository root.

Two synthetic traces (engine.bench.synthetic: 400 steps at budget 16, and budget 4 for the compare view) shot by
kdtree_tui.screenshots. Here because the app may not import the engine that writes them.
"""
import os
import sys
import tempfile

from kdspec.engine.bench.synthetic import write_synthetic_trace
from kdspec.kdtree_tui.screenshots import write_screenshots


def main(directory: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trace = write_synthetic_trace(os.path.join(tmp, "budget16.h5"), 400)
        compare = write_synthetic_trace(os.path.join(tmp, "budget4.h5"), 400, budget=4, seed=3)
        for path in write_screenshots(directory, trace, compare):
            print(path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/screenshots")
