"""CUDA graphs for the device model's forward, and the allocator that makes them possible.

A k2-mini step is ~120 small launches (Numba kernels and torch GEMMs); issued one by one from Python it is
bound by the host (~20 ms a step against a ~2 ms memory roofline). The forward is therefore cut into
segments that each run as one captured graph:

    segment 0: embed, input norm, q / kv projections of layer 0
    segment i: the rest of layer i-1 (absorb, o_proj, norm, MoE or MLP), then projections of layer i
    segment L: the rest of layer L-1, final norm, LM head
    between segments i and i+1: the KV-cache write and MLA attention of layer i, launched eagerly

The cache write and attention stay outside the graphs because they take the cache length as a launch
scalar (and attention picks its grid from it); everything in a segment depends only on the token count s,
so one capture per s serves every step of that shape. A step on the device (engine/device/step.py) captures
the whole forward instead: there the cache write and the batch-invariant attention read the length from the
device.

Graph capture needs every allocation to come from torch's graph pool and every launch to go to the
capturing stream. ``TorchMemoryManager`` is a Numba EMM plugin that allocates from torch's caching
allocator (also cheaper than cuMemAlloc / deferred cuMemFree in eager mode); launchers get their stream
from the caller.
"""
from __future__ import annotations

from numba import cuda
from numba.cuda.cudadrv import driver


class TorchMemoryManager(driver.HostOnlyCUDAMemoryManager):
    """Numba device allocations from torch's caching allocator, on torch's current stream (inside a graph
    capture: the graph's private pool)."""

    def initialize(self):
        super().initialize()

    def memalloc(self, size):
        import torch
        pointer = torch.cuda.caching_allocator_alloc(size) if size else 0
        finalizer = (lambda: torch.cuda.caching_allocator_delete(pointer)) if size else None
        return driver.MemoryPointer(self.context, driver.binding.CUdeviceptr(pointer), size, finalizer=finalizer)

    def get_memory_info(self):
        import torch
        free, total = torch.cuda.mem_get_info()
        return driver.MemoryInfo(free=free, total=total)

    def get_ipc_handle(self, memory):
        raise NotImplementedError("IPC handles are not supported for torch-allocated memory")

    def reset(self):
        import torch
        super().reset()
        torch.cuda.empty_cache()

    @property
    def interface_version(self):
        return 1


def use_torch_allocator() -> None:
    """Route Numba's device allocations through torch from now on (this context and any later one)."""
    cuda.set_memory_manager(TorchMemoryManager)
    context = cuda.current_context()
    if not isinstance(context.memory_manager, TorchMemoryManager):
        # Numba builds a context's manager when it creates the context; one that exists already (a test or a
        # benchmark touched the GPU first) gets the plugin here. Its earlier allocations keep their own
        # finalizers, which do not depend on the manager.
        context.memory_manager = TorchMemoryManager(context=context)
        context.memory_manager.initialize()


class SegmentGraphs:
    """The captured segments of one token count s: ``replay(k)`` runs segment k on torch's current stream.

    ``state`` holds every array that crosses a segment boundary (static addresses the graphs read and write);
    it must live as long as the graphs."""

    def __init__(self, torch, run_segment, num_segments: int, state: dict):
        self.state = state
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs = []
        torch.cuda.synchronize()
        for k in range(num_segments):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                run_segment(k, state, cuda.external_stream(torch.cuda.current_stream().cuda_stream))
            self.graphs.append(graph)
        torch.cuda.synchronize()

    def replay(self, k: int) -> None:
        self.graphs[k].replay()

