"""The layout's rules, read from the source with ast (not grep): every import points down the tiers of
docs/architecture.md, and the wheel's package list names every package folder.

Tiers, lowest first: numba_kernels and traces (each imports only itself); engine (model < golden < device <
decode < bench, train; engine may use numba_kernels and traces); kdtree_tui's app modules (kdtree_tui and
traces only); kdtree_tui/cli.py, the one module that joins them all. Function-local (lazy) imports count.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT = "kdspec"
TOPS = ("engine", "numba_kernels", "traces", "kdtree_tui")
ENGINE_TIERS = {"model": 0, "golden": 1, "device": 2, "decode": 3, "bench": 4, "train": 4}


def module_name(path: Path, repo: Path) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([ROOT] + parts)


def imports_of(path: Path, repo: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of our own packages in the file, relative ones resolved."""
    name = module_name(path, repo)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import module` imports the module: judge the most specific name
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    ours = []
    for line, target in found:
        parts = target.split(".")
        if parts[0] in TOPS:  # the old, unrooted names must not come back
            ours.append((line, "<unrooted>." + target))
        elif parts[0] == ROOT:
            ours.append((line, target))
    return ours


def allowed(importer: str, imported: str) -> bool:
    """Whether module ``importer`` may import ``imported`` (both rooted dotted names)."""
    if imported.startswith("<unrooted>"):
        return False
    src, dst = importer.split(".")[1:], imported.split(".")[1:]
    if not src or not dst:  # the root package itself: imports nothing, and nothing needs it
        return not src and not dst
    if src[0] == "kdtree_tui":
        return len(src) > 1 and src[1] == "cli" or dst[0] in ("kdtree_tui", "traces")
    if src[0] in ("numba_kernels", "traces"):
        return dst[0] == src[0]
    if src[0] == "engine":
        if dst[0] in ("numba_kernels", "traces"):
            return True
        if dst[0] != "engine":
            return False
        if len(src) < 2 or len(dst) < 2:
            return True  # engine/__init__.py, or the bare package
        return ENGINE_TIERS.get(dst[1], 99) <= ENGINE_TIERS.get(src[1], -1) or dst[1] == src[1]
    return False


def violations(repo: Path) -> list[str]:
    """'path:line: importer -> imported' for every import that points up or sideways."""
    found = []
    for top in TOPS:
        for path in sorted((repo / top).rglob("*.py")):
            importer = module_name(path, repo)
            for line, imported in imports_of(path, repo):
                if not allowed(importer, imported):
                    found.append(f"{path.relative_to(repo)}:{line}: {importer} -> {imported}")
    return found


def test_every_import_points_down():
    assert violations(REPO) == []


@pytest.mark.parametrize("planted, source", [
    ("numba_kernels/planted.py", "from kdspec.engine.model.config import ModelConfig\n"),
    ("numba_kernels/planted.py", "def f():\n    from kdspec.traces import schema\n"),
    ("traces/planted.py", "import kdspec.engine.decode.api as api\n"),
    ("kdtree_tui/planted.py", "from kdspec.engine.decode import api\n"),
    ("kdtree_tui/widgets/planted.py", "from ...numba_kernels import sampling\n"),
    ("engine/model/planted.py", "from kdspec.engine.decode import loop\n"),
    ("engine/golden/planted.py", "from ..device import model\n"),
    ("engine/device/planted.py", "from kdspec.kdtree_tui import app\n"),
    ("engine/decode/planted.py", "from engine.model import config\n"),
])
def test_planted_upward_import_is_caught(tmp_path, planted, source):
    for top in TOPS:
        (tmp_path / top).mkdir()
    path = tmp_path / planted
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    assert [v.split(":")[0] for v in violations(tmp_path)] == [planted]


@pytest.mark.parametrize("importer, imported", [
    ("kdspec.kdtree_tui.cli", "kdspec.engine.decode.api"),
    ("kdspec.kdtree_tui.app", "kdspec.traces.reader"),
    ("kdspec.engine.decode.loop", "kdspec.engine.golden.ddtree"),
    ("kdspec.engine.device.model", "kdspec.numba_kernels.rope"),
    ("kdspec.engine.decode.records", "kdspec.traces.schema"),
    ("kdspec.numba_kernels.attention.tc", "kdspec.numba_kernels.mma"),
])
def test_downward_imports_are_allowed(importer, imported):
    assert allowed(importer, imported)


def test_wheel_lists_every_package_folder():
    """pyproject's explicit package list (the package-dir mapping hides folders from discovery) is complete."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {ROOT} | {module_name(init.parent / "__init__.py", REPO)
                        for top in TOPS for init in (REPO / top).rglob("__init__.py")}
    assert set(config["packages"]) == folders
    assert config["package-dir"] == {ROOT: ROOT, **{f"{ROOT}.{top}": top for top in TOPS}}


def test_wheel_claims_one_top_level_name(tmp_path):
    """The built wheel installs `kdspec` alone (no `engine`, `traces` or `kdtree`), with the app's data files."""
    import subprocess
    import sys
    import zipfile
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True, timeout=300)
    wheel, = tmp_path.glob("kdspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {ROOT}
    assert "kdspec/kdtree_tui/app.tcss" in names and "kdspec/kdtree_tui/data/k2-mini-sample.h5" in names
    assert "kdspec/kdtree_tui/data/pycoder-mini-sample.h5" in names
    assert "kdspec/numba_kernels/attention/dispatch.py" in names
