"""kdspec: the import root of kdtree's four packages (kdspec.engine, kdspec.numba_kernels, kdspec.traces,
kdspec.kdtree_tui).

The repository keeps the four folders at its top level; an installed wheel holds them under kdspec/
(pyproject's package-dir mapping). In a checkout used without installing (PYTHONPATH=the checkout, as on
the GPU machine), the repository root is added to this package's search path so the same names resolve.
"""
from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "engine" / "__init__.py").is_file():
    __path__.append(str(_checkout))
