"""Backend ops of the device model: uploads and the dense products (the vendor-BLAS half of the forward).

SimOps (backend ``sim``): simulator device arrays, dense products in numpy float32 BLAS on host copies
(row_by_row: one BLAS call per row, so a row's result never depends on the row count: batch-invariant mode).
TorchOps (backend ``cuda``): dense products through cuBLAS (torch); Numba kernels share torch's stream.
Both: upload(a, bf16), dense_weight(w), linear(x [s, in], w [out, in]) -> [s, out], heads_matmul(x [s, h, a],
w) -> [s, h, b], to_host(x); TorchOps also copy(x), device_view(t) and the graph machinery (segment_graphs).
TorchOps' upload and dense_weight also take float32 torch tensors already on the GPU (weights drawn there).
TorchOps(fixed_rows=R) runs every product over exactly R rows (padded; more rows in chunks of R), so that
cuBLAS, which picks its kernel (tiles, split-K) by shape, computes a row the same way whatever the number of
rows in the call: the batch-invariant mode of the device model.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.model.safetensors_io import float32_to_bf16_bits


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
            return w.to("cuda", self.weight_dtype).contiguous()
        return self.torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to("cuda", self.weight_dtype)

    def _t(self, x):
        return self.torch.as_tensor(_Unsynced(x), device="cuda")

    @staticmethod
    def _numba(t):
        """A Numba view of torch tensor ``t``. Without the interface's stream field: every launch and product
        runs on one stream in order, and a stream sync would stop a graph capture."""
        return cuda.from_cuda_array_interface({**t.__cuda_array_interface__, "stream": None}, owner=t, sync=False)

    def _x(self, x, w):
        # bf16 weights: the GEMM reads bf16 operands on the tensor cores with fp32 accumulation, so the
        # activation is rounded to bf16 too; fp32 weights keep the whole product in fp32.
        x = self._t(x)
        return x if w.dtype == self.torch.float32 else x.to(w.dtype)

    def _product(self, op, a, b, out=None):
        """a @ b (mm or bmm) with an fp32 result (into ``out`` when given: contiguous, fp32). bf16 operands write
        fp32 straight from the accumulator (out_dtype): a bf16-rounded output would round differently for
        different row counts (cuBLAS picks its kernel by shape), and a verify forward must agree with the AR
        forward at near-ties."""
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

    def _rows_fixed(self, op, a, b):
        """op(a, b) over a's rows (dimension -2) in calls of exactly fixed_rows rows, a cast to b's dtype. The
        rows past a's in the last call are left as they are: a product's row depends on its own row alone, so
        they need no zeros (a fill kernel each). mm writes each call's rows into one output (no concatenation);
        bmm's calls are concatenated."""
        rows, fixed = a.shape[-2], self.fixed_rows
        if fixed is None or rows == fixed:
            return self._product(op, a.to(b.dtype), b)
        calls = -(-rows // fixed)
        padded = a.new_empty((*a.shape[:-2], calls * fixed, a.shape[-1]), dtype=b.dtype)
        padded[..., :rows, :].copy_(a)  # the cast and the copy in one kernel
        if op is self.torch.mm:
            out = a.new_empty((calls * fixed, b.shape[-1]), dtype=self.torch.float32)
            for start in range(0, calls * fixed, fixed):
                self._product(op, padded[start:start + fixed], b, out=out[start:start + fixed])
        else:
            parts = [self._product(op, padded[..., start:start + fixed, :], b)
                     for start in range(0, calls * fixed, fixed)]
            out = parts[0] if calls == 1 else self.torch.cat(parts, dim=-2)
        return out[..., :rows, :]

    def linear(self, x, w):
        x = self._t(x) if self.fixed_rows is not None else self._x(x, w)
        out = self._rows_fixed(self.torch.mm, x, w.t())
        return self._numba(out.contiguous())

    def heads_matmul(self, x, w, transpose_w: bool):
        x = self._t(x) if self.fixed_rows is not None else self._x(x, w)
        xh = x.transpose(0, 1)  # [h, s, a]
        out = self._rows_fixed(self.torch.bmm, xh, w.transpose(1, 2) if transpose_w else w)  # [h, s, b]
        return self._numba(out.transpose(0, 1).contiguous())

    def to_host(self, x) -> np.ndarray:
        return x.copy_to_host() if hasattr(x, "copy_to_host") else self._t(x).cpu().numpy()

    def copy(self, x):
        return self._numba(self._t(x).clone())
