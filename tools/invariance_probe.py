"""Which products of the bf16 forward are batch-invariant on this GPU (issue #19), one table:

- every dense product of k2-mini (cuBLAS via torch, bf16 operands, fp32 result): rows computed at M = 1 and at
  M = 256 compared bit for bit, and rows moved to row 0 of a zero-padded M = 256 (and 512) product compared
  with the same rows in place (does a fixed M make cuBLAS row-invariant?);
- the per-head absorb products (torch bmm) the same way;
- the grouped routed experts (Numba): each token alone (s = 1) against the same token among 256;
- attention: each token of a 64-token causal launch (tensor-core path) against the same token alone (decode
  path, s = 1) over the same keys.

    python3 -W ignore tools/invariance_probe.py [--every-m]

Run on the GPU machine. Prints "rows differing / rows compared" per product and method. With ``--every-m``:
per dense product, unpadded, the row counts M in 1..512 at which some row of x[:M] @ w differs from the same
row of x[:512] @ w (a product with none needs no fixed row count).
"""
from __future__ import annotations

import numpy as np


def every_row_count(max_rows: int = 512) -> None:
    """For each dense product of k2-mini: the M in 1..max_rows whose rows differ from the same rows at max_rows."""
    import torch

    from kdspec.engine.model.config import PRESETS
    cfg = PRESETS["k2-mini"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for name, (k, n) in dense_shapes(cfg).items():
        w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
        x = torch.randn(max_rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        full = torch.mm(x, w.t(), out_dtype=torch.float32)
        differing = [m for m in range(1, max_rows + 1)
                     if not torch.equal(torch.mm(x[:m], w.t(), out_dtype=torch.float32), full[:m])]
        spans, start = [], None
        for m in range(1, max_rows + 2):
            if m in differing and start is None:
                start = m
            elif m not in differing and start is not None:
                spans.append(f"{start}" if m - 1 == start else f"{start}-{m - 1}")
                start = None
        print(f"{name:16s} [{k} -> {n}]: {len(differing):3d} of {max_rows} row counts differ from M={max_rows}"
              + (f": {', '.join(spans)}" if spans else ""))
        del w, x, full


def dense_shapes(cfg) -> dict:
    """name -> (in, out) of every dense product of a layer stack like ``cfg``'s."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    return {"q_a": (d, cfg.q_lora_rank), "q_kv_a": (d, cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim),
            "q_b": (cfg.q_lora_rank, h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)),
            "kv_a": (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), "o_proj": (h * cfg.v_head_dim, d),
            "dense gate_up": (d, 2 * cfg.intermediate_size), "dense down": (cfg.intermediate_size, d),
            "shared gate_up": (d, 2 * cfg.moe_intermediate_size), "shared down": (cfg.moe_intermediate_size, d),
            "router": (d, cfg.n_routed_experts), "lm_head": (d, cfg.vocab_size)}


def main() -> None:
    import sys
    if "--every-m" in sys.argv[1:]:
        every_row_count()
        return
    import torch
    from numba import cuda

    from kdspec.engine.device import cuda_graphs
    from kdspec.engine.model.config import PRESETS
    from kdspec.numba_kernels.attention.common import causal_visibility, pack_visibility
    from kdspec.numba_kernels.attention.dispatch import mla_attention
    from kdspec.numba_kernels.moe.experts import moe_experts

    cuda_graphs.use_torch_allocator()
    cfg = PRESETS["k2-mini"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    d, h = cfg.hidden_size, cfg.num_attention_heads
    dense = dense_shapes(cfg)
    rows = 256
    probe_rows = [0, 1, 7, 17, 64, 130, 255]
    lines = []

    def report(name, method, differing, compared):
        lines.append(f"{name:16s} {method:34s} {differing:3d} / {compared:3d} rows differ")

    def mm(x, w):
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    for name, (k, n) in dense.items():
        w = rand(n, k).to(torch.bfloat16)
        x = rand(rows, k).to(torch.bfloat16)
        full = mm(x, w)
        alone = sum(int(not torch.equal(mm(x[i:i + 1], w)[0], full[i])) for i in probe_rows)
        report(name, "M=1 vs M=256", alone, len(probe_rows))
        for fixed in (256, 512):
            big = torch.zeros(fixed, k, device="cuda", dtype=torch.bfloat16)
            big[:rows] = x
            in_place = mm(big, w)
            moved = 0
            for i in probe_rows:
                padded = torch.zeros(fixed, k, device="cuda", dtype=torch.bfloat16)
                padded[0] = x[i]
                moved += int(not torch.equal(mm(padded, w)[0], in_place[i]))
            report(name, f"row i -> row 0, both M={fixed}", moved, len(probe_rows))
        del w, x, full
    for name, (a, b) in {"w_uk bmm": (cfg.qk_nope_head_dim, cfg.kv_lora_rank),
                         "w_uv bmm": (cfg.kv_lora_rank, cfg.v_head_dim)}.items():
        w = rand(h, a, b).to(torch.bfloat16)
        x = rand(h, rows, a).to(torch.bfloat16)
        full = torch.bmm(x, w, out_dtype=torch.float32)
        alone = sum(int(not torch.equal(torch.bmm(x[:, i:i + 1], w, out_dtype=torch.float32)[:, 0], full[:, i]))
                    for i in probe_rows)
        report(name, "M=1 vs M=256", alone, len(probe_rows))
        padded_rows = 0
        for i in probe_rows:
            padded = torch.zeros_like(x)
            padded[:, 0] = x[:, i]
            padded_rows += int(not torch.equal(torch.bmm(padded, w, out_dtype=torch.float32)[:, 0], full[:, i]))
        report(name, "row i -> row 0, both M=256", padded_rows, len(probe_rows))

    e, f, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    w_gate_up = rand(e, 2 * f, d).mul_(0.02).to(torch.bfloat16).view(torch.int16)
    w_down = rand(e, d, f).mul_(0.02).to(torch.bfloat16).view(torch.int16)
    x = rand(rows, d)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k] for _ in range(rows)]).to(torch.int32)
    weights = torch.rand(rows, k, device="cuda", generator=gen)
    full = torch.as_tensor(moe_experts(x, ids, weights, w_gate_up, w_down), device="cuda").clone()
    moe_rows = sum(int(not torch.equal(torch.as_tensor(moe_experts(x[i:i + 1].contiguous(), ids[i:i + 1].contiguous(),
                                                                   weights[i:i + 1].contiguous(), w_gate_up, w_down),
                                                       device="cuda")[0], full[i]))
                   for i in probe_rows)
    report("routed experts", "s=1 vs s=256", moe_rows, len(probe_rows))
    del w_gate_up, w_down

    c, r, prefix, s = cfg.kv_lora_rank, cfg.qk_rope_head_dim, 100, 64
    cache = rand(prefix + s, c + r)
    q_lat, q_pe = rand(s, h, c), rand(s, h, r)
    scale = float(cfg.softmax_scale)
    together = torch.as_tensor(mla_attention(q_lat, q_pe, cache, prefix, cuda.to_device(causal_visibility(s)), scale),
                               device="cuda").clone()
    one = cuda.to_device(pack_visibility(np.ones((1, 1), bool)))
    attention_rows = 0
    token_rows = [0, 1, 7, 17, 40, 63]
    for i in token_rows:
        alone = mla_attention(q_lat[i:i + 1].contiguous(), q_pe[i:i + 1].contiguous(), cache[:prefix + i + 1], prefix + i,
                              one, scale)
        attention_rows += int(not torch.equal(torch.as_tensor(alone, device="cuda")[0], together[i]))
    report("attention", "decode s=1 vs tensor cores s=64", attention_rows, len(token_rows))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
