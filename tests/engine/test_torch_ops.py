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
