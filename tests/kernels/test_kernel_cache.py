"""The kernel disk cache's key: stable across processes, different for different closures, refused for what it
cannot describe, and in a directory that changes with any source edit. On a GPU: a second process loads the
compiled kernel instead of compiling it, and the loaded kernel computes what the compiled one did."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kdspec.numba_kernels import kernel_cache


def _factory(scale, helper=None):
    def kernel(x):
        return x * scale if helper is None else helper(x) * scale
    return kernel


def _describe_in_new_process(expression: str) -> str:
    code = textwrap.dedent(f"""
        from kdspec.numba_kernels import kernel_cache
        from kdspec.numba_kernels.attention import decode
        from kdspec.numba_kernels.tree import build
        print(kernel_cache.describe({expression}))
    """)
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


@pytest.mark.parametrize("expression", ["decode.decode_kernel().py_func", "build.make_build_kernel().py_func"])
def test_description_of_a_real_kernel_is_the_same_in_two_processes(expression):
    first, second = _describe_in_new_process(expression), _describe_in_new_process(expression)
    assert first == second and first.startswith("#")


def test_descriptions_differ_with_closure_constants_helpers_and_code():
    base = kernel_cache.describe(_factory(2.0))
    assert kernel_cache.describe(_factory(2.0)) == base                 # a new closure of the same values
    assert kernel_cache.describe(_factory(3.0)) != base
    assert kernel_cache.describe(_factory(2, None)) != base             # int 2 is not float 2.0
    assert kernel_cache.describe(_factory(2.0, abs)) != base

    def other(x):
        return x + 1
    assert kernel_cache.describe(_factory(2.0, other)) != kernel_cache.describe(_factory(2.0, lambda x: x - 1))
    numpy_values = kernel_cache.describe((np.float32(1), np.dtype(np.int64)))
    assert numpy_values != kernel_cache.describe((np.float64(1), np.int64))


def test_a_closure_over_an_unknown_object_is_not_cached():
    with pytest.raises(kernel_cache._Uncacheable):
        kernel_cache.describe(_factory(object()))
    cyclic = []
    cyclic.append(cyclic)
    with pytest.raises(kernel_cache._Uncacheable):
        kernel_cache.describe(cyclic)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(kernel_cache.ENV, raising=False)
    assert kernel_cache.cache_root().parent == tmp_path / "xdg" / "kdtree" / "kernels"   # on unless turned off
    monkeypatch.setenv(kernel_cache.ENV, "off")
    assert kernel_cache.cache_root() is None
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    root = kernel_cache.cache_root()
    assert root.parent == tmp_path and len(root.name) == 16
    monkeypatch.setenv(kernel_cache.ENV, "on")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache.cache_root().parent == tmp_path / "home" / ".cache" / "kdtree" / "kernels"


def test_a_new_source_tree_keeps_only_the_most_recently_used_others(tmp_path):
    stranger = tmp_path / "not-a-digest"            # a folder the cache did not make: left alone
    stranger.mkdir()
    trees = [tmp_path / f"{i:016x}" for i in range(6)]
    for age, tree in enumerate(trees):              # trees[0] the most recently used
        tree.mkdir()
        (tree / "entry.nbc").write_bytes(b"x")
        os.utime(tree, (1_000_000 - age * 100, 1_000_000 - age * 100))
    current = tmp_path / ("f" * 16)
    current.mkdir()
    kernel_cache.prune(current, keep=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [stranger.name, current.name] + [tree.name for tree in trees[:3]])
    kernel_cache.prune(tmp_path / "gone" / ("0" * 16))   # a parent that does not exist: nothing to do, no error


def test_the_directory_changes_with_any_source_edit(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("X = 1\n")
    (tmp_path / "sub" / "b.py").write_text("def helper(): return 2\n")
    before = kernel_cache.tree_digest(tmp_path)
    assert kernel_cache.tree_digest(tmp_path) == before
    (tmp_path / "sub" / "b.py").write_text("def helper(): return 3\n")
    assert kernel_cache.tree_digest(tmp_path) != before
    (tmp_path / "sub" / "b.py").write_text("def helper(): return 2\n")
    (tmp_path / "c.py").write_text("")
    assert kernel_cache.tree_digest(tmp_path) != before


@pytest.mark.sim
def test_under_the_simulator_kernels_are_left_alone():
    from kdspec.numba_kernels.runtime import ON_SIMULATOR
    if not ON_SIMULATOR:
        pytest.skip("on a GPU the kernels are cached")
    from numba import cuda
    kernel = cuda.jit(_factory(2.0))
    assert kernel_cache.cached(kernel) is kernel


_GPU_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba import cuda
    from kdspec.numba_kernels import kernel_cache
    from kdspec.numba_kernels.launch import launch

    def make(scale):
        def scaled(x, out):
            i = cuda.grid(1)
            if i < x.shape[0]:
                out[i] = x[i] * scale
        return scaled

    kernel = kernel_cache.jit(make(np.float32(3.0)))
    x = np.arange(1000, dtype=np.float32)
    out = cuda.device_array_like(x)
    launch(kernel, 4, 256, 0, cuda.to_device(x), out)   # as the engine launches (not kernel.specialize's copy)
    assert np.array_equal(out.copy_to_host(), x * np.float32(3.0))
    print(type(kernel._cache).__name__, sum(kernel._cache_hits.values()), sum(kernel._cache_misses.values()))
""")


@pytest.mark.gpu
def test_a_second_process_loads_the_kernel_from_disk(tmp_path):
    env = {**os.environ, kernel_cache.ENV: str(tmp_path / "cache")}
    script = tmp_path / "scaled.py"   # a file: the cache's index is stamped with its source file's mtime and size
    script.write_text(_GPU_SCRIPT)
    run = lambda: subprocess.run([sys.executable, str(script)], capture_output=True, text=True,  # noqa: E731
                                 env=env, check=True).stdout.split()
    assert run() == ["KernelCache", "0", "1"]    # compiled, and saved
    assert run() == ["KernelCache", "1", "0"]    # loaded, and it computes the same
