"""Messages the reader workers post to the app: small dataclasses, coalesced when they pile up."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from textual.message import Message


@dataclass
class StepLoaded(Message):
    """The full record of one step, read by the step worker (or the error reading it)."""

    index: int
    record: Any
    error: Optional[str] = None

    def can_replace(self, message: Message) -> bool:
        # Scrubbing fast: only the newest step matters.
        return isinstance(message, StepLoaded)


@dataclass
class ColumnsLoaded(Message):
    """Per-step columns (re)read from the trace: [session.Columns] (this trace, the compared one), or the
    error; ``partial``: the first rows of this trace only, more to come."""

    columns: Any
    error: Optional[str] = None
    partial: bool = False

    def can_replace(self, message: Message) -> bool:
        # Each read extends the one before (or is an error): the newest holds everything.
        return isinstance(message, ColumnsLoaded)
