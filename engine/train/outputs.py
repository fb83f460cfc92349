"""The output directories of `kdtree train` and `prepare`: what ``--force`` may replace.

``--force`` replaces an earlier run's output, never anything else: a directory is removed only when it holds
nothing but files such a run writes (``ours``), so a mistyped path (a home directory, a source tree, a model
directory with its drafter inside) is refused with one line instead of deleted.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable

from .errors import TrainError


def check_output_dir(path: Path, force: bool, ours: Iterable[str], what: str = "output directory") -> None:
    """Raise TrainError unless ``path`` is absent or, with ``force``, an empty directory or an earlier run's output."""
    if not (path.exists() or path.is_symlink()):
        return
    if not force:
        raise TrainError(f"{path}: {what} exists (use --force to replace it)")
    if not path.is_dir() or path.is_symlink():
        raise TrainError(f"{path}: {what} path exists and is not a directory")
    entries = list(path.iterdir())
    ours = set(ours)
    foreign = sorted(p.name for p in entries if p.name not in ours or p.is_symlink() or not p.is_file())
    if foreign:
        raise TrainError(f"{path}: {what} holds {foreign[0]!r}, which no run of this command writes: not "
                         f"replacing it (remove it yourself or pick another path)")


def replace_output_dir(path: Path, force: bool, ours: Iterable[str], what: str = "output directory") -> None:
    """``path`` as an empty directory, after check_output_dir's rule."""
    check_output_dir(path, force, ours, what)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
