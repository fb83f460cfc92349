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
    """Per-step columns (re)read from the trace: a session.Columns, or the error."""

    columns: Any
    error: Optional[str] = None

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ColumnsLoaded)
