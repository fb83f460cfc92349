"""at(a, i) / at_put(a, i, v): element i (>= 0) of a C-contiguous array's flat data, without Numba's
negative-index wraparound.

Numba's a[i] adds a select and 64-bit arithmetic per access for negative indices, which in a hot loop costs
more than the load itself and keeps every unrolled address in its own registers. These intrinsics emit one
in-bounds getelementptr and the load / store. Under the CUDA simulator they are plain indexing.
"""
from numba.cuda import config

if config.ENABLE_CUDASIM:
    def at(array, index):
        return (array if array.ndim == 1 else array.reshape(-1))[index]

    def at_put(array, index, value):
        (array if array.ndim == 1 else array.reshape(-1))[index] = value
else:
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def at(typingctx, array, index):
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            offset = context.cast(builder, args[1], sig.args[1], types.intp)
            return builder.load(builder.gep(data, [offset], inbounds=True))
        return array.dtype(array, index), codegen

    @intrinsic
    def at_put(typingctx, array, index, value):
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            offset = context.cast(builder, args[1], sig.args[1], types.intp)
            builder.store(context.cast(builder, args[2], sig.args[2], sig.args[0].dtype),
                          builder.gep(data, [offset], inbounds=True))
        return types.void(array, index, value), codegen
