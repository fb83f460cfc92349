"""tools/sweeps/*: each sweep runs end to end under the CUDA simulator (toy sizes) and its checks pass.

Each script runs in its own process (`python3 -m tools.sweeps.X --sim` from the repository root) because the
simulator must be chosen before numba is imported, and the script's exit status and last line are its verdict.
The sweeps' checks compare every variant with an independent reference (heapq builder, float64 numpy).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.sim
@pytest.mark.parametrize("sweep", ["tree", "moe", "attention", "attention_invariant"])
def test_sweep_runs_and_all_checks_pass_on_the_simulator(sweep):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-m", f"tools.sweeps.{sweep}", "--sim"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1] == "all checks passed", output[-3000:]
    assert any(line.startswith("best ") for line in lines), output[-3000:]
    assert "FAIL" not in done.stdout and "MISMATCH" not in done.stdout and "ERROR" not in done.stdout
