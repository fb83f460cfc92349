"""3xTF32 tensor-core primitives and a tiled fp32-accurate GEMM built on them.

3xTF32: each fp32 operand x = hi + lo with hi = tf32(x), lo = tf32(x - hi) (round to nearest, ties away:
cvt.rna.tf32.f32); a * b ~= a_lo b_hi + a_hi b_lo + a_hi b_hi, three mma.sync m16n8k8 tf32 with fp32
accumulation. The dropped a_lo b_lo term is ~2^-22 of the product, so errors stay at fp32-rounding level.

Fragment layouts of mma.m16n8k8 (PTX ISA "Matrix Fragments for mma.m16n8k8", .tf32), lane = g * 4 + tq:
    A 16x8 (row): a0 (g, tq), a1 (g+8, tq), a2 (g, tq+4), a3 (g+8, tq+4)
    B 8x8 (col):  b0 (k=tq, n=g), b1 (k=tq+4, n=g)
    C/D 16x8:     c0 (g, 2tq), c1 (g, 2tq+1), c2 (g+8, 2tq), c3 (g+8, 2tq+1)
mma_bf16 (m16n8k16, bf16 in pairs, low half the lower k) for the bf16 experts (moe/experts_tc.py):
    A 16x16 (row): a0 (g, 2tq..2tq+1), a1 (g+8, 2tq..), a2 (g, 2tq+8..2tq+9), a3 (g+8, 2tq+8..)
    B 16x8 (col):  b0 (k=2tq..2tq+1, n=g), b1 (k=2tq+8..2tq+9, n=g); C/D as above
The tensor core's fp32 accumulation truncates (see _truncate_to_float32), so the GEMM sums each group of
`sum_every` k-steps in fresh (zeroed) fragments and adds them into its fp32 accumulators with ordinary FADD
(round to nearest): the biased error is bounded by the group, not by K.
On a GPU the primitives are inline PTX (sm_80+). The simulator cannot run PTX, so there mma_tf32 gives each
lane the same fragment semantics through a per-warp shared ``scratch`` (SIM_SCRATCH_PER_WARP floats per warp,
every thread of the 1-D block must call it: it syncs the block); on a GPU ``scratch`` is ignored.

gemm_kernel(config, b_k_contiguous, fusion) builds the GEMM C = alpha * A @ B for one GemmConfig (see its
docstring); gemm_tf32x3 checks and launches it. Tiles reach shared memory by cp.async (16-byte copies when the
operands allow, 4-byte otherwise), `stages` chunks deep, one barrier per chunk; the k-steps of a chunk are
straight-line code so that a step's fragment loads can issue under the previous step's mma.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, types, uint32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import device_address
from kdspec.numba_kernels.intrinsics import at, at_put
from kdspec.numba_kernels.launch import launcher_for, type_key
from kdspec.numba_kernels.runtime import INLINE_DEVICE, ON_SIMULATOR, SHARED_LIMIT, device_function, static_for

WARP = 32
SIM_SCRATCH_PER_WARP = 16 * 8 + 8 * 8  # the A tile and the B tile of one mma
BF16_SCRATCH_PER_WARP = 16 * 16 + 16 * 8  # the same for mma_bf16 (m16n8k16)
TF32_MASK = 0xFFFFE000  # the 19 bits a tf32 keeps (sign, 8 exponent, 10 mantissa)

if ON_SIMULATOR:
    def _as_float(bits):
        return np.uint32(bits).view(np.float32)

    def _truncate_to_float32(x):
        """float64 x -> float32 rounded toward zero: the tensor core's accumulation model (its fp32 adder
        aligns and truncates instead of rounding to nearest, so every mma adds a small error biased toward
        zero; measured on the H200 as errors growing with the number of k-steps summed in one register)."""
        rounded = np.float32(x)
        if np.isfinite(rounded) and abs(float(rounded)) > abs(x):
            rounded = np.nextafter(rounded, np.float32(0.0))
        return rounded

    @device_function()
    def tf32_round(x):
        """cvt.rna.tf32.f32: x (float32) rounded to tf32, nearest with ties away from zero; uint32 bits (low
        13 zero). Model: add half a tf32 ulp to the magnitude bits, drop 13 bits; inf / NaN pass through."""
        bits = int(np.float32(x).view(np.uint32))
        if (bits & 0x7F800000) == 0x7F800000:
            return np.uint32(bits)
        return np.uint32((bits + 0x1000) & TF32_MASK)

    @device_function()
    def tf32_as_float(bits):
        return _as_float(bits)

    @device_function()
    def float_bits(x):
        return np.float32(x).view(np.uint32)

    @device_function()
    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        """d = A @ B + C for one warp's m16n8k8 fragments (tf32 bits in, float32 out), via shared scratch."""
        tid = cuda.threadIdx.x
        lane = tid % WARP
        g, tq = lane >> 2, lane & 3
        base = (tid // WARP) * SIM_SCRATCH_PER_WARP
        b_base = base + 16 * 8
        for bits, row, col in ((a0, g, tq), (a1, g + 8, tq), (a2, g, tq + 4), (a3, g + 8, tq + 4)):
            scratch[base + row * 8 + col] = _as_float(int(bits) & TF32_MASK)  # the unit reads 19 bits
        scratch[b_base + tq * 8 + g] = _as_float(int(b0) & TF32_MASK)
        scratch[b_base + (tq + 4) * 8 + g] = _as_float(int(b1) & TF32_MASK)
        cuda.syncthreads()  # the warp's whole A and B tiles stored
        a = scratch[base:base + 128].reshape(16, 8).astype(np.float64)
        b = scratch[b_base:b_base + 64].reshape(8, 8).astype(np.float64)
        d = [float(c) for c in (c0, c1, c2, c3)]
        for n, (row, col) in enumerate(((g, 2 * tq), (g, 2 * tq + 1), (g + 8, 2 * tq), (g + 8, 2 * tq + 1))):
            d[n] = _truncate_to_float32(d[n] + float(a[row] @ b[:, col]))  # exact products, truncated sum
        cuda.syncthreads()  # everyone read the tiles before the next mma overwrites them
        return d[0], d[1], d[2], d[3]

    def _bf16_pair(bits):
        """The two bf16 values packed in uint32 bits (low half first), as float32."""
        return (_as_float((int(bits) & 0xFFFF) << 16), _as_float(int(bits) & 0xFFFF0000))

    @device_function()
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        """d = A @ B + C for one warp's m16n8k16 bf16 fragments (bf16 pairs in uint32, float32 out), via
        shared scratch (BF16_SCRATCH_PER_WARP floats per warp; every thread of the block calls it)."""
        tid = cuda.threadIdx.x
        lane = tid % WARP
        g, tq = lane >> 2, lane & 3
        base = (tid // WARP) * BF16_SCRATCH_PER_WARP
        b_base = base + 16 * 16
        for bits, row, col in ((a0, g, 2 * tq), (a1, g + 8, 2 * tq), (a2, g, 2 * tq + 8), (a3, g + 8, 2 * tq + 8)):
            scratch[base + row * 16 + col], scratch[base + row * 16 + col + 1] = _bf16_pair(bits)
        for bits, k in ((b0, 2 * tq), (b1, 2 * tq + 8)):
            scratch[b_base + k * 8 + g], scratch[b_base + (k + 1) * 8 + g] = _bf16_pair(bits)
        cuda.syncthreads()
        a = scratch[base:base + 256].reshape(16, 16).astype(np.float64)
        b = scratch[b_base:b_base + 128].reshape(16, 8).astype(np.float64)
        d = [float(c) for c in (c0, c1, c2, c3)]
        for n, (row, col) in enumerate(((g, 2 * tq), (g, 2 * tq + 1), (g + 8, 2 * tq), (g + 8, 2 * tq + 1))):
            d[n] = _truncate_to_float32(d[n] + float(a[row] @ b[:, col]))
        cuda.syncthreads()
        return d[0], d[1], d[2], d[3]
else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def tf32_round(typingctx, x):
        """cvt.rna.tf32.f32: x rounded to tf32 (nearest, ties away), as uint32 bits."""
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.FloatType()]), "cvt.rna.tf32.f32 $0, $1;", "=r,f")
            return builder.call(asm, [args[0]])
        return types.uint32(types.float32), codegen

    @intrinsic
    def tf32_as_float(typingctx, bits):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.uint32), codegen

    @intrinsic
    def float_bits(typingctx, x):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(types.float32), codegen

    def _mma_intrinsic(shape_and_types: str):
        """An mma.sync.aligned.<shape_and_types> of 4 A, 2 B (uint32 each) and 4 fp32 C registers."""
        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            signature = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

            def codegen(context, builder, sig, args):
                f32, i32 = ir.FloatType(), ir.IntType(32)
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4),
                                   f"mma.sync.aligned.{shape_and_types} "
                                   "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                                   "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                d = builder.call(asm, list(args))
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, n) for n in range(4)])

            return signature, codegen
        return mma

    _mma = _mma_intrinsic("m16n8k8.row.col.f32.tf32.tf32.f32")
    _mma_bf16 = _mma_intrinsic("m16n8k16.row.col.f32.bf16.bf16.f32")

    @device_function(forceinline=True)
    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        """d = A @ B + C for one warp's m16n8k8 fragments (tf32 bits in, float32 out); scratch unused."""
        return _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    @device_function(forceinline=True)
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        """d = A @ B + C for one warp's m16n8k16 bf16 fragments (bf16 pairs in uint32, low half the lower k;
        float32 out); scratch unused."""
        return _mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

_DEVICE = dict(device=True) if ON_SIMULATOR else dict(device=True, forceinline=True)


@device_function(**INLINE_DEVICE)
def tf32_bits(x):
    """Finite float32 x rounded to tf32, nearest with ties away (cvt.rna.tf32.f32's result), as uint32 bits (low 13
    zero): add half a tf32 ulp, mask (2 instructions, where sm_90 emulates cvt.rna.tf32.f32 in four)."""
    return (float_bits(x) + uint32(0x1000)) & uint32(TF32_MASK)


@cuda.jit(**_DEVICE)
def tf32_split(x):
    """(hi, lo) tf32 operand bits of finite float32 x: hi = tf32_rna(x), lo = tf32_rna(x - hi), both exact
    tf32 values (low 13 bits zero: the PTX ISA leaves unspecified how many mantissa bits an mma reads, so
    nothing is left for the hardware to drop); hi + lo = x to 2^-22 relative.

    Integer rounding (add half a tf32 ulp, mask): 5 instructions for both halves, where sm_90 emulates each
    cvt.rna.tf32.f32 in four. Equal to cvt.rna for finite x below FLT_MAX's last tf32 ulp; inf / NaN in
    give NaN / NaN out (a NaN payload may change), which only NaN rows of the caller ever feed it."""
    hi = tf32_bits(x)
    return hi, tf32_bits(x - tf32_as_float(hi))


if ON_SIMULATOR:
    @device_function()
    def quad_max_sum(value, is_max, scratch):
        """Max (is_max) or sum of value over the 4 lanes g*4 .. g*4+3 of a quad, to each of them, via the
        warp's shared scratch (every thread of the block calls it: it syncs the block)."""
        tid = cuda.threadIdx.x
        base = (tid // WARP) * SIM_SCRATCH_PER_WARP + (tid % WARP) // 4 * 4
        scratch[(tid // WARP) * SIM_SCRATCH_PER_WARP + tid % WARP] = value
        cuda.syncthreads()
        quad = [scratch[base + n] for n in range(4)]
        cuda.syncthreads()
        return float32(max(quad)) if is_max else float32((quad[0] + quad[1]) + (quad[2] + quad[3]))
else:
    @device_function(forceinline=True)
    def quad_max_sum(value, is_max, scratch):
        """Max (is_max) or sum of value over the 4 lanes g*4 .. g*4+3 of a quad, to each of them."""
        for offset in (1, 2):
            other = cuda.shfl_xor_sync(0xFFFFFFFF, value, offset)
            value = max(value, other) if is_max else value + other
        return value


# ------------------------------------------------------------------------------------------------ cp.async
# Tiles go from global to shared memory with cp.async (no register staging; STAGES chunks in flight).


def address_units(itemsize: int) -> int:
    """What one element of itemsize bytes adds to a shared_address or global_address address: its bytes on the GPU,
    1 under the simulator (whose addresses are indices)."""
    return 1 if ON_SIMULATOR else itemsize


if ON_SIMULATOR:
    @device_function()
    def copy16(dst, dst_index, src, src_index, src_bytes):
        size = dst.dtype.itemsize  # indices count elements of the arrays' own type, as on the GPU
        for e in range(16 // size):
            at_put(dst, dst_index + e, at(src, src_index + e) if size * e < src_bytes else dst.dtype.type(0))

    @device_function()
    def copy4(dst, dst_index, src, src_index, src_bytes):
        at_put(dst, dst_index, at(src, src_index) if src_bytes > 0 else float32(0.0))

    @device_function()
    def copy_commit():
        """cp.async.commit_group (the simulator copies at once)."""

    @device_function()
    def shared_address(array, index):
        """copy16_at's address of array[index]: under the simulator the index itself."""
        return index

    @device_function()
    def global_address(array, index):
        """copy16_at's address of array[index]: under the simulator the index itself."""
        return index

    @device_function()
    def copy16_at(dst, dst_address, src, src_address):
        """copy16 of whole 16 bytes from src[src_address] to dst[dst_address] (shared_address's and
        global_address's indices, plus offsets in elements)."""
        copy16(dst, dst_address, src, src_address, 16)

    def copy_wait(pending: int):
        @device_function()
        def wait():
            """cp.async.wait_group pending (the simulator copies at once)."""
        return wait
else:
    def _cp_async(cp_bytes: int, cache_op: str):
        """cp.async.{cache_op}.shared.global of cp_bytes from src[src_index] to dst[dst_index] (flat indices of
        a shared and a global float32 array); src_bytes < cp_bytes are read, the rest zero-filled."""
        @intrinsic
        def copy(typingctx, dst, dst_index, src, src_index, src_bytes):
            def codegen(context, builder, sig, args):
                i64, i32 = ir.IntType(64), ir.IntType(32)
                pointers = []
                for array_type, array, index_type, index in ((sig.args[0], args[0], sig.args[1], args[1]),
                                                             (sig.args[2], args[2], sig.args[3], args[3])):
                    data = context.make_array(array_type)(context, builder, value=array).data
                    offset = context.cast(builder, index, index_type, types.intp)
                    pointers.append(builder.gep(data, [offset], inbounds=True))
                # the destination as a 32-bit shared address cast in the IR (not cvta in the asm), so that the
                # compiler folds it into the shared array's own address instead of converting a generic one per copy
                dst = builder.addrspacecast(pointers[0], pointers[0].type.pointee.as_pointer(3))
                pointers = [builder.ptrtoint(dst, i32), builder.ptrtoint(pointers[1], i64)]
                nbytes = builder.trunc(context.cast(builder, args[4], sig.args[4], types.int64), i32)
                asm = ir.InlineAsm(
                    ir.FunctionType(ir.VoidType(), [i32, i64, i32]),
                    f"cp.async.{cache_op}.shared.global [$0], [$1], {cp_bytes}, $2;",
                    "r,l,r,~{memory}", side_effect=True)
                builder.call(asm, pointers + [nbytes])
                return context.get_dummy_value()
            return types.void(dst, dst_index, src, src_index, src_bytes), codegen
        return copy

    copy16, copy4 = _cp_async(16, "cg"), _cp_async(4, "ca")

    def _address_of(shared: bool):
        @intrinsic
        def address(typingctx, array, index):
            def codegen(context, builder, sig, args):
                data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
                pointer = builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.intp)], inbounds=True)
                if shared:  # the 32-bit shared-window address, as copy16 casts its destination
                    pointer = builder.addrspacecast(pointer, pointer.type.pointee.as_pointer(3))
                    return builder.zext(builder.ptrtoint(pointer, ir.IntType(32)), ir.IntType(64))
                return builder.ptrtoint(pointer, ir.IntType(64))
            return types.int64(array, index), codegen
        return address

    # The addresses of array[index] as int64 (a shared array's 32-bit shared-window address, a global array's
    # generic one): copy16_at's operands. A kernel that computes them once and adds offsets in registers spares each
    # copy the array's base: rebuilt per copy under register pressure, a shared base costs an S2R and four more
    # instructions, a global one a constant load and a 64-bit multiply-add.
    shared_address, global_address = _address_of(True), _address_of(False)

    @intrinsic
    def copy16_at(typingctx, dst, dst_address, src, src_address):
        """cp.async.cg of 16 bytes from src_address to dst_address (global_address's and shared_address's
        addresses, plus byte offsets); the arrays only type the call."""
        def codegen(context, builder, sig, args):
            i64, i32 = ir.IntType(64), ir.IntType(32)
            dst_at = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), i32)
            src_at = context.cast(builder, args[3], sig.args[3], types.int64)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32, i64]), "cp.async.cg.shared.global [$0], [$1], 16;",
                               "r,l,~{memory}", side_effect=True)
            builder.call(asm, [dst_at, src_at])
            return context.get_dummy_value()
        return types.void(dst, dst_address, src, src_address), codegen

    @intrinsic
    def _commit(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "~{memory}",
                                      side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen

    @device_function(forceinline=True)
    def copy_commit():
        """cp.async.commit_group: the copies this thread issued since the last commit form one group."""
        _commit()

    @functools.lru_cache(maxsize=None)
    def copy_wait(pending: int):
        """Device function: wait until at most `pending` of this thread's committed groups are in flight."""
        @intrinsic
        def _wait(typingctx):
            def codegen(context, builder, sig, args):
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {pending};",
                                          "~{memory}", side_effect=True), [])
                return context.get_dummy_value()
            return types.void(), codegen

        @device_function(forceinline=True)
        def wait():
            _wait()
        return wait


# ------------------------------------------------------------------------------------------------ GEMM
FUSIONS = ("none", "scores", "scaled")
MAX_SHARED_BYTES = 227 * 1024  # sm_90's opt-in limit per block (sm_80 allows 163 KB: more fails at the opt-in)


class GemmConfig(NamedTuple):
    """Block tile block_m x block_n, K staged block_k at a time in `stages` shared buffers (cp.async keeps
    stages - 1 chunks in flight); warps_m x warps_n warps, each owning a (block_m / warps_m) x
    (block_n / warps_n) tile of m16n8 fragments (accumulators in registers).
    sum_every: k-steps (of 8) the mma sums in fresh fragments before one FADD into the accumulators (at
    most block_k / 8 of them: one group per staged chunk); 0 accumulates over all of K inside the mma (half
    the accumulator registers, error growing with K)."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    warps_m: int = 2
    warps_n: int = 4
    blocks_per_sm: int = 1
    sum_every: int = 4
    stages: int = 2

    @property
    def threads(self) -> int:
        return WARP * self.warps_m * self.warps_n

    @property
    def group_steps(self) -> int:
        """k-steps summed in fresh fragments per FADD into the accumulators (0: no fresh fragments)."""
        return min(self.sum_every, self.block_k // 8)

    @property
    def fragments(self) -> tuple[int, int]:
        """(m16 fragments, n8 fragments) per warp."""
        return self.block_m // self.warps_m // 16, self.block_n // self.warps_n // 8

    def shared_floats(self, b_k_contiguous: bool) -> tuple[int, int]:
        """(A tile, B tile) of one stage in floats: K-contiguous tiles padded by 4 (rows 4 banks apart: the
        fragment loads of a warp hit 32 distinct banks; rows stay 16-byte aligned for cp.async), the
        N-contiguous B tile by 8 (with block_n % 32 == 0, k rows 8 banks apart: conflict-free too)."""
        b = self.block_n * (self.block_k + 4) if b_k_contiguous else self.block_k * (self.block_n + 8)
        return self.block_m * (self.block_k + 4), b

    def shared_bytes(self, b_k_contiguous: bool) -> int:
        """Dynamic shared memory of a block: `stages` (A, B) tile pairs."""
        return 4 * self.stages * sum(self.shared_floats(b_k_contiguous))

    def check(self, b_k_contiguous: bool = True) -> None:
        """ValueError naming the first broken rule."""
        t, (mi, ni) = self.threads, self.fragments
        rules = [
            (mi >= 1 and ni >= 1 and self.block_m == 16 * mi * self.warps_m and self.block_n == 8 * ni * self.warps_n,
             "block_m = 16 * warps_m * k, block_n = 8 * warps_n * k"),
            (self.block_k % 8 == 0 and t % (self.block_k // 4) == 0, "block_k % 8, threads % (block_k / 4)"),
            (b_k_contiguous or t % (self.block_n // 4) == 0, "N-contiguous B: threads % (block_n / 4) == 0"),
            (self.sum_every >= 0 and (self.block_k // 8) % max(1, self.group_steps) == 0,
             "sum_every >= 0, min(sum_every, block_k / 8) dividing block_k / 8"),
            (self.stages >= 2, "stages >= 2"),
            (self.shared_bytes(b_k_contiguous) + 4 * SIM_SCRATCH_PER_WARP * self.warps_m * self.warps_n
             <= MAX_SHARED_BYTES, f"shared memory <= {MAX_SHARED_BYTES // 1024} KB"),
        ]
        for ok, rule in rules:
            if not ok:
                raise ValueError(f"bad GemmConfig {self}: needs {rule}")


if ON_SIMULATOR:  # every simulated thread is a Python thread: two warps, one fragment each
    DEFAULT_GEMM = GemmConfig(block_m=16, block_n=16, block_k=8, warps_m=1, warps_n=2, sum_every=1)
else:
    DEFAULT_GEMM = GemmConfig()


def _flat_f32():
    return types.Array(types.float32, 1, "C")


@functools.lru_cache(maxsize=None)
def gemm_kernel(config: GemmConfig, b_k_contiguous: bool, fusion: str = "none", key_visible=None,
                aligned: bool = True):
    """The 3xTF32 GEMM kernel for one config; B K-contiguous ("NT": b[n * ldb + k]) or N-contiguous
    ("NN": b[k * ldb + n]); aligned: 16-byte copies (a, b 16-byte aligned, lda and ldb multiples of 4), else
    4-byte ones. fusion (softmax around attention's two GEMMs, see gemm_tf32x3):
      "none"   plain C = alpha * A @ B;
      "scores" entries (i, j) that key_visible(i // heads, j, prefix_len, visibility) rejects (or j >= n) are
               masked; with w = alpha * (A @ B)[i, j] (-inf where masked) and M the max of w over the
               warp's block_n / warps_n columns of row i, C = exp(w - M) (0 where masked; M = 0 when all are),
               and the warp writes (M, sum of C over those columns) to partials[i, blockIdx.y * warps_n +
               warp column, 0 / 1];
      "scaled" each staged chunk's sum is scaled per row as it is added: C[i, j] = alpha * sum over chunks q
               of scale[i * scale_parts + (k0 of q) // scale_width] * (sum over q's k of A[i, kk] B(kk, j))
               (needs sum_every >= block_k / 8 and block_k dividing scale_width)."""
    config.check(b_k_contiguous)
    if fusion not in FUSIONS or (fusion == "scores") != (key_visible is not None):
        raise ValueError(f"fusion must be one of {FUSIONS} (key_visible with 'scores' only), got {fusion!r}")
    SCORES, SCALED = fusion == "scores", fusion == "scaled"
    if SCALED and config.group_steps != config.block_k // 8:
        raise ValueError(f"'scaled' needs sum_every >= block_k / 8, got {config}")
    BM, BN, BK, T, STAGES = config.block_m, config.block_n, config.block_k, config.threads, config.stages
    MI, NI = config.fragments
    WN = config.warps_n
    WARP_M, WARP_N = BM // config.warps_m, BN // WN
    A_STRIDE = BK + 4
    B_STRIDE = BK + 4 if b_k_contiguous else BN + 8
    A_SIZE, B_SIZE = config.shared_floats(b_k_contiguous)
    STAGE = A_SIZE + B_SIZE
    ACC, B_FRAGMENTS = MI * NI * 4, 2 * NI  # register array sizes (literal constants)
    STEPS, SUM_EVERY = BK // 8, config.group_steps
    FRESH = ACC if SUM_EVERY else 1  # the fragments of one group of SUM_EVERY k-steps
    SCRATCH = SIM_SCRATCH_PER_WARP * config.warps_m * WN if ON_SIMULATOR else 1
    CHUNK_SCALES = 2 * MI if SCALED else 1  # this thread's rows' scale of the current chunk
    options = {} if ON_SIMULATOR else dict(launch_bounds=(T, config.blocks_per_sm))
    copy_wait_stages = copy_wait(STAGES - 2)

    @cuda.jit(**_DEVICE)
    def copy_chunk(dst, dst_index, src, src_index, floats):
        """floats (0..4) of src[src_index..] to dst[dst_index..dst_index + 4], zeros after them."""
        if aligned:
            copy16(dst, dst_index, src, src_index, 4 * floats)
        else:
            for e in range(4):
                copy4(dst, dst_index + e, src, src_index + e if e < floats else 0, 4 if e < floats else 0)

    def k_contiguous_copier(TILE_ROWS):
        """Device function: the [TILE_ROWS, BK] tile (rows r0.., k0..) of a K-contiguous operand X to shared,
        X(i, kk) = a[i, kk] for kk < k_split, else a2[i, kk - k_split] (one operand: a2 = a, k_split = lda;
        16-byte copies never straddle k_split: gemm_tf32x3 takes them only when k_split % 4 == 0)."""
        PER_ROW = BK // 4
        ROW_STEP = T // PER_ROW
        COPIES = -(-TILE_ROWS // ROW_STEP)

        @cuda.jit(**_DEVICE)
        def copy(tile, tile_at, a, a2, rows, lda, lda2, k_split, r0, k0, k_end):
            tid = cuda.threadIdx.x
            row, col = tid // PER_ROW, (tid % PER_ROW) * 4
            kk = k0 + col
            floats = min(max(k_end - kk, 0), 4)
            for i in range(COPIES):
                r = row + i * ROW_STEP
                if COPIES * ROW_STEP == TILE_ROWS or r < TILE_ROWS:
                    valid = floats if r0 + r < rows else 0
                    at_tile = tile_at + r * (BK + 4) + col
                    if aligned:
                        if kk < k_split:
                            copy16(tile, at_tile, a, (r0 + r) * lda + kk if valid > 0 else 0, 4 * valid)
                        else:
                            copy16(tile, at_tile, a2, (r0 + r) * lda2 + kk - k_split if valid > 0 else 0,
                                   4 * valid)
                    else:
                        for e in range(4):
                            if kk + e < k_split:
                                copy4(tile, at_tile + e, a, (r0 + r) * lda + kk + e if e < valid else 0,
                                      4 if e < valid else 0)
                            else:
                                copy4(tile, at_tile + e, a2, (r0 + r) * lda2 + kk + e - k_split if e < valid else 0,
                                      4 if e < valid else 0)
        return copy

    copy_a = k_contiguous_copier(BM)
    copy_b_nt = k_contiguous_copier(BN)
    PER_K_ROW = BN // 4
    K_ROW_STEP = T // PER_K_ROW if not b_k_contiguous else 1
    NN_COPIES = -(-BK // K_ROW_STEP)

    @cuda.jit(**_DEVICE)
    def copy_b_nn(tile, tile_at, src, n, ld, n0, k0, k_end):
        """The [BK, BN] tile of an N-contiguous B (k rows k0.., columns n0..) to shared."""
        tid = cuda.threadIdx.x
        k_row, col = tid // PER_K_ROW, (tid % PER_K_ROW) * 4
        floats = min(max(n - (n0 + col), 0), 4)
        for i in range(NN_COPIES):
            kk = k_row + i * K_ROW_STEP
            if NN_COPIES * K_ROW_STEP == BK or kk < BK:
                valid = floats if k0 + kk < k_end else 0
                copy_chunk(tile, tile_at + kk * B_STRIDE + col, src, (k0 + kk) * ld + n0 + col if valid > 0 else 0,
                           valid)

    @cuda.jit(**_DEVICE)
    def copy_stage(a, a2, b, m, n, lda, lda2, k_split, ldb, m0, n0, k0, k_end, tiles, stage_at):
        """Issue the cp.async copies of chunk k0's A and B tiles into the stage at tiles[stage_at]."""
        copy_a(tiles, stage_at, a, a2, m, lda, lda2, k_split, m0, k0, k_end)
        if b_k_contiguous:
            copy_b_nt(tiles, stage_at + A_SIZE, b, b, n, ldb, ldb, ldb, n0, k0, k_end)
        else:
            copy_b_nn(tiles, stage_at + A_SIZE, b, n, ldb, n0, k0, k_end)

    @cuda.jit(**_DEVICE)
    def add_scaled_row(r, args):
        """acc += chunk_scale[r] * fresh over fragment row r (m16 fragment r // 2, half r % 2)."""
        acc, fresh, chunk_scale = args
        i, half = r // 2, r % 2
        row_scale = chunk_scale[r]
        for j in range(NI):
            for u in range(2):
                o = (i * NI + j) * 4 + 2 * half + u
                acc[o] += row_scale * fresh[o]

    add_scaled_rows = static_for(2 * MI, add_scaled_row) if SCALED else None

    @cuda.jit(**_DEVICE)
    def k_step(step, args):
        """One k-step (8 of the chunk's BK) of the warp tile: 3xTF32 mma of every (m16, n8) fragment pair."""
        tiles, a_at, fresh, acc, b_hi, b_lo, wm0, wn0, g, tq, scratch, chunk_scale = args
        b_at = a_at + A_SIZE
        kc = step * 8 + tq
        if SUM_EVERY and step % SUM_EVERY == 0:
            for e in range(ACC):
                fresh[e] = float32(0.0)
        for j in range(NI):
            if b_k_contiguous:
                base = b_at + (wn0 + j * 8 + g) * B_STRIDE + kc
                v0, v1 = at(tiles, base), at(tiles, base + 4)
            else:
                base = b_at + kc * B_STRIDE + wn0 + j * 8 + g
                v0, v1 = at(tiles, base), at(tiles, base + 4 * B_STRIDE)
            b_hi[2 * j], b_lo[2 * j] = tf32_split(v0)
            b_hi[2 * j + 1], b_lo[2 * j + 1] = tf32_split(v1)
        for i in range(MI):
            base = a_at + (wm0 + i * 16 + g) * A_STRIDE + kc
            h0, l0 = tf32_split(at(tiles, base))
            h1, l1 = tf32_split(at(tiles, base + 8 * A_STRIDE))
            h2, l2 = tf32_split(at(tiles, base + 4))
            h3, l3 = tf32_split(at(tiles, base + 8 * A_STRIDE + 4))
            for j in range(NI):
                o = (i * NI + j) * 4
                if SUM_EVERY:
                    d0, d1, d2, d3 = fresh[o], fresh[o + 1], fresh[o + 2], fresh[o + 3]
                else:
                    d0, d1, d2, d3 = acc[o], acc[o + 1], acc[o + 2], acc[o + 3]
                d0, d1, d2, d3 = mma_tf32(l0, l1, l2, l3, b_hi[2 * j], b_hi[2 * j + 1], d0, d1, d2, d3, scratch)
                d0, d1, d2, d3 = mma_tf32(h0, h1, h2, h3, b_lo[2 * j], b_lo[2 * j + 1], d0, d1, d2, d3, scratch)
                d0, d1, d2, d3 = mma_tf32(h0, h1, h2, h3, b_hi[2 * j], b_hi[2 * j + 1], d0, d1, d2, d3, scratch)
                if SUM_EVERY:
                    fresh[o], fresh[o + 1], fresh[o + 2], fresh[o + 3] = d0, d1, d2, d3
                else:
                    acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = d0, d1, d2, d3
        if SUM_EVERY and (step + 1) % SUM_EVERY == 0:  # round-to-nearest adds, once per group
            if SCALED:
                add_scaled_rows((acc, fresh, chunk_scale))
            else:
                for e in range(ACC):
                    acc[e] += fresh[e]

    # straight-line k-steps: the next step's shared loads can rise above this step's mma
    chunk_steps = static_for(STEPS, k_step)

    @cuda.jit(**_DEVICE)
    def score_row(r, args):
        """"scores" epilogue of this thread's fragment row r (m16 fragment r // 2, half r % 2): scale, mask,
        exp against the warp's row max, and the warp's partial (max, sum of exp) of that row."""
        acc, alpha, m, n, row0, col0, g, tq, heads, prefix_len, visibility, partials, parts, part, scratch = args
        i, half = r // 2, r % 2
        row = row0 + i * 16 + g + 8 * half
        token = row // heads
        row_max = float32(-math.inf)
        for j in range(NI):
            for u in range(2):
                o = (i * NI + j) * 4 + 2 * half + u
                column = col0 + j * 8 + 2 * tq + u
                value = alpha * acc[o]
                if row >= m or column >= n or not key_visible(token, column, prefix_len, visibility):
                    value = float32(-math.inf)
                acc[o] = value
                row_max = max(row_max, value)
        row_max = quad_max_sum(row_max, True, scratch)
        shift = row_max if row_max > float32(-math.inf) else float32(0.0)  # all masked: exps 0, sum 0
        row_sum = float32(0.0)
        for j in range(NI):
            for u in range(2):
                o = (i * NI + j) * 4 + 2 * half + u
                weight = math.exp(acc[o] - shift)
                acc[o] = weight
                row_sum += weight
        row_sum = quad_max_sum(row_sum, False, scratch)
        if tq == 0 and row < m:
            at_put(partials, (row * parts + part) * 2, shift)
            at_put(partials, (row * parts + part) * 2 + 1, row_sum)

    # a register array stays in registers only with constant indices: one straight-line call per row
    score_rows = static_for(2 * MI, score_row) if SCORES else None

    def gemm_tf32x3(a, a2, b, c, m, n, k, lda, lda2, k_split, ldb, ldc, alpha, k_per_split, scale, scale_parts,
                    scale_width, partials, visibility, heads, prefix_len):
        """c[z * m * ldc + i * ldc + j] = alpha * sum over kk of split z of A(i, kk) * B(kk, j), for i < m,
        j < n (every such element written), A(i, kk) = a[i * lda + kk] for kk < k_split, else
        a2[i * lda2 + kk - k_split]; split z = blockIdx.z covers kk in
        [z * k_per_split, min(k, (z + 1) * k_per_split)). a, b, c flat float32. Grid (ceil(m / BM),
        ceil(n / BN), splits), T threads, shared_bytes of dynamic shared memory. The last seven arguments:
        see gemm_kernel's fusion (unused ones may be any float32 [1] / int / float32 [1] / uint32 [1, 1])."""
        tiles = cuda.shared.array(0, float32)
        scratch = cuda.shared.array(SCRATCH, float32)
        acc = cuda.local.array(ACC, float32)
        fresh = cuda.local.array(FRESH, float32)
        b_hi = cuda.local.array(B_FRAGMENTS, uint32)
        b_lo = cuda.local.array(B_FRAGMENTS, uint32)
        chunk_scale = cuda.local.array(CHUNK_SCALES, float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        g, tq = lane >> 2, lane & 3
        warp = tid // WARP
        wm0, wn0 = (warp // WN) * WARP_M, (warp % WN) * WARP_N
        m0, n0 = cuda.blockIdx.x * BM, cuda.blockIdx.y * BN
        k_begin = cuda.blockIdx.z * k_per_split
        k_end = min(k, k_begin + k_per_split)
        for e in range(ACC):
            acc[e] = float32(0.0)
        chunks = (max(k_end - k_begin, 0) + BK - 1) // BK
        for s in range(STAGES - 1):  # prologue: the first STAGES - 1 chunks in flight
            if s < chunks:
                copy_stage(a, a2, b, m, n, lda, lda2, k_split, ldb, m0, n0, k_begin + s * BK, k_end, tiles,
                           s * STAGE)
            copy_commit()  # (an empty group past the end keeps the count uniform)
        for chunk in range(chunks):
            copy_wait_stages()  # this thread's copies of this chunk landed
            cuda.syncthreads()  # everyone's landed; everyone done reading the stage refilled next
            ahead = chunk + STAGES - 1
            if ahead < chunks:
                copy_stage(a, a2, b, m, n, lda, lda2, k_split, ldb, m0, n0, k_begin + ahead * BK, k_end, tiles,
                           (ahead % STAGES) * STAGE)
            copy_commit()
            if SCALED:  # loaded now, used after the chunk's k-steps
                part = (k_begin + chunk * BK) // scale_width
                for r in range(2 * MI):
                    row = m0 + wm0 + (r // 2) * 16 + g + 8 * (r % 2)
                    chunk_scale[r] = at(scale, row * scale_parts + part) if row < m else float32(0.0)
            chunk_steps((tiles, (chunk % STAGES) * STAGE, fresh, acc, b_hi, b_lo, wm0, wn0, g, tq, scratch,
                         chunk_scale))
        out0 = cuda.blockIdx.z * m * ldc
        if SCORES:  # scale, mask, exp and this warp's softmax partial of each of its rows
            score_rows((acc, alpha, m, n, m0 + wm0, n0 + wn0, g, tq, heads, prefix_len, visibility, partials,
                        cuda.gridDim.y * WN, cuda.blockIdx.y * WN + warp % WN, scratch))
            alpha = float32(1.0)  # already applied
        for i in range(MI):
            for j in range(NI):
                o = (i * NI + j) * 4
                column = n0 + wn0 + j * 8 + 2 * tq
                for half in range(2):
                    row = m0 + wm0 + i * 16 + g + 8 * half
                    if row < m:
                        if column < n:
                            at_put(c, out0 + row * ldc + column, alpha * acc[o + 2 * half])
                        if column + 1 < n:
                            at_put(c, out0 + row * ldc + column + 1, alpha * acc[o + 2 * half + 1])

    if ON_SIMULATOR:
        return cuda.jit(gemm_tf32x3)
    f32, i64 = _flat_f32(), types.int64
    signature = types.void(f32, f32, f32, f32, i64, i64, i64, i64, i64, i64, i64, i64, types.float32, i64, f32, i64,
                           i64, f32, types.Array(types.uint32, 2, "C"), i64, i64)
    # compiled now for the one signature the launcher passes, so that the opt-in below covers every launch
    kernel = kernel_cache.jit(fastmath=False, **options)(gemm_tf32x3)
    kernel.compile(signature)
    kernel._specialized = True   # as cuda.jit(signature) leaves it
    kernel.disable_compile()
    allow_dynamic_shared(kernel, config.shared_bytes(b_k_contiguous))
    return kernel


def allow_dynamic_shared(kernel, nbytes: int) -> None:
    """Opt a compiled kernel in to nbytes of dynamic shared memory (a launch whose static and dynamic shared memory
    together pass 48 KB fails without it). numba-cuda has no public call for this attribute: its kernel's driver
    function is set directly."""
    from numba.cuda.cudadrv.driver import binding, driver
    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    for overload in kernel.overloads.values():
        function = overload._codelibrary.get_cufunc()
        driver.cuKernelSetAttribute(attribute, nbytes, function.handle, function.device.id)


_OPTED_IN: set = set()  # (kernel id, bytes, argument type keys) of the overloads opt_in_shared has checked


def opt_in_shared(kernel, args, nbytes: int) -> None:
    """Let the overload of a lazily compiled ``kernel`` for these launch arguments take nbytes of dynamic shared
    memory: compiled here first, it opts in where its static shared memory and nbytes pass 48 KB (49152 dynamic
    bytes beside 1040 static ones fail to launch without it). Nothing to do without dynamic shared memory or on
    the simulator; a second call for the same argument types costs a dictionary lookup."""
    if nbytes <= 0 or ON_SIMULATOR:
        return
    key = (id(kernel), nbytes) + tuple(type_key(arg) for arg in args)
    if key not in _OPTED_IN:
        compiled = kernel.compile(tuple(kernel.typeof_pyval(arg) for arg in args))
        if compiled.shared_mem_per_block + nbytes > SHARED_LIMIT:
            allow_dynamic_shared(kernel, nbytes)
        _OPTED_IN.add(key)


def gemm_grid(config: GemmConfig, m: int, n: int, splits: int = 1) -> tuple[int, int, int]:
    return (-(-m // config.block_m), -(-n // config.block_n), splits)


_UNUSED = {}


def _unused_arrays():
    """float32 [1], float32 [1], uint32 [1, 1] device arrays for the fusion arguments a launch ignores."""
    if not _UNUSED:
        _UNUSED["arrays"] = (cuda.to_device(np.zeros(1, np.float32)), cuda.to_device(np.zeros(1, np.float32)),
                             cuda.to_device(np.zeros((1, 1), np.uint32)))
    return _UNUSED["arrays"]


def softmax_parts(config: GemmConfig, n: int) -> int:
    """Softmax partials per row that a "scores" GEMM over n columns writes (each over block_n / warps_n)."""
    return -(-n // config.block_n) * config.warps_n




class ScoresFusion(NamedTuple):
    """gemm_tf32x3's "scores" fusion (gemm_kernel): masked by key_visible(token, key, prefix_len, visibility)
    with token = row // heads, exponentiated, each warp's (max, sum) written to partials."""
    partials: object  # float32 [m, softmax_parts(config, n), 2]
    visibility: object  # uint32 [s, words]
    heads: int
    prefix_len: int
    key_visible: object  # a device function


class ScaledFusion(NamedTuple):
    """gemm_tf32x3's "scaled" fusion (gemm_kernel): the chunk sums of row i over k in [p * width, (p + 1) *
    width) scaled by scale[i, p]."""
    scale: object  # float32 [m, parts], parts * width >= k
    width: int  # a multiple of block_k


class _Operands(NamedTuple):
    """A's rows m, a's row length lda, a2 (a itself when A is a alone) and its row length, the column where
    A switches from a to a2, and b's row length."""
    m: int
    lda: int
    a2: object
    lda2: int
    k_split: int
    ldb: int


def _check_operands(a, a2, b, c, n: int, k: int, splits: int, b_k_contiguous: bool) -> _Operands:
    """gemm_tf32x3's arrays checked against n, k and splits (one-line ValueErrors)."""
    for name, array in (("a", a), ("b", b), ("c", c)) + ((("a2", a2),) if a2 is not None else ()):
        if array.dtype != np.float32 or not array.is_c_contiguous():
            raise ValueError(f"{name} must be a C-contiguous float32 device array, got {array.dtype}")
    a_shape = tuple(a.shape)  # (the simulator's shapes do not slice)
    if len(a_shape) < 2:
        raise ValueError(f"a must be float32 [m, lda], got {list(a_shape)}")
    m, lda = math.prod(a_shape[:-1]), a_shape[-1]
    ldb = b.shape[1]
    if a2 is None:
        a2, lda2, k_split = a, lda, lda  # A is a alone (every kk < k <= lda): a2 never read
    else:
        a2_shape = tuple(a2.shape)
        if len(a2_shape) < 2 or a2_shape[:-1] != a_shape[:-1]:
            raise ValueError(f"a2 must be float32 {list(a_shape[:-1])} + [lda2], got {list(a2_shape)}")
        lda2, k_split = a2_shape[-1], lda
    if len(c.shape) != 3 or c.shape[0] != splits or c.shape[1] != m or c.shape[2] < n:
        raise ValueError(f"c must be float32 [{splits}, {m}, >= {n}], got {list(c.shape)}")
    b_rows, b_cols = (n, k) if b_k_contiguous else (k, n)
    if (lda if a2 is a else lda + lda2) < k or b.shape[0] < b_rows or ldb < b_cols:
        raise ValueError(f"a [{m}, {lda}] (+ a2) / b {list(b.shape)} too small for n={n}, k={k}")
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    return _Operands(m, lda, a2, lda2, k_split, ldb)


def _fusion_arguments(fusion, config: GemmConfig, m: int, n: int, k: int, splits: int) -> tuple:
    """(gemm_kernel's fusion name, key_visible or None, and the kernel's seven fusion arguments: scale,
    scale_parts, scale_width, partials, visibility, heads, prefix_len), placeholders where unused."""
    unused_scale, unused_partials, unused_visibility = _unused_arrays()
    if fusion is None:
        return "none", None, (unused_scale, 0, 1, unused_partials, unused_visibility, 1, 0)
    if isinstance(fusion, ScoresFusion):
        if splits != 1 or fusion.partials is None or tuple(fusion.partials.shape) != (m, softmax_parts(config, n), 2):
            raise ValueError(f"'scores' needs splits 1 and partials [{m}, {softmax_parts(config, n)}, 2]")
        return "scores", fusion.key_visible, (unused_scale, 0, 1, fusion.partials, fusion.visibility, fusion.heads,
                                              fusion.prefix_len)
    if isinstance(fusion, ScaledFusion):
        scale, width = fusion
        if (scale is None or len(scale.shape) != 2 or scale.shape[0] != m or width <= 0
                or width % config.block_k or scale.shape[1] * width < k):
            raise ValueError(f"'scaled' needs scale [{m}, >= ceil(k / scale_width)] and scale_width a multiple "
                             f"of block_k {config.block_k}")
        return "scaled", None, (scale, scale.shape[1], width, unused_partials, unused_visibility, 1, 0)
    raise ValueError(f"fusion must be None, ScoresFusion or ScaledFusion, got {fusion!r}")


def gemm_tf32x3(a, b, c, n: int, k: int, *, alpha: float = 1.0, b_k_contiguous: bool = True, splits: int = 1,
                config: GemmConfig = DEFAULT_GEMM, stream=0, fusion: ScoresFusion | ScaledFusion | None = None,
                a2=None):
    """c[z, i, j] = alpha * sum over split z's k range of A(i, kk) * B(kk, j), i < m, j < n (the rest of c
    untouched). Device arrays, C-contiguous float32: A = a [m, lda >= k], or with a2 the columns of a [m, lda]
    then those of a2 [m, lda2] (A(i, kk) = a[i, kk] for kk < lda, a2[i, kk - lda] after: attention's
    [q_lat | q_pe] without a copy; a and a2 may come as [..., lda], their leading dimensions making m);
    b [>= n, ldb >= k] with B(kk, j) = b[j, kk] (b_k_contiguous) or [>= k, ldb >= n] with B(kk, j) = b[kk, j];
    c [splits, m, ldc >= n].
    The k range is split in `splits` parts of whole block_k chunks (a trailing split may be empty: zeros).
    16-byte aligned operands with row lengths (and lda, with a2) multiples of 4 copy 16 bytes at a time (else 4).
    fusion: None (plain GEMM), ScoresFusion or ScaledFusion (softmax around attention's GEMMs, gemm_kernel)."""
    ops = _check_operands(a, a2, b, c, n, k, splits, b_k_contiguous)
    k_per_split = -(-max(k, 1) // splits)
    k_per_split = -(-k_per_split // config.block_k) * config.block_k
    if ops.m == 0 or n == 0:
        return c
    name, key_visible, fusion_args = _fusion_arguments(fusion, config, ops.m, n, k, splits)
    aligned = (ops.lda % 4 == 0 and ops.lda2 % 4 == 0 and ops.ldb % 4 == 0 and ops.k_split % 4 == 0
               and device_address(a) % 16 == 0 and device_address(ops.a2) % 16 == 0 and device_address(b) % 16 == 0)
    kernel = gemm_kernel(config, bool(b_k_contiguous), name, key_visible, aligned)
    # arrays go whole (the launcher passes a C-contiguous array as the kernel's flat parameter: no reshapes)
    launcher_for(kernel)(gemm_grid(config, ops.m, n, splits), (config.threads, 1, 1), stream,
                         config.shared_bytes(b_k_contiguous), a, ops.a2, b, c, ops.m, n, k, ops.lda, ops.lda2,
                         ops.k_split, ops.ldb, c.shape[2], alpha, k_per_split, *fusion_args)
    return c
