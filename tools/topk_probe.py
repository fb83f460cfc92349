"""The split top-k of a verify's logits (numba_kernels/sampling.py) at several vocabulary chunk sizes, side by side
(issue #19): GPU time per call of both launches (chunk candidates, then the per-row merge) from torch's profiler,
for row counts 1..256 over K2's 163840-entry vocabulary, and whether every chunk size gives the same ids, values
and margins bit for bit as the smallest (the chunk is a launch shape, never a numerical choice).

    python3 -W ignore tools/topk_probe.py [--rows 1,8,64,128,256] [--chunks 4096,8192,16384,32768] [--k 1,8]

Run on the GPU machine; prints one line per (k, rows, chunk) and the chunk the launcher picks for those rows.
"""
from __future__ import annotations

import argparse

import numpy as np

VOCAB = 163840
REPEATS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64,128,256")
    parser.add_argument("--chunks", default="4096,8192,16384,32768")
    parser.add_argument("--k", default="1,8")
    args = parser.parse_args()
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kdspec.engine.device import cuda_graphs
    from kdspec.numba_kernels import sampling
    cuda_graphs.use_torch_allocator()  # Numba's allocations from torch's cache: no cudaMalloc between launches
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"{'k':>2} {'rows':>5} {'chunk':>6} {'us/call':>9} {'vs first':>9}  same bits  (launcher's chunk)")
    for k in (int(n) for n in args.k.split(",")):
        for rows in (int(n) for n in args.rows.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(rows)
            logits = torch.randn(rows, VOCAB, device="cuda", generator=gen)
            logits[:, ::4099] = logits[:, :1]  # exact ties across chunks: the lower id must win everywhere
            device_logits = numba_view(logits)
            first_time, first_bits = None, None
            for chunk in chunks:
                run = lambda: sampling.topk_rows(device_logits, k, split_chunk=chunk)  # noqa: E731
                bits = [a.copy_to_host() for a in run()]
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as profiler:
                    for _ in range(REPEATS):
                        run()
                    torch.cuda.synchronize()
                micros = sum(event.time_range.end - event.time_range.start for event in profiler.events()
                             if event.device_type == DeviceType.CUDA and "candidates" in event.name) / REPEATS
                if first_time is None:
                    first_time, first_bits = micros, bits
                same = all(np.array_equal(a.view(np.int32), b.view(np.int32)) for a, b in zip(bits, first_bits))
                print(f"{k:>2} {rows:>5} {chunk:>6} {micros:9.1f} {micros / first_time:9.3f}  {str(same):>9}  "
                      f"({sampling.split_chunk_for(rows, VOCAB)})")


def numba_view(tensor):
    """A Numba view of a contiguous float32 torch tensor (no copy)."""
    from numba import cuda
    return cuda.from_cuda_array_interface({**tensor.__cuda_array_interface__, "stream": None}, owner=tensor,
                                          sync=False)


if __name__ == "__main__":
    main()
