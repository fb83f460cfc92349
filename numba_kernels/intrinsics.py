"""at(a, i) / at_put(a, i, v): element i (>= 0) of a C-contiguous array's flat data, and at2(a, i, j) /
at2_put(a, i, j, v): element [i, j] (both >= 0) of any 2-D array (strided rows: a column slice of a wider
array), all without Numba's negative-index wraparound; at2x4(a, i, j) / at2x4_put(a, i, j, v0, v1, v2, v3): elements
[i, j .. j + 3] of a float32 2-D array in one 16-byte load / store (element [i, j] 16-byte aligned).

Numba's a[i] adds a select and 64-bit arithmetic per access for negative indices, which in a hot loop costs
more than the load itself and keeps every unrolled address in its own registers; in a kernel of few
instructions (a norm at one row) those accesses are most of its instructions. These intrinsics emit one
in-bounds address computation and the load / store. Under the CUDA simulator they are plain indexing.
"""
from numba.cuda import config

if config.ENABLE_CUDASIM:
    def at(array, index):
        return (array if array.ndim == 1 else array.reshape(-1))[index]

    def at_put(array, index, value):
        (array if array.ndim == 1 else array.reshape(-1))[index] = value

    def at2(array, row, column):
        return array[row, column]

    def at2_put(array, row, column, value):
        array[row, column] = value

    def at2x4(array, row, column):
        return array[row, column], array[row, column + 1], array[row, column + 2], array[row, column + 3]

    def at2x4_put(array, row, column, v0, v1, v2, v3):
        array[row, column], array[row, column + 1], array[row, column + 2], array[row, column + 3] = v0, v1, v2, v3
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
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

    def _pointer2(context, builder, sig, args):
        """The address of element [args[1], args[2]] of the 2-D array args[0], no wraparound, no bounds check."""
        indices = [context.cast(builder, value, kind, types.intp) for value, kind in zip(args[1:3], sig.args[1:3])]
        return cgutils.get_item_pointer(context, builder, sig.args[0],
                                        context.make_array(sig.args[0])(context, builder, value=args[0]), indices)

    @intrinsic
    def at2(typingctx, array, row, column):
        def codegen(context, builder, sig, args):
            return builder.load(_pointer2(context, builder, sig, args))
        return array.dtype(array, row, column), codegen

    @intrinsic
    def at2_put(typingctx, array, row, column, value):
        def codegen(context, builder, sig, args):
            builder.store(context.cast(builder, args[3], sig.args[3], sig.args[0].dtype),
                          _pointer2(context, builder, sig, args))
        return types.void(array, row, column, value), codegen

    def _vector4_pointer(context, builder, sig, args):
        pointer = _pointer2(context, builder, sig, args)
        return builder.bitcast(pointer, ir.VectorType(ir.FloatType(), 4).as_pointer(pointer.type.addrspace))

    @intrinsic
    def at2x4(typingctx, array, row, column):
        if array.dtype != types.float32:
            return None
        def codegen(context, builder, sig, args):
            vector = builder.load(_vector4_pointer(context, builder, sig, args), align=16)
            values = [builder.extract_element(vector, ir.Constant(ir.IntType(32), i)) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, values)
        return types.UniTuple(types.float32, 4)(array, row, column), codegen

    @intrinsic
    def at2x4_put(typingctx, array, row, column, v0, v1, v2, v3):
        if array.dtype != types.float32:
            return None
        def codegen(context, builder, sig, args):
            vector = ir.Constant(ir.VectorType(ir.FloatType(), 4), ir.Undefined)
            for i in range(4):
                value = context.cast(builder, args[3 + i], sig.args[3 + i], types.float32)
                vector = builder.insert_element(vector, value, ir.Constant(ir.IntType(32), i))
            builder.store(vector, _vector4_pointer(context, builder, sig, args), align=16)
        return types.void(array, row, column, v0, v1, v2, v3), codegen
