"""Does Hopper's wgmma give mma.sync's bits? The question a wgmma kernel for the staged experts must answer first.

The bf16 experts are batch-invariant because every launch shape feeds each output the same mma.sync m16n8k16
k-steps in the same order (numba_kernels/moe/experts_tc.py). A staged kernel on wgmma (asynchronous, its operands
read from shared memory, its accumulators off the issue path) keeps that only if one wgmma m64n8k16 k-step gives
each 16-row slice the bits of an mma.sync m16n8k16 with the same A rows, B and C. This probe runs one warpgroup:
random bf16 A [64, 16 K] and B [16 K, 8], random fp32 C, K_STEPS k-steps chained, once as 4 warps x mma.sync and
once as wgmma (A from registers in mma.sync's fragment layout, B from shared memory through a matrix descriptor,
no swizzle: two 8 x 16-byte core matrices along K), and prints how many of the 512 outputs have the same bits and
the largest error of each against a float64 product (which tells a wrong descriptor from a different rounding).

    python3 tools/wgmma_probe.py [--trials 20]      # on an H100 / H200 (numba-cuda compiles for sm_90a there)
"""
from __future__ import annotations

import argparse

import numpy as np
from llvmlite import ir
from numba import cuda, float32, types, uint32, uint64
from numba.cuda.extending import intrinsic

from kdspec.numba_kernels.mma import mma_bf16, shared_address

K_STEPS = 4      # chained k-steps (K = 64): the accumulator's rounding between steps is part of the question
THREADS = 128    # one warpgroup
B_WORDS = K_STEPS * 64  # uint32 of B in shared memory: a k-step is two core matrices of 8 n x 16 bytes


@intrinsic
def _wgmma_m64n8k16(typingctx, d0, d1, d2, d3, a0, a1, a2, a3, descriptor):
    """{d0..d3} = A (a0..a3: this lane's mma.sync m16n8k16 A fragment of its warp's 16 rows) @ B (the shared-memory
    descriptor) + {d0..d3}, issued, committed and waited for (one k-step, synchronous)."""
    signature = types.UniTuple(types.float32, 4)(*([types.float32] * 4 + [types.uint32] * 4 + [types.uint64]))

    def codegen(context, builder, sig, args):
        f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        # scale-d is a predicate (true: D = A B + D); scale-a, scale-b 1 and trans-b 0 (B K-major) are immediates
        asm = ir.InlineAsm(
            ir.FunctionType(ir.LiteralStructType([f32] * 4), [f32] * 4 + [i32] * 4 + [i64, i32]),
            "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, $13, 0;\n"
            "wgmma.fence.sync.aligned;\n"
            "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {$0,$1,$2,$3}, {$8,$9,$10,$11}, $12, accumulate, "
            "1, 1, 0;\n"
            "wgmma.commit_group.sync.aligned;\n"
            "wgmma.wait_group.sync.aligned 0;\n}",
            "=f,=f,=f,=f,0,1,2,3,r,r,r,r,l,r,~{memory}", side_effect=True)
        d = builder.call(asm, list(args) + [ir.Constant(i32, 1)])
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, n) for n in range(4)])

    return signature, codegen


@intrinsic
def _fence_proxy_async(typingctx):
    """fence.proxy.async.shared::cta: this thread's shared-memory stores visible to the async proxy (wgmma)."""
    def codegen(context, builder, sig, args):
        builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "fence.proxy.async.shared::cta;", "~{memory}",
                                  side_effect=True), [])
        return context.get_dummy_value()
    return types.void(), codegen


@cuda.jit(device=True, forceinline=True)
def descriptor(address, leading_bytes, stride_bytes):
    """A wgmma shared-memory matrix descriptor without swizzle: start address, leading and stride byte offsets,
    each in 16-byte units (bits 0-13, 16-29, 32-45)."""
    return (uint64((address >> 4) & 0x3FFF) | (uint64((leading_bytes >> 4) & 0x3FFF) << uint64(16))
            | (uint64((stride_bytes >> 4) & 0x3FFF) << uint64(32)))


@cuda.jit
def probe_kernel(a_bits, b_bits, c, out_mma, out_wgmma):
    """a_bits uint32 [K_STEPS, 64, 8] (A rows, bf16 pairs), b_bits uint32 [K_STEPS, 8, 8] (B's columns n as rows,
    bf16 pairs along K), c float32 [64, 8]; out_* float32 [64, 8]. One block of 128 threads."""
    b_shared = cuda.shared.array(B_WORDS, uint32, alignment=128)
    scratch = cuda.shared.array(1, float32)
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    g, tq = lane >> 2, lane & 3
    for i in range(tid, B_WORDS, THREADS):
        step, rest = i // 64, i % 64
        n, k_word = rest // 8, rest % 8  # core matrix k_word // 4: 8 rows n of 4 words
        b_shared[step * 64 + 32 * (k_word // 4) + 4 * n + k_word % 4] = b_bits[step, n, k_word]
    _fence_proxy_async()
    cuda.syncthreads()
    row = 16 * warp + g
    m0, m1, m2, m3 = c[row, 2 * tq], c[row, 2 * tq + 1], c[row + 8, 2 * tq], c[row + 8, 2 * tq + 1]
    w0, w1, w2, w3 = m0, m1, m2, m3
    for step in range(K_STEPS):
        a0, a1 = a_bits[step, row, tq], a_bits[step, row + 8, tq]
        a2, a3 = a_bits[step, row, tq + 4], a_bits[step, row + 8, tq + 4]
        m0, m1, m2, m3 = mma_bf16(a0, a1, a2, a3, b_bits[step, g, tq], b_bits[step, g, tq + 4], m0, m1, m2, m3,
                                  scratch)
        # both offsets 128 bytes: with one core matrix along n, whichever of them steps along K is right
        w0, w1, w2, w3 = _wgmma_m64n8k16(w0, w1, w2, w3, a0, a1, a2, a3,
                                         descriptor(shared_address(b_shared, step * 64), 128, 128))
    for value_m, value_w, r, col in ((m0, w0, row, 2 * tq), (m1, w1, row, 2 * tq + 1), (m2, w2, row + 8, 2 * tq),
                                     (m3, w3, row + 8, 2 * tq + 1)):
        out_mma[r, col], out_wgmma[r, col] = value_m, value_w


def bf16_pairs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 x [..., 2n] -> (its bf16 values as float64, the bf16 pairs as uint32 [..., n], low half first)."""
    bits = (x.astype(np.float32).view(np.uint32) + 0x8000) >> 16  # round half up: any bf16 will do
    values = (bits << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    return values, (bits[..., 0::2] | (bits[..., 1::2] << 16)).astype(np.uint32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    same_total, worst = 0, {"mma.sync": 0.0, "wgmma": 0.0}
    for _ in range(args.trials):
        a, a_bits = bf16_pairs(rng.standard_normal((K_STEPS, 64, 16)))
        b_t, b_bits = bf16_pairs(rng.standard_normal((K_STEPS, 8, 16)))  # [step, n, k]
        c = rng.standard_normal((64, 8)).astype(np.float32)
        out_mma, out_wgmma = (cuda.to_device(np.full((64, 8), np.nan, np.float32)) for _ in range(2))
        probe_kernel[1, THREADS](cuda.to_device(a_bits), cuda.to_device(b_bits), cuda.to_device(c), out_mma,
                                 out_wgmma)
        got_mma, got_wgmma = out_mma.copy_to_host(), out_wgmma.copy_to_host()
        exact = c.astype(np.float64) + np.einsum("smk,snk->mn", a, b_t)
        same_total += int((got_mma.view(np.uint32) == got_wgmma.view(np.uint32)).sum())
        scale = np.abs(exact).max()
        for name, got in (("mma.sync", got_mma), ("wgmma", got_wgmma)):
            worst[name] = max(worst[name], float(np.abs(got - exact).max() / scale))
    print(f"wgmma m64n8k16 against mma.sync m16n8k16, {K_STEPS} chained k-steps, {args.trials} trials: "
          f"{same_total} of {512 * args.trials} outputs bit-identical")
    for name, error in worst.items():
        print(f"  {name:8s} max |out - float64| / max |float64| = {error:.2e}")


if __name__ == "__main__":
    main()
