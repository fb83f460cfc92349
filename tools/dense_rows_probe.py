"""The fixed row count of the batch-invariant dense products, per product (issue #19): which counts M keep a row's
bits wherever it sits in the call, and what one call costs, on this GPU.

The batch-invariant bf16 model runs every padded dense product (cuBLAS via torch, bf16 operands, fp32 result) over
exactly M rows, so cuBLAS picks the same kernel for an AR step's one row and a verify's 256 (engine/device/ops.py).
A smaller M makes an AR step's product cheaper (cuBLAS picks a kernel for M rows) and a verify's dearer
(ceil(256 / M) calls each reading the weight). For each of k2-mini's dense products and the two per-head absorb
products (bmm), and each M:
- bits: the rows of one M-row call against the same rows in another M-row call, moved to other places among
  other rows (reversed order, the rest random); "same" when every row kept its bits;
- us a call: GPU time of one call as the model runs it (the bf16 cast into the padded buffer, then the product),
  the median of graph replays of 20 calls; the AR cost is one call, a B=255 verify's ceil(256 / M) calls.

    python3 -W ignore tools/dense_rows_probe.py      (on the GPU machine; ~1 min)
"""
from __future__ import annotations

import statistics

ROW_COUNTS = (8, 16, 32, 64, 128, 256)
VERIFY_ROWS = 256
REPLAY_CALLS = 20


def time_calls(torch, call) -> float:
    """Median microseconds of one call(), from graph replays of REPLAY_CALLS calls."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAY_CALLS):
            call()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPLAY_CALLS)
    del graph
    return statistics.median(times)


def main() -> None:
    import torch

    from kdspec.engine.model.config import PRESETS
    from tools.invariance_probe import dense_shapes

    cfg = PRESETS["k2-mini"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    h = cfg.num_attention_heads
    products = {name: ("mm", k, n) for name, (k, n) in dense_shapes(cfg).items() if name not in ("q_a", "kv_a")}
    products["w_uk bmm"] = ("bmm", cfg.qk_nope_head_dim, cfg.kv_lora_rank)
    products["w_uv bmm"] = ("bmm", cfg.kv_lora_rank, cfg.v_head_dim)
    print(f"{'product':16s} {'M':>4s} {'bits':>5s} {'us a call':>10s} {'AR us':>8s} {'B=255 us':>9s}")
    best = {}
    for name, (op, k, n) in products.items():
        lead = (h,) if op == "bmm" else ()
        w = rand(*lead, n, k).to(torch.bfloat16)
        wt = w.transpose(-1, -2)
        product = torch.bmm if op == "bmm" else torch.mm
        x32 = rand(*lead, 1, k)  # the activation, float32 (the model's), one row as an AR step has
        rows = []
        for m in ROW_COUNTS:
            x = rand(*lead, m, k).to(torch.bfloat16)
            first = product(x, wt, out_dtype=torch.float32)
            moved = torch.cat([rand(*lead, m // 2, k).to(torch.bfloat16), x.flip(-2)[..., :m - m // 2, :]], dim=-2)
            second = product(moved, wt, out_dtype=torch.float32)[..., m // 2:, :]
            same = torch.equal(second.view(torch.int32), first.flip(-2)[..., :m - m // 2, :].view(torch.int32))
            padded = torch.empty(*lead, m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(*lead, m, n, device="cuda", dtype=torch.float32)

            def call():
                padded[..., :1, :].copy_(x32)
                product(padded, wt, out_dtype=torch.float32, out=out)

            us = time_calls(torch, call)
            verify = -(-VERIFY_ROWS // m) * us
            rows.append((m, same, us, verify))
            print(f"{name:16s} {m:4d} {'same' if same else 'DIFF':>5s} {us:10.1f} {us:8.1f} {verify:9.1f}")
        usable = [r for r in rows if r[1]]
        if usable:
            ar = min(usable, key=lambda r: r[2])
            best[name] = (ar[0], ar[2], ar[3], next(r for r in rows if r[0] == 128))
        del w, wt
    print("\nproduct          fastest AR M: us a call, B=255 us   (M=128: us a call, B=255 us)")
    for name, (m, us, verify, at128) in best.items():
        print(f"best {name:16s} M={m:<4d} {us:7.1f} {verify:8.1f}   ({at128[2]:7.1f} {at128[3]:8.1f})")


if __name__ == "__main__":
    main()
