"""The TUI bench's memory figure is the app process's own: on Linux, ru_maxrss of a child also carries its parent's
peak across fork + exec, so a bench child of a big parent reported the parent's memory."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

CHILD = ("import resource; from kdspec.kdtree_tui.bench import peak_resident_mb; "
         "print(peak_resident_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_child_of_a_big_parent_reports_its_own_peak():
    ballast = np.ones(600 * 2 ** 20 // 8)   # 600 MB resident in this (the parent) process
    own, inherited = map(float, subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                                               check=True).stdout.split())
    assert ballast.sum() > 0
    # the child itself is an interpreter and the bench module (~15 MB here), while its ru_maxrss read 627 MB
    assert own < 300, (own, inherited)
