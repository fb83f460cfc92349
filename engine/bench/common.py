"""What every bench suite shares: result rows, timing, the two ceilings measured in the same run, a table.

Rows are plain dicts with the keys of ``ROW_KEYS`` (kdtree_tui/bench.py uses the same format):
suite, metric, value, unit, peer (name of what we compare against, or None), peer_value, ratio (value over
peer_value, oriented so that > 1 is better for us), target (a string such as ">= 100x", or None), ok (True /
False against the target, None without one), note.

Timing: GPU work is timed with CUDA events around ``repeats`` calls after ``warmup`` calls and reported as the
median; under the CUDA simulator (no events there) with perf_counter. ``time_graph`` times a launch sequence
captured as one CUDA graph, as the device model runs its kernels (GPU time, no Python launch time). Ceilings: ``copy_bandwidth`` (a large
device-to-device copy, bytes read + written per second) and ``fma_peak`` (a Numba kernel of long independent
fp32 FMA chains in registers, 2 FLOP per FMA).
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Callable, Optional

import numpy as np
from numba import cuda, float32

from kdspec.numba_kernels.runtime import ON_SIMULATOR

ROW_KEYS = ("suite", "metric", "value", "unit", "peer", "peer_value", "ratio", "target", "ok", "note")


def row(suite: str, metric: str, value, unit: str = "", *, peer: Optional[str] = None, peer_value=None,
        ratio=None, target: Optional[str] = None, ok: Optional[bool] = None, note: str = "") -> dict:
    """One result row; ``ratio`` defaults to value / peer_value when both are numbers."""
    if ratio is None and _is_number(value) and _is_number(peer_value) and peer_value != 0:
        ratio = float(value) / float(peer_value)
    return dict(suite=suite, metric=metric, value=_plain(value), unit=unit, peer=peer, peer_value=_plain(peer_value),
                ratio=_plain(ratio), target=target, ok=None if ok is None else bool(ok), note=note)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


def _plain(x):
    """numpy scalars -> Python numbers (rows must be JSON-serialisable)."""
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return x


def progress(message: str) -> None:
    """A progress line on stderr (the table or JSON goes to stdout)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- timing
def synchronize() -> None:
    if not ON_SIMULATOR:
        cuda.synchronize()
    try:  # torch work on its own streams (cuBLAS peers) must be finished too
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except ImportError:
        pass


def time_gpu(fn: Callable[[], object], warmup: int = 2, repeats: int = 10) -> float:
    """Median seconds of one ``fn()`` call: CUDA events on a GPU (default stream, which torch's legacy default
    stream shares), perf_counter under the simulator."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        if ON_SIMULATOR:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            continue
        begin, end = cuda.event(), cuda.event()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)



def time_graph(torch, launch: Callable[[object], object], warmup: int = 3, repeats: int = 20,
               after_capture: Optional[Callable[[], object]] = None) -> float:
    """Median seconds of one replay of ``launch(stream)`` captured as a CUDA graph: the GPU time of a launch
    sequence as the device model runs it (inside its step graphs), without Python's launch time. ``launch``
    issues every kernel on the Numba stream it is given (torch's capture stream) and allocates through torch
    (engine.device.cuda_graphs.use_torch_allocator); one eager call first compiles its kernels.
    ``after_capture`` runs between the capture and the first replay (poison an output there: only the
    replays can then have written it)."""
    from kdspec.engine.device import cuda_graphs
    cuda_graphs.use_torch_allocator()
    synchronize()  # work queued on other streams (inputs uploaded on Numba's default stream) is done first
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        launch(cuda.external_stream(side.cuda_stream))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(cuda.external_stream(torch.cuda.current_stream().cuda_stream))
    if after_capture is not None:
        after_capture()
        synchronize()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times)

# ------------------------------------------------------------------------------------------- ceilings
FMA_CHAINS = 8          # independent accumulators per thread: hides the FMA latency
FMA_UNROLL = 4          # each loop trip runs FMA_CHAINS * FMA_UNROLL FMAs
FMA_PER_TRIP = FMA_CHAINS * FMA_UNROLL
FMA_THREADS = 256

if ON_SIMULATOR:
    @cuda.jit(device=True)
    def _fma(a, b, c):
        return a * b + c
else:
    @cuda.jit(device=True)
    def _fma(a, b, c):
        return cuda.fma(a, b, c)


@cuda.jit
def fma_peak_kernel(trips, b, c, out):
    """Each thread: FMA_CHAINS register accumulators, ``trips`` x FMA_UNROLL rounds of acc = acc * b + c
    (32 FMAs per trip, written out so there is no inner loop); out[i] float32 [threads] = sum of accumulators,
    so the compiler cannot drop the work."""
    i = cuda.grid(1)
    a0 = float32(i) * float32(1e-9)
    a1 = a0 + float32(1.0)
    a2 = a0 + float32(2.0)
    a3 = a0 + float32(3.0)
    a4 = a0 + float32(4.0)
    a5 = a0 + float32(5.0)
    a6 = a0 + float32(6.0)
    a7 = a0 + float32(7.0)
    for _ in range(trips):
        for _u in range(FMA_UNROLL):  # constant trip count: unrolled
            a0 = _fma(a0, b, c)
            a1 = _fma(a1, b, c)
            a2 = _fma(a2, b, c)
            a3 = _fma(a3, b, c)
            a4 = _fma(a4, b, c)
            a5 = _fma(a5, b, c)
            a6 = _fma(a6, b, c)
            a7 = _fma(a7, b, c)
    if i < out.shape[0]:
        out[i] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7


def fma_peak(quick: bool = False) -> float:
    """Measured fp32 FLOP/s (2 per FMA) of fma_peak_kernel over enough blocks to fill every SM many times."""
    if quick or ON_SIMULATOR:
        blocks, threads, trips = 2, 4, 4
    else:
        sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
        blocks, threads, trips = sms * 16, FMA_THREADS, 4096
    out = cuda.device_array(blocks * threads, dtype=np.float32)
    b, c = np.float32(0.999999), np.float32(1e-7)  # stays finite over any number of trips
    seconds = time_gpu(lambda: fma_peak_kernel[blocks, threads](trips, b, c, out), warmup=1,
                       repeats=1 if ON_SIMULATOR else 5)
    if not np.isfinite(out.copy_to_host()).all():
        raise RuntimeError("fma_peak_kernel produced non-finite values")
    return blocks * threads * trips * FMA_PER_TRIP * 2 / seconds


@cuda.jit
def copy_kernel(src, dst):
    """dst[i] = src[i], grid-stride (float32 [n])."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, src.shape[0], stride):
        dst[i] = src[i]


def copy_bandwidth(quick: bool = False) -> float:
    """Measured device memory bandwidth, bytes read + written per second: the better of a driver
    device-to-device copy and a Numba copy kernel over a 2 GiB buffer (far beyond L2)."""
    n = 1024 if (quick or ON_SIMULATOR) else (1 << 29)  # float32 elements: 2 GiB each side
    src = cuda.to_device(np.arange(n, dtype=np.float32)) if n <= 4096 else cuda.device_array(n, np.float32)
    dst = cuda.device_array(n, dtype=np.float32)
    repeats = 1 if ON_SIMULATOR else 10
    driver = time_gpu(lambda: dst.copy_to_device(src), warmup=1, repeats=repeats)
    blocks = 4 if ON_SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT * 8
    threads = 4 if ON_SIMULATOR else 256
    kernel = time_gpu(lambda: copy_kernel[blocks, threads](src, dst), warmup=1, repeats=repeats)
    if n <= 4096 and not np.array_equal(dst.copy_to_host(), np.arange(n, dtype=np.float32)):
        raise RuntimeError("copy_kernel did not copy")
    return 2 * n * 4 / min(driver, kernel)


_CEILINGS: dict = {}


TENSOR_CORE_SIDE = 8192   # the bf16 peak's square product: [n, n] x [n, n], 1.1 TFLOP


def tensor_core_peak(quick: bool = False) -> float | None:
    """Measured bf16 tensor-core FLOP/s: torch's bf16 matmul (cuBLAS, fp32 accumulation) of two
    TENSOR_CORE_SIDE-square matrices, the best of 5 after a warm-up; None without torch on a GPU (or quick)."""
    torch = None if quick else torch_cuda()
    if torch is None:
        return None
    n = TENSOR_CORE_SIDE
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for trial in range(6):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        if trial:   # the first call picks cuBLAS's algorithm
            best = min(best, start.elapsed_time(end) * 1e-3)
    del a, b
    return 2 * n ** 3 / best


def ceilings(quick: bool = False) -> dict:
    """{"copy_bytes_per_s", "fma_flops", "tensor_core_flops" (None without torch)} measured once per process
    (and per quick flag)."""
    if quick not in _CEILINGS:
        progress("measuring ceilings (device copy bandwidth, fp32 FMA peak, bf16 tensor-core peak)")
        _CEILINGS[quick] = dict(copy_bytes_per_s=copy_bandwidth(quick), fma_flops=fma_peak(quick),
                                tensor_core_flops=tensor_core_peak(quick))
    return _CEILINGS[quick]


def ceiling_rows(quick: bool = False) -> list[dict]:
    c = ceilings(quick)
    rows = [row("ceiling", "copy bandwidth (read + write)", c["copy_bytes_per_s"] / 1e9, "GB/s",
                note="max of cudaMemcpy D2D and a Numba copy kernel, 2 GiB"),
            row("ceiling", "fp32 FMA peak", c["fma_flops"] / 1e12, "TFLOP/s",
                note=f"Numba kernel, {FMA_CHAINS} register FMA chains per thread")]
    if c["tensor_core_flops"] is not None:
        rows.append(row("ceiling", "bf16 tensor-core peak", c["tensor_core_flops"] / 1e12, "TFLOP/s",
                        note=f"torch bf16 matmul (cuBLAS), {TENSOR_CORE_SIDE}-square"))
    return rows


def torch_cuda():
    """torch when it can run on this GPU, else None (peers are then skipped with a note)."""
    if ON_SIMULATOR:
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 peers compute in fp32, like our kernels
    torch.backends.cudnn.allow_tf32 = False
    return torch


# ---------------------------------------------------------------------------------------------- table
def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if x == 0 or 1e-3 <= abs(x) < 1e6:
            return f"{x:.4g}"
        return f"{x:.3e}"
    return str(x)


def format_table(rows: list[dict]) -> str:
    """Rows as an aligned text table (suite, metric, value unit, peer, peer value, ratio, target, ok, note)."""
    header = ("suite", "metric", "value", "unit", "peer", "peer value", "ratio", "target", "ok", "note")
    cells = [header] + [(r["suite"], r["metric"], _fmt(r["value"]), r.get("unit") or "", r.get("peer") or "-",
                         _fmt(r.get("peer_value")), _fmt(r.get("ratio")), r.get("target") or "-",
                         _fmt(r.get("ok")), r.get("note") or "") for r in rows]
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(header) - 1)]
    lines = []
    for c in cells:
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(c[:-1], widths)) + ("  " + c[-1] if c[-1] else ""))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
