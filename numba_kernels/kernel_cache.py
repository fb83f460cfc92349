"""Compiled kernels kept on disk between runs, under a key that cannot go stale.

Compiling the engine's kernels costs tens of seconds in every new process, most of it the 3xTF32 GEMM, the decode
attention and the tree build (BENCHMARKS.md, "The recorder on the H200"). numba-cuda's own ``cache=True`` keys an
entry by the kernel's bytecode and a pickle of its closure. That is not enough here: it misses the device functions
and constants a kernel reads from other modules (an edit there would load a stale kernel), and on the H200 it
missed the GEMM, the decode attention and the tree build in every new process (their closures, full of intrinsics
and unrolled device functions, evidently do not pickle to the same bytes twice). This cache:

- lives in a directory named by a digest of every source file of this package and the Python, numba and
  numba-cuda versions, so that any edit to any kernel or helper starts an empty cache;
- keys an entry by the kernel's signature, the target, and a stable description of the kernel's code and closure:
  constants by value, functions, device functions and intrinsics by name, bytecode and their own closures,
  recursively. A kernel whose closure holds anything else is compiled every time, as before.

``KDTREE_KERNEL_CACHE``: unset or ``on``, the cache in ``$XDG_CACHE_HOME/kdtree/kernels`` (else
``~/.cache/kdtree/kernels``); ``off``, no cache; any other value, the cache in that directory. A directory that
cannot be written, or an entry that cannot be read or written, means compiling as without a cache. Each source
tree's digest gets its own folder; when a new one is made, all but the most recently used KEEP_TREES - 1 of the
others are removed, so that editing kernels does not fill the disk.

    @kernel_cache.jit                       # a lazily compiled kernel, as @cuda.jit
    kernel = cached(cuda.jit(**options)(fn)); kernel.compile(signature)   # instead of cuda.jit(signature)
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import re
import shutil
import sys
import types as pytypes
from pathlib import Path

import numpy as np

from kdspec.numba_kernels.runtime import ON_SIMULATOR

ENV = "KDTREE_KERNEL_CACHE"
KEEP_TREES = 4              # source trees whose kernels are kept (module docstring)
_DIGEST_NAME = re.compile(r"[0-9a-f]{16}")
_MAX_DEPTH = 1000


class _Uncacheable(Exception):
    """A closure value this cache cannot describe stably."""


def cache_root() -> Path | None:
    """The directory for this source tree's kernels, or None when the cache is off (module docstring)."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    if setting.lower() in ("", "on", "1", "true", "yes"):
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kdtree" / "kernels"
    else:
        base = Path(setting).expanduser()
    return base / _source_digest()


def prune(root: Path, keep: int = KEEP_TREES) -> None:
    """Remove the folders of other source trees beside ``root`` (named like a digest) but the ``keep`` - 1 most
    recently modified; errors (a folder another process is removing, no permission) are ignored."""
    try:
        others = [path for path in root.parent.iterdir()
                  if path != root and path.is_dir() and _DIGEST_NAME.fullmatch(path.name)]
        others.sort(key=lambda path: path.stat().st_mtime, reverse=True)
    except OSError:
        return
    for path in others[keep - 1:]:
        shutil.rmtree(path, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    return tree_digest(Path(__file__).resolve().parent)


def tree_digest(package: Path) -> str:
    """sha256 (16 hex digits) of every .py file under ``package``, with the Python, numba and numba-cuda versions
    and numba's optimisation level (NUMBA_OPT)."""
    import numba
    import numba_cuda

    digest = hashlib.sha256(f"{sys.version}|{numba.__version__}|{numba_cuda.__version__}|{numba.config.OPT}".encode())
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def describe(value, _memo: dict | None = None, _path: tuple = ()) -> str:
    """A description of ``value`` that is the same in every process for the same source tree, or _Uncacheable.
    Functions, dispatchers and intrinsics are described by a digest of their parts, once each (kernels built
    by unrolling helpers nest them hundreds deep)."""
    memo = {} if _memo is None else _memo
    if id(value) in memo:
        return memo[id(value)]
    if id(value) in _path or len(_path) > _MAX_DEPTH:
        raise _Uncacheable("a closure that refers to itself, or nested too deeply")
    path = _path + (id(value),)
    inner = functools.partial(describe, _memo=memo, _path=path)
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (np.generic, np.dtype)):
        return f"np.{type(value).__name__}:{value!r}"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={inner(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__qualname__}[{','.join(inner(item) for item in value)}]"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__qualname__}{{{','.join(sorted(inner(item) for item in value))}}}"
    if isinstance(value, dict):
        return "dict{" + ",".join(sorted(f"{inner(k)}:{inner(v)}" for k, v in value.items())) + "}"
    if isinstance(value, pytypes.ModuleType):
        return f"module:{value.__name__}"
    if isinstance(value, type):
        return f"type:{value.__module__}.{value.__qualname__}"
    if isinstance(value, pytypes.BuiltinFunctionType):
        return f"builtin:{value.__module__}.{value.__qualname__}"
    if isinstance(value, pytypes.FunctionType):
        parts = (f"fn:{value.__module__}.{value.__qualname__}:{_describe_code(value.__code__, inner)}"
                 f":{inner(_closure(value))}:{inner(value.__defaults__)}")
    elif isinstance(getattr(value, "py_func", None), pytypes.FunctionType):   # a numba dispatcher
        parts = f"dispatcher:{inner(value.py_func)}:{inner(dict(getattr(value, 'targetoptions', {})))}"
    elif isinstance(getattr(value, "_defn", None), pytypes.FunctionType):     # a numba @intrinsic
        parts = f"intrinsic:{inner(value._defn)}"
    else:
        numba_type = _numba_type_name(value)
        if numba_type is None:
            raise _Uncacheable(f"{type(value).__module__}.{type(value).__qualname__}")
        return numba_type
    memo[id(value)] = digest = "#" + hashlib.sha256(parts.encode()).hexdigest()[:24]
    return digest


def _closure(fn) -> tuple:
    return tuple(cell.cell_contents for cell in fn.__closure__ or ())


def _describe_code(code, inner) -> str:
    consts = ",".join(_describe_code(c, inner) if isinstance(c, pytypes.CodeType) else inner(c)
                      for c in code.co_consts)
    return hashlib.sha256(code.co_code + consts.encode() + ",".join(code.co_names).encode()).hexdigest()[:16]


def _numba_type_name(value) -> str | None:
    from numba.core import types as numba_types
    return f"numba:{value}" if isinstance(value, numba_types.Type) else None


def jit(fn=None, **options):
    """``cuda.jit`` for kernels (not device functions), cached: ``@jit`` or ``@jit(**options)``."""
    from numba import cuda
    if fn is None:
        return lambda f: cached(cuda.jit(**options)(f))
    return cached(cuda.jit(**options)(fn))


def cached(kernel):
    """``kernel`` (a numba-cuda dispatcher, not yet compiled) with its compiled overloads kept on disk; unchanged
    under the simulator, with the cache off, or when its closure cannot be described stably."""
    if ON_SIMULATOR:
        return kernel
    root = cache_root()
    if root is None:
        return kernel
    try:
        description = describe(kernel.py_func)
    except (_Uncacheable, RecursionError):
        return kernel
    try:
        kernel._cache = _cache_class()(kernel.py_func, root, description)
    except Exception:   # noqa: BLE001 - the directory cannot be made or written, ...: compile as without a cache
        pass
    return kernel


@functools.lru_cache(maxsize=None)
def _prepare(root: Path) -> None:
    """Once per process and folder, when a kernel is first compiled (importing the kernels writes nothing): make
    the folder (its mtime marks it used) and prune the other source trees' folders."""
    fresh = not root.is_dir()
    root.mkdir(parents=True, exist_ok=True)
    if fresh:
        prune(root)
    else:
        os.utime(root)


@functools.lru_cache(maxsize=1)
def _cache_class():
    """KernelCache, built on first use: it subclasses numba-cuda internals that exist only on a real GPU build."""
    from numba.cuda.core.caching import _UserProvidedCacheLocator
    from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

    class Locator(_UserProvidedCacheLocator):
        """Entries under ``root``, one folder per source folder (numba's layout)."""

        def __init__(self, py_func, py_file, root: Path):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(root / self.get_suitable_cache_subpath(py_file))

    class KernelCache(CUDACache):
        def __init__(self, py_func, root: Path, description: str):
            self._kdtree_key = hashlib.sha256(description.encode()).hexdigest()
            self._root = root
            self.errors: list[str] = []   # why an entry could not be read or written (tools/first_step_profile.py)

            class Impl(CUDACacheImpl):
                _locator_classes = [_LocatorFactory(Locator, root)]

            self._impl_class = Impl
            super().__init__(py_func)

        # An entry that cannot be read (damaged, another toolchain's) or written is compiled as without a cache.
        def load_overload(self, sig, target_context):
            try:
                _prepare(self._root)
                return super().load_overload(sig, target_context)
            except Exception as error:   # noqa: BLE001
                self.errors.append(f"load: {type(error).__name__}: {error}")
                return None

        def save_overload(self, sig, data):
            try:
                _prepare(self._root)
                super().save_overload(sig, data)
            except Exception as error:   # noqa: BLE001
                self.errors.append(f"save: {type(error).__name__}: {error}")

        def _index_key(self, sig, codegen):
            import numba_cuda
            key = (sig, codegen.magic_tuple(), numba_cuda.__version__, ("kdtree", self._kdtree_key))
            launch_config = getattr(self, "_launch_config_key", None)
            return key if launch_config is None else key + (("launch_config", launch_config),)

    return KernelCache


class _LocatorFactory:
    """numba asks each locator class ``from_function(py_func, py_file)``; this one always answers with ``root``."""

    def __init__(self, locator, root):
        self.locator, self.root = locator, root

    def from_function(self, py_func, py_file):
        return self.locator(py_func, py_file, self.root)
