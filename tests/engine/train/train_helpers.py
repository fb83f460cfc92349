"""Helpers for the training tests: synthetic stdlib modules and the held-out rule computed by hand."""
import hashlib

MODULE = '''"""Module {i}: small helpers."""


def function_{i}(value, scale={i}):
    """Return the sum of range(value) times scale."""
    total = 0
    for item in range(value):
        total += item * scale
    return total


class Thing{i}:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Thing{i}({{self.name!r}})"
'''


def heldout_by_hand(relpath: str) -> bool:
    return int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big") % 10000 < 500


def module_relpaths(min_train: int = 24, min_heldout: int = 2) -> list[str]:
    """pkg/mod_XXX.py names, enough that both splits get files (the hash decides which)."""
    names, train, heldout, i = [], 0, 0, 0
    while train < min_train or heldout < min_heldout:
        name = f"pkg/mod_{i:03d}.py" if i % 3 else f"mod_{i:03d}.py"
        names.append(name)
        heldout += heldout_by_hand(name)
        train += not heldout_by_hand(name)
        i += 1
    return names


def make_tiny_stdlib(root):
    """A tiny stand-in for a stdlib tree: synthetic modules, some held out by the hash rule, plus files the
    corpus must leave out (third-party, not UTF-8, not .py)."""
    for i, rel in enumerate(module_relpaths()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(MODULE.format(i=i), encoding="utf-8")
    (root / "site-packages" / "thirdparty").mkdir(parents=True)
    (root / "site-packages" / "thirdparty" / "__init__.py").write_text("x = 1\n")
    (root / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))
    (root / "README.txt").write_text("not python\n")
    return root
