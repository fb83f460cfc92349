"""Does Hopper's wgmma give mma.sync's bits? The question a wgmma kernel for the staged experts must answer first.

The bf16 experts are batch-invariant because every launch shape feeds each output the same mma.sync m16n8k16
k-steps in the same order (numba_kernels/moe/experts_tc.py). A staged kernel on wgmma (asynchronous, its operands
read from shared memory, its accumulators off the issue path) keeps that only if one wgmma m64n8k16 k-step gives
each 16-row slice the bits of an mma.sync m16n8k16 with the same A rows, B and C. This probe runs one warpgroup:
random bf16 A [64, 16 K] and B [16 K, N], random fp32 C, K_STEPS k-steps chained, once as 4 warps x N / 8 mma.sync
and once as wgmma m64nNk16 through numba_kernels/wgmma.py (A from registers in mma.sync's fragment layout, B from
shared memory through a no-swizzle matrix descriptor, laid out as the wgmma experts lay out their tokens), and
prints how many of the 64 N outputs have the same bits and the largest error of each against a float64 product
(which tells a wrong descriptor from a different rounding).

    python3 tools/wgmma_probe.py [--trials 20] [--n 64]   # on an H100 / H200 (numba-cuda compiles for sm_90a there)
"""
from __future__ import annotations

import argparse
import functools

import numpy as np
from numba import cuda, float32, uint32

from kdspec.numba_kernels.mma import mma_bf16, shared_address
from kdspec.numba_kernels.wgmma import CORE_BYTES, CORE_ROW_BYTES, descriptor_base, fence_function, \
    fence_shared_for_wgmma, mma_function, wait_function

K_STEPS = 4      # chained k-steps (K = 64): the accumulator's rounding between steps is part of the question
THREADS = 128    # one warpgroup


@functools.lru_cache(maxsize=None)
def probe_kernel(n: int):
    """The probe for N = n columns: a_bits uint32 [K_STEPS, 64, 8] (A rows, bf16 pairs), b_bits uint32 [K_STEPS, n,
    8] (B's columns as rows, bf16 pairs along K), c float32 [64, n]; out_* float32 [64, n]. One block of 128 threads.
    B in shared memory as numba_kernels/wgmma.py lays it out: per k-step, core matrix h (k 8h .. 8h + 7) of
    columns 8q .. 8q + 7 at byte 32 n step + 16 n h + 128 q."""
    lead = n * CORE_ROW_BYTES
    mma = mma_function(n, lead, CORE_BYTES)
    high = descriptor_base(lead, CORE_BYTES)
    fence, wait = fence_function(4, n // 2), wait_function(0, n // 2)
    b_words = K_STEPS * 8 * n
    half = n // 2

    @cuda.jit
    def kernel(a_bits, b_bits, c, out_mma, out_wgmma):
        b_shared = cuda.shared.array(b_words, uint32, alignment=128)
        scratch = cuda.shared.array(1, float32)
        by_mma = cuda.local.array(half, float32)
        by_wgmma = cuda.local.array(half, float32)
        a = cuda.local.array(4, uint32)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, tq = lane >> 2, lane & 3
        for i in range(tid, b_words, THREADS):
            step, rest = i // (8 * n), i % (8 * n)
            column, k_word = rest // 8, rest % 8
            b_shared[step * 8 * n + (k_word // 4) * 4 * n + 4 * column + k_word % 4] = b_bits[step, column, k_word]
        fence_shared_for_wgmma()
        cuda.syncthreads()
        row = 16 * warp + g
        for m in range(n // 8):
            for e in range(4):
                value = c[row + 8 * (e >> 1), 8 * m + 2 * tq + (e & 1)]
                by_mma[4 * m + e] = value
                by_wgmma[4 * m + e] = value
        base = shared_address(b_shared, 0)
        for step in range(K_STEPS):
            a[0], a[1] = a_bits[step, row, tq], a_bits[step, row + 8, tq]
            a[2], a[3] = a_bits[step, row, tq + 4], a_bits[step, row + 8, tq + 4]
            for m in range(n // 8):
                by_mma[4 * m], by_mma[4 * m + 1], by_mma[4 * m + 2], by_mma[4 * m + 3] = mma_bf16(
                    a[0], a[1], a[2], a[3], b_bits[step, 8 * m + g, tq], b_bits[step, 8 * m + g, tq + 4],
                    by_mma[4 * m], by_mma[4 * m + 1], by_mma[4 * m + 2], by_mma[4 * m + 3], scratch)
            fence(a, by_wgmma)
            mma(by_wgmma, 0, a[0], a[1], a[2], a[3], b_shared, base + step * 32 * n, high, scratch)
            wait(by_wgmma)
        for m in range(n // 8):
            for e in range(4):
                r, column = row + 8 * (e >> 1), 8 * m + 2 * tq + (e & 1)
                out_mma[r, column], out_wgmma[r, column] = by_mma[4 * m + e], by_wgmma[4 * m + e]
    return kernel


def bf16_pairs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 x [..., 2n] -> (its bf16 values as float64, the bf16 pairs as uint32 [..., n], low half first)."""
    bits = (x.astype(np.float32).view(np.uint32) + 0x8000) >> 16  # round half up: any bf16 will do
    values = (bits << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    return values, (bits[..., 0::2] | (bits[..., 1::2] << 16)).astype(np.uint32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--n", type=int, default=64, help="wgmma's N (a multiple of 8 up to 256)")
    args = parser.parse_args()
    n = args.n
    rng = np.random.default_rng(0)
    same_total, worst = 0, {"mma.sync": 0.0, "wgmma": 0.0}
    for _ in range(args.trials):
        a, a_bits = bf16_pairs(rng.standard_normal((K_STEPS, 64, 16)))
        b_t, b_bits = bf16_pairs(rng.standard_normal((K_STEPS, n, 16)))  # [step, n, k]
        c = rng.standard_normal((64, n)).astype(np.float32)
        out_mma, out_wgmma = (cuda.to_device(np.full((64, n), np.nan, np.float32)) for _ in range(2))
        probe_kernel(n)[1, THREADS](cuda.to_device(a_bits), cuda.to_device(b_bits), cuda.to_device(c), out_mma,
                                    out_wgmma)
        got_mma, got_wgmma = out_mma.copy_to_host(), out_wgmma.copy_to_host()
        exact = c.astype(np.float64) + np.einsum("smk,snk->mn", a, b_t)
        same_total += int((got_mma.view(np.uint32) == got_wgmma.view(np.uint32)).sum())
        scale = np.abs(exact).max()
        for name, got in (("mma.sync", got_mma), ("wgmma", got_wgmma)):
            worst[name] = max(worst[name], float(np.abs(got - exact).max() / scale))
    print(f"wgmma m64n{n}k16 against mma.sync m16n8k16, {K_STEPS} chained k-steps, {args.trials} trials: "
          f"{same_total} of {64 * n * args.trials} outputs bit-identical")
    for name, error in worst.items():
        print(f"  {name:8s} max |out - float64| / max |float64| = {error:.2e}")


if __name__ == "__main__":
    main()
