"""Hopper's asynchronous warpgroup mma (wgmma, sm_90a) for bf16 products with fp32 accumulators.

One warpgroup (4 warps, 128 threads) issues ``wgmma.mma_async m64nNk16``: A = 64 rows x 16 k from registers, each
warp's 16 rows in mma.sync m16n8k16's A fragment (mma.py: a0..a3), B = 16 k x N columns from shared memory through
a matrix descriptor, D += A @ B into N / 2 fp32 registers a thread: register 4 m + c holds what mma.sync's C
fragment c would for 8-column tile m (c0 (g, 2tq), c1 (g, 2tq + 1), c2 (g + 8, 2tq), c3 (g + 8, 2tq + 1)). The
tensor core runs it asynchronously: the issuing warps go on until ``wait`` says the group is done.

Bits: one k-step of wgmma gives each 16-row slice the bits of an mma.sync m16n8k16 with the same A rows, B and C
(tools/wgmma_probe.py, measured on an H100), so a kernel on wgmma keeps the bits of one on mma.sync.

B in shared memory, no swizzle, K-major: "core matrices" of 8 columns n x 8 k, each 8 rows of 16 contiguous bytes
(row = column n, its k 0..7 or 8..15); the descriptor gives the first core matrix's address, ``lead_bytes`` from a
core matrix to the next along k (its k 8..15) and ``stride_bytes`` to the next 8 columns. Lane (g, tq)'s B fragment
of column tile m is word tq of row g of its two core matrices (k 2tq, 2tq + 1 and 2tq + 8, 2tq + 9).

Register discipline (PTX ISA, wgmma.fence): a register that another instruction wrote (A fragments, accumulators
zeroed or folded) is read by a wgmma only after ``fence``; the accumulators are read by other instructions only
after ``wait``. Both take the registers as tied operands, so the compiler cannot move an access across them.
Under the CUDA simulator (which runs no PTX) ``mma`` is N / 8 mma.sync m16n8k16 (mma.py's model) reading the same
shared B; fence and wait do nothing there. Every thread of the block calls them (the simulator's mma syncs it).
"""
from __future__ import annotations

import functools

from numba import cuda, types, uint32, uint64

from kdspec.numba_kernels.mma import WARP, mma_bf16
from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function

WARPGROUP = 4 * WARP
CORE_ROW_BYTES = 16   # a core matrix row: 8 bf16 along k
CORE_BYTES = 128      # a core matrix: 8 rows


def descriptor_base(lead_bytes: int, stride_bytes: int) -> int:
    """A no-swizzle matrix descriptor without its address (bits 16-29 the leading byte offset, 32-45 the stride byte
    offset, both in 16-byte units): add ``address >> 4`` (a shared-window address below 256 KB) to complete it."""
    if lead_bytes % 16 or stride_bytes % 16 or not (0 < lead_bytes < 1 << 18 and 0 < stride_bytes < 1 << 18):
        raise ValueError(f"wgmma descriptor: offsets {lead_bytes}, {stride_bytes} must be multiples of 16 below 256 KB")
    return ((lead_bytes >> 4) << 16) | ((stride_bytes >> 4) << 32)


if ON_SIMULATOR:
    @functools.lru_cache(maxsize=None)
    def mma_function(n: int, lead_bytes: int, stride_bytes: int):
        """Device function mma(acc, o, a0, a1, a2, a3, b_shared, b_at, descriptor_high, scratch): acc[o .. o + n/2)
        += A (this lane's fragment) @ B (b_shared, uint64 [..], its first core matrix at element b_at). The
        simulator's model: n / 8 mma_bf16 in column-tile order; descriptor_high unused."""
        @device_function()
        def mma(acc, o, a0, a1, a2, a3, b_shared, b_at, descriptor_high, scratch):
            lane = cuda.threadIdx.x % WARP
            g, tq = lane >> 2, lane & 3
            for m in range(n // 8):
                fragment = []
                for h in range(2):
                    byte = int(8 * b_at + h * lead_bytes + m * stride_bytes + g * CORE_ROW_BYTES + 4 * tq)
                    fragment.append(uint32((int(b_shared[byte // 8]) >> (32 * (byte % 8 // 4))) & 0xFFFFFFFF))
                at = o + 4 * m
                acc[at], acc[at + 1], acc[at + 2], acc[at + 3] = mma_bf16(
                    a0, a1, a2, a3, fragment[0], fragment[1], acc[at], acc[at + 1], acc[at + 2], acc[at + 3], scratch)
        return mma

    @functools.lru_cache(maxsize=None)
    def fence_function(n_words: int, n_floats: int):
        """Device function fence(words, floats): wgmma.fence over words[0 .. n_words) and floats[0 .. n_floats)."""
        @device_function()
        def fence(words, floats):
            pass
        return fence

    @functools.lru_cache(maxsize=None)
    def wait_function(pending: int, n_floats: int, commit: bool = True):
        """Device function wait(floats): commit this warpgroup's wgmma (unless ``commit`` is False: the groups
        already committed), wait until at most ``pending`` groups are in flight; floats[0 .. n_floats) (the
        accumulators) are read after it."""
        @device_function()
        def wait(floats):
            pass
        return wait
else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    def _element_pointers(context, builder, array_type, array, first, count):
        data = context.make_array(array_type)(context, builder, value=array).data
        return [builder.gep(data, [ir.Constant(ir.IntType(64), first + i)], inbounds=True) for i in range(count)]

    def _through_asm(builder, text, pointers_and_types, side_effect=True):
        """Load every pointer, run asm ``text`` with them as tied operands, store the results back."""
        values = [builder.load(pointer) for pointer, _ in pointers_and_types]
        llvm_types = [value.type for value in values]
        constraints = ",".join([f"={kind}" for _, kind in pointers_and_types]
                               + [str(i) for i in range(len(values))] + ["~{memory}"])
        asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType(llvm_types), llvm_types), text, constraints,
                           side_effect=side_effect)
        result = builder.call(asm, values)
        for i, (pointer, _) in enumerate(pointers_and_types):
            builder.store(builder.extract_value(result, i), pointer)

    @functools.lru_cache(maxsize=None)
    def mma_function(n: int, lead_bytes: int, stride_bytes: int):
        """Device function mma(acc, o, a0, a1, a2, a3, b_shared, b_at, descriptor_high, scratch): issue acc[o ..
        o + n/2) += A (a0..a3, this lane's fragment) @ B (the core matrices at shared-window byte address b_at,
        lead_bytes / stride_bytes apart: descriptor_high = descriptor_base(lead_bytes, stride_bytes)); o a constant
        after inlining. b_shared and scratch only type the call."""
        if n % 8 or not 8 <= n <= 256:
            raise ValueError(f"wgmma: n = {n} must be a multiple of 8 in 8 .. 256")
        accumulators = n // 2
        outputs = ",".join(f"${i}" for i in range(accumulators))
        a_at = 2 * accumulators  # (the tied inputs are numbered after the outputs too)
        descriptor_at = a_at + 4
        # scale-d is a predicate (true: D = A B + D); scale-a, scale-b 1 and trans-b 0 (B K-major) are immediates
        text = ("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, 1, 0;\n"
                f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{outputs}}}, "
                f"{{${a_at},${a_at + 1},${a_at + 2},${a_at + 3}}}, ${descriptor_at}, accumulate, 1, 1, 0;\n}}")

        @intrinsic
        def _issue(typingctx, acc, o, a0, a1, a2, a3, descriptor):
            def codegen(context, builder, sig, args):
                f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
                data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
                first = context.cast(builder, args[1], sig.args[1], types.int64)
                pointers = [builder.gep(data, [builder.add(first, ir.Constant(i64, i))], inbounds=True)
                            for i in range(accumulators)]
                values = [builder.load(pointer) for pointer in pointers]
                words = [context.cast(builder, value, ty, types.uint32) for value, ty in zip(args[2:6], sig.args[2:6])]
                descriptor_value = context.cast(builder, args[6], sig.args[6], types.uint64)
                constraints = ",".join(["=f"] * accumulators + [str(i) for i in range(accumulators)]
                                       + ["r"] * 4 + ["l", "~{memory}"])
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * accumulators),
                                                   [f32] * accumulators + [i32] * 4 + [i64]),
                                   text, constraints, side_effect=True)
                result = builder.call(asm, values + words + [descriptor_value])
                for i, pointer in enumerate(pointers):
                    builder.store(builder.extract_value(result, i), pointer)
                return context.get_dummy_value()
            return types.void(acc, o, a0, a1, a2, a3, descriptor), codegen

        @device_function(forceinline=True)
        def mma(acc, o, a0, a1, a2, a3, b_shared, b_at, descriptor_high, scratch):
            _issue(acc, o, a0, a1, a2, a3, uint64(descriptor_high) | uint64((b_at >> 4) & 0x3FFF))
        return mma

    @functools.lru_cache(maxsize=None)
    def fence_function(n_words: int, n_floats: int):
        """Device function fence(words, floats): wgmma.fence.sync.aligned with words[0 .. n_words) (uint32: the A
        fragments) and floats[0 .. n_floats) (float32: the accumulators) tied through it, so that their writes come
        before it and the wgmma that read them after."""
        @intrinsic
        def _fence(typingctx, words, floats):
            def codegen(context, builder, sig, args):
                pointers = ([(p, "r") for p in _element_pointers(context, builder, sig.args[0], args[0], 0, n_words)]
                            + [(p, "f") for p in _element_pointers(context, builder, sig.args[1], args[1], 0, n_floats)])
                _through_asm(builder, "wgmma.fence.sync.aligned;", pointers)
                return context.get_dummy_value()
            return types.void(words, floats), codegen

        @device_function(forceinline=True)
        def fence(words, floats):
            _fence(words, floats)
        return fence

    @functools.lru_cache(maxsize=None)
    def wait_function(pending: int, n_floats: int, commit: bool = True):
        """Device function wait(floats): wgmma.commit_group (unless ``commit`` is False: an empty group costs a
        dummy wgmma) then wgmma.wait_group ``pending``, floats[0 .. n_floats) (the accumulators) tied through it, so
        that no read of them moves above it."""
        text = ("wgmma.commit_group.sync.aligned;\n" if commit else "") + f"wgmma.wait_group.sync.aligned {pending};"

        @intrinsic
        def _wait(typingctx, floats):
            def codegen(context, builder, sig, args):
                pointers = [(p, "f") for p in _element_pointers(context, builder, sig.args[0], args[0], 0, n_floats)]
                _through_asm(builder, text, pointers)
                return context.get_dummy_value()
            return types.void(floats), codegen

        @device_function(forceinline=True)
        def wait(floats):
            _wait(floats)
        return wait

    @intrinsic
    def _fence_proxy_async(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "fence.proxy.async.shared::cta;",
                                      "~{memory}", side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen


if ON_SIMULATOR:
    @device_function()
    def fence_shared_for_wgmma():
        """fence.proxy.async.shared::cta (nothing under the simulator)."""
else:
    @device_function(forceinline=True)
    def fence_shared_for_wgmma():
        """fence.proxy.async.shared::cta: this thread's shared-memory writes (its cp.async copies, once waited for)
        visible to wgmma, which reads shared memory through the async proxy; call it before the block's barrier."""
        _fence_proxy_async()
