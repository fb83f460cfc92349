"""Backend ops of the device model: uploads and the dense products (the vendor-BLAS half of the forward).

SimOps (backend ``sim``): simulator device arrays, dense products in numpy float32 BLAS on host copies
(row_by_row: one BLAS call per row, so a row's result never depends on the row count: batch-invariant mode).
TorchOps (backend ``cuda``): dense products through cuBLAS (torch); Numba kernels share torch's stream.
Both: upload(a, bf16), dense_weight(w), linear(x [s, in], w [out, in]) -> [s, out], heads_matmul(x [s, h, a],
w) -> [s, h, b], to_host(x); TorchOps also copy(x), device_view(t) and the graph machinery (segment_graphs).
TorchOps' upload and dense_weight also take float32 torch tensors already on the GPU (weights drawn there).
TorchOps(fixed_rows=R) runs every product over exactly R rows (padded; more rows in chunks of R), so that
cuBLAS, which picks its kernel (tiles, split-K) by shape, computes a row the same way whatever the number of
rows in the call: the batch-invariant mode of the device model. A linear weight whose product cuBLAS computes
row-invariantly anyway (checked when the weight is made: ``row_invariant``) skips the padding and runs in
calls of up to CHECKED_ROWS rows, the rows it has: an AR step's lm_head reads its weight at one row's cost and
a 256-node verify reads it once, not twice.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.model.safetensors_io import float32_to_bf16_bits

# Row counts up to which a linear weight's product is checked row-invariant (every count 1..CHECKED_ROWS): a
# DDTree verify at budget 255 is 256 rows.
CHECKED_ROWS = 256


class SimOps:
    """Under the simulator: device arrays are simulator arrays; dense products run in numpy (float32 BLAS)."""

    name = "sim"

    def __init__(self, row_by_row: bool = False):
        self.row_by_row = row_by_row

    def _rows(self, product, x):
        """product(x) for x [s, ...] on the host: in one call, or one call per row."""
        if not self.row_by_row:
            return product(x)
        return np.concatenate([product(x[i:i + 1]) for i in range(x.shape[0])]) if x.shape[0] else product(x)

    def upload(self, a: np.ndarray, bf16: bool = False):
        """A device copy of host array ``a`` (bf16: as uint16 bf16 bit patterns, the kernels' bf16 storage)."""
        return cuda.to_device(float32_to_bf16_bits(a) if bf16 else np.ascontiguousarray(a))

    def dense_weight(self, w: np.ndarray):
        return np.ascontiguousarray(w, dtype=np.float32)

    @staticmethod
    def _host(x):
        return x._ary if hasattr(x, "_ary") else np.asarray(x)  # the simulator's array, no copy

    def linear(self, x, w):
        """x [s, in] device, w [out, in] -> device [s, out]."""
        return cuda.to_device(self._rows(lambda rows: rows @ w.T, self._host(x)))

    def heads_matmul(self, x, w, transpose_w: bool):
        """Per head: x [s, h, a] @ w[h] ([h, a, b], or [h, b, a] transposed) -> device [s, h, b]."""
        xh = self._host(x)
        return cuda.to_device(np.ascontiguousarray(self._rows(
            lambda rows: np.einsum("sha,hba->shb" if transpose_w else "sha,hab->shb", rows, w), xh)))

    def to_host(self, x) -> np.ndarray:
        return np.array(self._host(x))

    def copy(self, x):
        return cuda.to_device(np.array(self._host(x)))


class _Unsynced:
    """A device array's interface without its stream field (torch would otherwise wait on that stream)."""

    def __init__(self, array):
        self.array = array
        self.__cuda_array_interface__ = {**array.__cuda_array_interface__, "stream": None}


class TorchOps:
    """On a GPU: dense products through cuBLAS (torch); numba kernels share torch's current stream."""

    name = "cuda"

    def __init__(self, weight_dtype: str, fixed_rows: int | None = None):
        import torch
        self.torch = torch
        self.weight_dtype = torch.bfloat16 if weight_dtype == "bfloat16" else torch.float32
        if fixed_rows is not None and fixed_rows < 1:
            raise ValueError(f"fixed_rows must be >= 1, got {fixed_rows}")
        self.fixed_rows = fixed_rows
        self._invariant_shapes: dict = {}  # (out, in) -> whether cuBLAS's product gives a row the same bits at
        #                                    every row count (fixed_rows only; row_invariant)
        from kdspec.engine.device import cuda_graphs  # GPU only (the simulator has no memory-manager plugins)
        cuda_graphs.use_torch_allocator()  # graph capture needs it; eager launches allocate faster too
        self.segment_graphs = cuda_graphs.SegmentGraphs

    def upload(self, a, bf16: bool = False):
        """A Numba device array of ``a``: a host array copied, a torch tensor on the GPU viewed (bf16: uint16 bf16
        bit patterns, the kernels' bf16 storage, rounded to nearest even either way)."""
        if isinstance(a, self.torch.Tensor):
            return self.device_view(a.to(self.torch.bfloat16) if bf16 else a.contiguous())
        return cuda.to_device(float32_to_bf16_bits(a) if bf16 else np.ascontiguousarray(a))

    def device_view(self, t):
        """A Numba view of contiguous torch tensor ``t`` (bf16 as its uint16 bit patterns)."""
        if t.dtype == self.torch.bfloat16:
            bits = t.view(self.torch.int16)
            interface = {**bits.__cuda_array_interface__, "typestr": "<u2", "stream": None}
            return cuda.from_cuda_array_interface(interface, owner=bits, sync=False)
        return self._numba(t)

    def dense_weight(self, w):
        if isinstance(w, self.torch.Tensor):
            w = w.to("cuda", self.weight_dtype).contiguous()
        else:
            w = self.torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to("cuda", self.weight_dtype)
        if self.fixed_rows is not None and w.dim() == 2:
            self.row_invariant(w)
        return w

    def row_invariant(self, w) -> bool:
        """Whether cuBLAS's product x @ w.T gives every row the same bits at every row count 1..CHECKED_ROWS and
        at every place in the call, checked once per weight shape on a random weight and random rows (x[:M]
        against the first M rows of the CHECKED_ROWS-row product, x[-M:] against its last M, for every M; random,
        so that no two summation orders agree by luck, as they would on a zero weight): cuBLAS picks its kernel
        by shape, and for some shapes every kernel it picks sums a row's products in one order (lm_head;
        tools/invariance_probe.py --every-m). Such a weight's products skip fixed_rows' padding."""
        key = tuple(w.shape)
        if key not in self._invariant_shapes:
            torch = self.torch
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(CHECKED_ROWS, w.shape[1], device="cuda", generator=gen, dtype=w.dtype)
            probe = torch.randn(w.shape, device="cuda", generator=gen, dtype=w.dtype)
            bits = lambda rows: self._product(torch.mm, rows, probe.t()).view(torch.int32)  # noqa: E731
            full = bits(x)
            same = torch.ones((), dtype=torch.bool, device="cuda")
            for rows in range(1, CHECKED_ROWS):
                same &= (bits(x[:rows]) == full[:rows]).all() & (bits(x[-rows:]) == full[-rows:]).all()
            self._invariant_shapes[key] = bool(same)  # one read back for all of them
        return self._invariant_shapes[key]

    def torch_view(self, x):
        """A torch view of Numba device array ``x`` (no copy; torch's stream, as every launch here)."""
        return self.torch.as_tensor(_Unsynced(x), device="cuda")

    @staticmethod
    def _numba(t):
        """A Numba view of torch tensor ``t``. Without the interface's stream field: every launch and product
        runs on one stream in order, and a stream sync would stop a graph capture."""
        return cuda.from_cuda_array_interface({**t.__cuda_array_interface__, "stream": None}, owner=t, sync=False)

    def _x(self, x, w):
        # bf16 weights: the GEMM reads bf16 operands on the tensor cores with fp32 accumulation, so the
        # activation is rounded to bf16 too; fp32 weights keep the whole product in fp32.
        x = self.torch_view(x)
        return x if w.dtype == self.torch.float32 else x.to(w.dtype)

    def _product(self, op, a, b, out=None):
        """a @ b (mm or bmm) with an fp32 result (into ``out`` when given: fp32, any strides cuBLAS takes). bf16
        operands write fp32 straight from the accumulator (out_dtype): a bf16-rounded output would round
        differently for different row counts (cuBLAS picks its kernel by shape), and a verify forward must agree
        with the AR forward at near-ties."""
        if out is not None:
            try:
                return op(a, b, out=out) if a.dtype == self.torch.float32 else op(a, b, out_dtype=self.torch.float32,
                                                                                 out=out)
            except (TypeError, NotImplementedError, RuntimeError):  # no out= with out_dtype here: the same bits
                return out.copy_(self._product(op, a, b))          # through a copy
        if a.dtype == self.torch.float32:
            return op(a, b)
        try:
            return op(a, b, out_dtype=self.torch.float32)
        except (TypeError, NotImplementedError, RuntimeError):  # torch < 2.9, or no such kernel here
            return op(a, b).float()

    def _rows_fixed(self, a, b):
        """a @ b over a's rows in calls of exactly fixed_rows rows, a cast to b's dtype, each call's rows written
        into one output. The rows past a's in the last call are left as they are: a product's row depends on its
        own row alone, so they need no zeros (a fill kernel each). A row-invariant weight's product (b = w.T)
        runs over a's rows as they are, in calls of up to CHECKED_ROWS."""
        mm, rows, fixed = self.torch.mm, a.shape[0], self.fixed_rows
        if fixed is None or rows == fixed:
            return self._product(mm, a.to(b.dtype), b)
        if self._invariant_shapes.get((b.shape[1], b.shape[0])):
            a = a.to(b.dtype)
            if rows <= CHECKED_ROWS:
                return self._product(mm, a, b)
            out = a.new_empty((rows, b.shape[1]), dtype=self.torch.float32)
            for start in range(0, rows, CHECKED_ROWS):
                self._product(mm, a[start:start + CHECKED_ROWS], b, out=out[start:start + CHECKED_ROWS])
            return out
        calls = -(-rows // fixed)
        padded = a.new_empty((calls * fixed, a.shape[1]), dtype=b.dtype)
        padded[:rows].copy_(a)  # the cast and the copy in one kernel
        out = a.new_empty((calls * fixed, b.shape[1]), dtype=self.torch.float32)
        for start in range(0, calls * fixed, fixed):
            self._product(mm, padded[start:start + fixed], b, out=out[start:start + fixed])
        return out[:rows]

    def linear(self, x, w):
        x = self.torch_view(x) if self.fixed_rows is not None else self._x(x, w)
        out = self._rows_fixed(x, w.t())
        return self._numba(out.contiguous())

    def heads_matmul(self, x, w, transpose_w: bool):
        """Per head: x [s, h, a] @ w[h] -> [s, h, b] fp32, in calls of exactly fixed_rows rows (fixed_rows set).
        The operands and the result stay token-major: each call's batched product reads its heads' [rows, a]
        matrices and writes its [rows, b] ones at a row stride of h*a / h*b (cuBLAS takes any leading dimension),
        so no transposed copy goes in or comes out, and the calls write one output (no concatenation)."""
        torch = self.torch
        x = self.torch_view(x)
        w = w.transpose(1, 2) if transpose_w else w  # [h, a, b]
        rows = x.shape[0]
        fixed = self.fixed_rows or max(rows, 1)
        calls = -(-rows // fixed)
        if rows == calls * fixed and x.dtype == w.dtype:
            operand = x
        else:
            operand = x.new_empty((calls * fixed, *x.shape[1:]), dtype=w.dtype)
            operand[:rows].copy_(x)  # the cast and the copy in one kernel; rows past x's left as they are
        out = x.new_empty((calls * fixed, x.shape[1], w.shape[2]), dtype=torch.float32)
        for start in range(0, calls * fixed, fixed):
            self._product(torch.bmm, operand[start:start + fixed].transpose(0, 1), w,
                          out=out[start:start + fixed].transpose(0, 1))
        return self._numba(out[:rows])

    def to_host(self, x) -> np.ndarray:
        return x.copy_to_host() if hasattr(x, "copy_to_host") else self.torch_view(x).cpu().numpy()

    def copy(self, x):
        return self._numba(self.torch_view(x).clone())
