"""``kdtree bench [--json] [--quick] [SUITE...]``: run the suites, print progress to stderr and, last, the table
(or the rows as JSON) to stdout. ``run(suites, json) -> rows``."""
from __future__ import annotations

import importlib
import json as json_module
import sys
import time
from typing import Callable, Iterable, Optional, TextIO

from kdspec.engine.bench.common import ceiling_rows, format_table, progress, row
from kdspec.engine.bench.e2e import MODEL_SUITES, release_model

GPU_SUITES = ("tree", "attention", "moe", "e2e", "trace")  # this package's suites, measured against the GPU's ceilings
HOST_SUITES = ("spec",)  # this package's suites that run anywhere (on the GPU where there is one)


def run(suites: Optional[Iterable[str]] = None, json: bool = False, quick: bool = False,
        out: Optional[TextIO] = None, extra_suites: Optional[dict[str, Callable]] = None) -> list[dict]:
    """Run ``suites`` (default all: GPU_SUITES, HOST_SUITES, then extra_suites) and return their rows (the ceilings' rows first).

    extra_suites: name -> run(quick=...) of suites that live outside the engine (the command line passes the
    TUI's own). A suite that fails gives one row with ok False and the error's first line, and the others still
    run. quick: toy sizes (CUDA simulator / CI): checks that the suites run, the numbers mean nothing.
    """
    extra_suites = dict(extra_suites or {})
    known = list(GPU_SUITES) + list(HOST_SUITES) + list(extra_suites)
    requested = list(suites) if suites else known
    unknown = [n for n in requested if n not in known]
    if unknown:
        raise ValueError(f"unknown bench suite {unknown[0]!r}; suites: {', '.join(known)}")
    # always in the known order, each once: moe's K2-size experts run before e2e builds k2-mini, which stays loaded
    # for trace; named the other way round on an 80 GB card, moe found no memory left
    names = [n for n in known if n in requested]
    out = out or sys.stdout
    started = time.perf_counter()
    on_gpu = [n for n in names if n in GPU_SUITES]
    if on_gpu and not quick and not _gpu_available():
        raise ValueError(f"suite {on_gpu[0]!r} needs a CUDA GPU (none here); run it on a GPU machine, or "
                         f"--quick for a toy run under the simulator")
    torch = _torch_with_numba_allocations() if on_gpu and not quick else None
    rows = ceiling_rows(quick) if on_gpu else []
    for name in names:
        suite_start = time.perf_counter()
        progress(f"suite {name} ...")
        if torch is not None:
            torch.cuda.reset_peak_memory_stats()
        try:
            suite_run = extra_suites.get(name) or importlib.import_module(f"{__package__}.{name}").run
            rows.extend(suite_run(quick=quick))
        except Exception as e:  # one broken suite must not hide the others' numbers
            first = (str(e).splitlines() or [""])[0]
            rows.append(row(name, "suite failed", None, ok=False, note=f"{type(e).__name__}: {first}"))
        if name in MODEL_SUITES and not any(later in MODEL_SUITES for later in names[names.index(name) + 1:]):
            release_model(quick)  # the suites after it get the GPU's memory back
        if torch is not None and name in GPU_SUITES:
            rows.append(row(name, "peak GPU memory", torch.cuda.max_memory_allocated() / 2 ** 30, "GiB",
                            note="high-water mark of torch's allocator during the suite (Numba's allocations "
                                 "go through it too)"))
        progress(f"suite {name} done in {time.perf_counter() - suite_start:.1f} s")
    progress(f"all suites done in {time.perf_counter() - started:.1f} s")
    if json:
        json_module.dump(rows, out, indent=1)
        out.write("\n")
    else:
        out.write(format_table(rows) + "\n")
    return rows


def _torch_with_numba_allocations():
    """torch (or None without it), with Numba's device allocations routed through torch's allocator, so that
    one high-water mark covers both."""
    from kdspec.engine.bench.common import torch_cuda
    torch = torch_cuda()
    if torch is not None:
        from kdspec.engine.device.cuda_graphs import use_torch_allocator
        use_torch_allocator()
    return torch


def _gpu_available() -> bool:
    from numba import cuda
    try:
        return bool(cuda.is_available())
    except Exception:  # no driver at all
        return False
