"""Decoding: the AR and DDTree loops, decode settings, drafters, step records and the public API."""
