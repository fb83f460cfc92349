"""GPU sweeps of kernel launch variants: each checks every variant against an independent reference, then times
it (see README.md). Run from the repository root: python3 -m tools.sweeps.tree [--sim].
"""
