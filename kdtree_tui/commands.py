"""Command palette provider: go to a step by number, search steps by committed text."""
from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider


class StepCommands(Provider):
    """`123` jumps to step 123; any text finds the steps whose committed tokens contain it."""

    async def discover(self) -> Hits:
        app = self.app
        for label, action, help_text in (("Next anomaly", "next_anomaly", "n"),
                                         ("Previous anomaly", "previous_anomaly", "p"),
                                         ("Toggle bookmark", "toggle_bookmark", "b"),
                                         ("Toggle theme", "toggle_theme", "d")):
            yield DiscoveryHit(label, partial(app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        app = self.app
        session = getattr(app, "session", None)
        if session is None or not session.loaded:
            return
        matcher = self.matcher(query)
        for label, action in (("Next anomaly", "next_anomaly"), ("Previous anomaly", "previous_anomaly"),
                              ("Toggle bookmark", "toggle_bookmark"), ("Toggle theme", "toggle_theme")):
            score = matcher.match(label)
            if score > 0:
                yield Hit(score, matcher.highlight(label), partial(app.run_action, action), text=label)
        for index in session.search(query):
            text = session.committed_text(index)
            label = f"step {index}: {text!r}"
            exact = query.strip().isdigit() and int(query.strip()) == index
            yield Hit(1.0 if exact else 0.8, label, partial(app.go_to, index), text=label,
                      help=f"go to step {index} (P={int(session.columns['prefix_len'][index])})")
