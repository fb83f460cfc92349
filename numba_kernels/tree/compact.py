"""Post-verify KV cache compaction for every layer in one launch: row base+accepted[j] -> base+j.

accepted[k] can equal j for k < j (row base+j is a source for a later move and a destination of an
earlier one), so each thread first reads all the source values of its columns into registers, and only
then writes; threads own disjoint columns, so no other thread can overwrite a value before it is read.
Rows already in place (accepted[j] == j: the whole path in the common case of a chain of first children)
are neither read nor written.

``compact_on_device`` is the step-on-the-device form: the base row is the cache length the device keeps
(int32 [1]), accepted and tau the accept kernel's outputs, and a second launch then advances that length by
tau; nothing is read back, so a CUDA graph can capture both.
Dimension letters: b requests, t cache rows (capacity), L drafted depths; width = c + r (e.g. 512 + 64).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array as to_device
from kdspec.numba_kernels.runtime import ON_SIMULATOR

MAX_ACCEPT = 32  # L + 1 <= 32 drafted positions per step
COMPACT_THREADS = 4 if ON_SIMULATOR else 128
MAX_REQUESTS = 1024  # advance_lengths_kernel: one thread a request, one block


@kernel_cache.jit
def compact_rows_kernel(cache, base_rows, accepted, tau):
    """cache float32 [layers, t, width], compacted in place; grid (layers, b).

    base_rows int [b]: cache row of each request's tree root (P); requests own disjoint row ranges.
    accepted int [b, L+1] (padded), tau int [b]: moves row base+accepted[j] -> base+j for j < tau.
    """
    layer = cuda.blockIdx.x
    request = cuda.blockIdx.y
    base = base_rows[request]
    count = tau[request]
    held = cuda.local.array(MAX_ACCEPT, float32)
    for column in range(cuda.threadIdx.x, cache.shape[2], cuda.blockDim.x):
        for j in range(count):  # read every source of this column first ...
            if accepted[request, j] != j:
                held[j] = cache[layer, base + accepted[request, j], column]
        for j in range(count):  # ... then write: a later source can no longer be clobbered
            if accepted[request, j] != j:
                cache[layer, base + j, column] = held[j]


@kernel_cache.jit
def advance_lengths_kernel(lengths, tau):
    """lengths int32 [b] += tau int32 [b] (the committed rows of each request); grid (1,), threads >= b."""
    request = cuda.threadIdx.x
    if request < lengths.shape[0]:
        lengths[request] += tau[request]


def compact_rows(cache, base_rows, accepted, tau, threads: int = COMPACT_THREADS):
    """Compact cache (device float32 [layers, t, width]) in place for b requests; returns (src, dst) int32
    [b, L+1] numpy arrays of the row moves (padded -1). base_rows, accepted, tau: numpy (checked here)."""
    if not hasattr(cache, "copy_to_host"):
        raise ValueError("cache must be a device array (compaction is in place)")
    if len(cache.shape) != 3 or cache.dtype != np.float32:
        raise ValueError(f"cache must be float32 [layers, t, width], got {cache.dtype} {cache.shape}")
    base_rows = np.asarray(base_rows)
    accepted = np.asarray(accepted)
    tau = np.asarray(tau)
    if accepted.ndim != 2 or base_rows.shape != (accepted.shape[0],) or tau.shape != (accepted.shape[0],):
        raise ValueError(f"accepted {accepted.shape} must be [b, L+1]; base_rows {base_rows.shape} and tau "
                         f"{tau.shape} [b]")
    if accepted.shape[1] > MAX_ACCEPT:
        raise ValueError(f"at most {MAX_ACCEPT} accepted nodes per request, got width {accepted.shape[1]}")
    if ((tau < 1) | (tau > accepted.shape[1])).any():
        raise ValueError(f"tau must be in 1..{accepted.shape[1]}, got {tau.tolist()}")
    valid = np.arange(accepted.shape[1])[None, :] < tau[:, None]
    src = np.where(valid, base_rows[:, None] + accepted, -1).astype(np.int32)
    dst = np.where(valid, base_rows[:, None] + np.arange(accepted.shape[1])[None, :], -1).astype(np.int32)
    if (src[valid] < 0).any() or (src[valid] >= cache.shape[1]).any():
        raise ValueError(f"compaction source rows outside the cache of {cache.shape[1]} rows")
    if cache.shape[0] == 0:
        return src, dst
    compact_rows_kernel[(cache.shape[0], accepted.shape[0]), threads](cache, to_device(base_rows),
                                                                      to_device(accepted), to_device(tau))
    return src, dst


def compact_on_device(caches, lengths, accepted, tau, stream=0):
    """Compact each of ``caches`` (device float32 [layers, t, width]) for b requests from device arrays only,
    then lengths += tau: lengths int32 [b] (the rows committed before the step: each request's base row),
    accepted int32 [b, >= L+1] (the accept kernel's padded path), tau int32 [b] in 1..min(MAX_ACCEPT, width).
    Nothing is checked on the device's values (they are not on the host): the accept kernel's outputs satisfy
    the rules compact_rows checks. Nothing is allocated or read back (a CUDA graph can capture it)."""
    batch = lengths.shape[0]
    if tuple(tau.shape) != (batch,) or len(accepted.shape) != 2 or accepted.shape[0] != batch:
        raise ValueError(f"lengths {tuple(lengths.shape)}, accepted {tuple(accepted.shape)} and tau "
                         f"{tuple(tau.shape)} must be [b], [b, L+1], [b]")
    if not 1 <= batch <= MAX_REQUESTS or any(a.dtype != np.int32 for a in (lengths, accepted, tau)):
        raise ValueError(f"lengths, accepted and tau must be int32 device arrays of 1..{MAX_REQUESTS} requests")
    for cache in caches:
        if len(cache.shape) != 3 or cache.dtype != np.float32:
            raise ValueError(f"caches must be float32 [layers, t, width], got {cache.dtype} {cache.shape}")
        if cache.shape[0]:
            compact_rows_kernel[(cache.shape[0], batch), COMPACT_THREADS, stream](cache, lengths, accepted, tau)
    advance_lengths_kernel[1, batch, stream](lengths, tau)
