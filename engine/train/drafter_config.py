"""The training side's view of the drafter's shape: the config itself, its files and the exact forward are
engine/model/drafter.py (one definition for trainer and engine); here only the trainer's default taps."""
from __future__ import annotations


def default_target_layers(num_target_layers: int) -> tuple[int, ...]:
    """Three taps spread over the top of the target: (2, 4, 5) for a 5-layer target; fewer when it is shallow."""
    n = num_target_layers
    return tuple(sorted({max(0, n - 3), max(0, n - 1), n}))
