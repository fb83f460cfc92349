"""The Textual trace debugger and the `kdtree` command line."""
import os

# Textual paces screen updates at TEXTUAL_FPS frames a second (default 60): a key's frame waits up to 1/60 s
# after its handler. 120 halves that wait (p95 key latency ~61 -> ~42 ms on a 2-core machine, BENCHMARKS.md);
# frames are drawn only when something changed, so an idle app costs no more. Read when textual is first
# imported, hence here; a user's own setting wins.
os.environ.setdefault("TEXTUAL_FPS", "120")
