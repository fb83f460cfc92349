"""TorchOps' batch-invariant products on the GPU (engine/device/ops.py): a weight whose cuBLAS product is checked
row-invariant runs unpadded, and a row's bits still do not depend on the rows beside it, up to and past
CHECKED_ROWS (calls of CHECKED_ROWS rows); a weight that is not runs padded to fixed_rows as before."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("out_features, in_features", [(163840, 7168), (12288, 1536), (1536, 7168), (32, 7168)])
def test_a_row_has_the_same_bits_at_every_row_count(out_features, in_features):
    torch = pytest.importorskip("torch")
    from kdspec.engine.device.ops import CHECKED_ROWS, TorchOps
    ops = TorchOps("bfloat16", fixed_rows=128)
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = ops.dense_weight(torch.randn(out_features, in_features, device="cuda", generator=gen))
    invariant = ops.row_invariant(w)
    rows = CHECKED_ROWS + 44
    x = torch.randn(rows, in_features, device="cuda", generator=gen)
    full = torch.as_tensor(ops.linear(ops.device_view(x), w), device="cuda").clone()
    for count in (1, 2, 17, 128, 129, CHECKED_ROWS, rows):
        for first in (0, rows - count):
            part = torch.as_tensor(ops.linear(ops.device_view(x[first:first + count].contiguous()), w), device="cuda")
            assert torch.equal(part.view(torch.int32), full[first:first + count].view(torch.int32)), \
                (count, first, invariant)
    if (out_features, in_features) == (163840, 7168) and "H200" in torch.cuda.get_device_name():
        assert invariant  # lm_head's shape, measured row-invariant there (BENCHMARKS.md): the unpadded path ran
    print(f"[{in_features} -> {out_features}] row-invariant: {invariant}")


@pytest.mark.gpu
@pytest.mark.parametrize("heads, a, b, transpose_w", [(64, 128, 512, False), (64, 512, 128, True), (3, 40, 24, False)])
@pytest.mark.parametrize("weight_dtype", ["bfloat16", "float32"])
def test_heads_matmul_matches_float64_and_a_row_has_the_same_bits_at_every_row_count(heads, a, b, transpose_w,
                                                                                      weight_dtype):
    """The token-major batched products (strided operands and result, calls of fixed_rows rows) against float64
    on the bf16-rounded operands, and each row's bits the same whatever rows share the call; outputs poisoned."""
    torch = pytest.importorskip("torch")
    from kdspec.engine.device.ops import TorchOps
    ops = TorchOps(weight_dtype, fixed_rows=128)
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn((heads, b, a) if transpose_w else (heads, a, b), device="cuda", generator=gen)
    w = w.to(ops.weight_dtype)
    rows = 300
    x = torch.randn(rows, heads, a + 8, device="cuda", generator=gen)[:, :, :a]  # a strided slice, as q's nope part
    poison = torch.full((rows * 2, heads, max(a, b)), float("nan"), device="cuda")
    del poison  # torch's caching allocator hands this NaN-filled memory to the products' buffers next
    full = torch.as_tensor(ops.heads_matmul(ops.device_view(x), w, transpose_w), device="cuda").clone()
    assert full.shape == (rows, heads, b) and full.is_contiguous()
    operand = x.to(ops.weight_dtype).double()
    weight = (w.transpose(1, 2) if transpose_w else w).double()
    want = torch.einsum("sha,hab->shb", operand, weight)
    tolerance = 1e-4  # the operands exact in both (bf16-rounded first); fp32 accumulation either way (tf32 off)
    assert torch.isfinite(full).all()
    assert torch.allclose(full.double(), want, rtol=tolerance, atol=tolerance * a ** 0.5)
    for count in (1, 2, 17, 128, 129, 256):
        for first in (0, rows - count):
            part = torch.as_tensor(ops.heads_matmul(ops.device_view(x[first:first + count]), w, transpose_w),
                                   device="cuda")
            assert torch.equal(part.view(torch.int32), full[first:first + count].view(torch.int32)), (count, first)
