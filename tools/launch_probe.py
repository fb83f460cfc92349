"""What a CUDA graph launch costs the host and the GPU, by the graph's node count (issue #19's host time).

For graphs of N small Numba kernels (N = 1 .. 320, the device step's 150-230 launches in range), captured by
torch with a GPU-clock stamp (numba_kernels/clock.py) as the first and the last node, over REPLAYS replays:
the host's replay() call, the whole replay + synchronize, and the span between the stamps on the GPU's clock;
overhead = whole - span (the launch's way to the GPU, and the synchronize's way back). ``split`` launches the
same kernels as two graphs, the first of HEAD nodes, back to back: does the GPU start while the host is still
launching the rest?

    python3 -W ignore tools/launch_probe.py

Run on the GPU machine; prints one line per (N, split).
"""
from __future__ import annotations

import time

import numpy as np

REPLAYS = 200
HEAD = 4


def main() -> None:
    import torch
    from numba import cuda

    from kdspec.engine.device import cuda_graphs
    from kdspec.numba_kernels.clock import Stamps

    cuda_graphs.use_torch_allocator()

    @cuda.jit
    def bump(cells, index):
        if cuda.grid(1) == 0:
            cells[index] += 1.0

    cells = cuda.to_device(np.zeros(1024, np.float32))
    stamps = Stamps(REPLAYS + 8)

    def capture(kernels, first, last):
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
            if first:
                stamps.stamp(False, stream)
            for k in kernels:
                bump[1, 32, stream](cells, k % 1024)
            if last:
                stamps.stamp(True, stream)
        torch.cuda.synchronize()
        return graph

    for nodes in (1, 16, 64, 160, 256, 320):
        for split in (False, True):
            if split and nodes <= HEAD:
                continue
            graphs = ([capture(range(HEAD), True, False), capture(range(HEAD, nodes), False, True)] if split
                      else [capture(range(nodes), True, True)])
            for graph in graphs:  # warm: the first launch uploads the graph
                graph.replay()
            torch.cuda.synchronize()
            stamps.clear()
            calls, wholes = [], []
            for _ in range(REPLAYS):
                start = time.perf_counter()
                for graph in graphs:
                    graph.replay()
                called = time.perf_counter()
                torch.cuda.synchronize()
                calls.append(called - start)
                wholes.append(time.perf_counter() - start)
            spans = stamps.spans()
            span = np.median(spans[:, 1] - spans[:, 0])
            whole = np.median(wholes)
            print(f"{nodes:4d} nodes{' split' if split else '      '}: replay call {np.median(calls) * 1e6:7.1f} us, "
                  f"replay + sync {whole * 1e6:7.1f} us, GPU span {span * 1e6:7.1f} us, "
                  f"overhead {(whole - span) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
