"""Colours of the panels' Rich text, one set per theme brightness (readable on dark and light)."""
from __future__ import annotations

DARK = {"accepted": "bold green", "bonus": "bold yellow", "rejected": "grey50", "bad": "bold red",
        "warn": "dark_orange", "ok": "green", "muted": "grey58", "label": "bold cyan",
        "step_a": "cyan", "step_b": "magenta", "bookmark": "bold yellow", "diff": "bold red"}
LIGHT = {"accepted": "bold dark_green", "bonus": "bold dark_orange3", "rejected": "grey62", "bad": "bold red3",
         "warn": "dark_orange3", "ok": "dark_green", "muted": "grey42", "label": "bold blue",
         "step_a": "blue", "step_b": "magenta", "bookmark": "bold dark_orange3", "diff": "bold red3"}


def palette(dark: bool) -> dict[str, str]:
    return DARK if dark else LIGHT
