"""Could torch's grouped GEMM (torch._grouped_mm: CUTLASS, group offsets on the device, so a CUDA graph can
capture it) carry k2-mini's routed experts? (issue #19: the staged Numba experts are about half of a B=255 step.)
One table, a row per token count 1..256 (an AR step to a B=255 verify): the gate_up and down products of one MoE
layer, bf16 operands and output, under experts_probe.py's skewed routing (--skew 2.5) over 32 experts, GPU time
from CUDA events, the byte floor of the weights those products read at the measured copy bandwidth, and whether
token 0's gate_up rows have the same bits alone (an AR step's call: 8 rows, one per expert) as among all the
tokens' rows. Also whether torch takes an fp32 output for bf16 operands (out_dtype).

    python3 -W ignore tools/grouped_mm_probe.py

Run on the GPU machine. A probe for a lead, not a path of the engine.
"""
from __future__ import annotations

import numpy as np

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, TOKENS = 7168, 2048, 32, 8, 256
REPEATS = 20


def routing(rng, tokens: int, skew: float = 2.5) -> np.ndarray:
    """expert ids int [tokens, TOP_K]: each token's top K of (bias + Gumbel noise), bias ~ skew * N(0, 1) an
    expert: tools/experts_probe.py's k2-mini-like routing (at 256 tokens about 27 of 32 experts active, the
    busiest few taking 200+ pairs), so that its --time --skew 2.5 table compares."""
    bias = skew * np.random.default_rng(0).standard_normal(EXPERTS)
    return np.argsort(-(bias + rng.gumbel(size=(tokens, EXPERTS))), 1)[:, :TOP_K]


def timed(torch, call) -> float:
    """Milliseconds per call, from CUDA events around REPEATS calls after one warm-up."""
    call()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        call()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / REPEATS


def grouped(torch, ids: np.ndarray):
    """(pair order grouped by expert, int32 device offsets (each group's end), active experts) of ids [s, K]."""
    order = np.argsort(ids.reshape(-1), kind="stable")
    counts = np.bincount(ids.reshape(-1), minlength=EXPERTS)
    return order, torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda"), int((counts > 0).sum())


def main() -> None:
    import torch
    rng = np.random.default_rng(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    down = (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    copy_src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    bandwidth = 2 * copy_src.numel() / (timed(torch, lambda: copy_dst.copy_(copy_src)) * 1e-3)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    product = lambda a, w, offs: torch._grouped_mm(a, w.transpose(1, 2), offs=offs)  # noqa: E731
    try:
        small = torch.ones(16, 64, device="cuda", dtype=torch.bfloat16)
        torch._grouped_mm(small, small[None, :, :32], offs=torch.tensor([16], dtype=torch.int32, device="cuda"),
                          out_dtype=torch.float32)
        print("out_dtype=float32 with bf16 operands: accepted")
    except (RuntimeError, TypeError) as error:
        print(f"out_dtype=float32 with bf16 operands: not accepted ({str(error).splitlines()[0][:90]})")
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    all_ids = routing(rng, TOKENS)
    print(f"{'tokens':>6} {'experts':>7} {'busiest':>7} {'gate_up ms':>10} {'down ms':>8} {'floor ms':>8} "
          f"{'x floor':>7}  token 0's rows = alone")
    for tokens in (1, 8, 64, 128, 256):
        ids = all_ids[:tokens]
        order, offs, active = grouped(torch, ids)
        rows = x[torch.as_tensor(order // TOP_K, device="cuda")]  # [pairs, hidden], grouped by expert
        hidden = torch.randn(len(order), INTERMEDIATE, device="cuda", generator=gen).to(torch.bfloat16)
        up_ms = timed(torch, lambda: product(rows, gate_up, offs))
        down_ms = timed(torch, lambda: product(hidden, down, offs))
        floor = active * (gate_up[0].numel() + down[0].numel()) * 2 / bandwidth * 1e3
        # token 0 alone (an AR step's call: its 8 rows, one per expert) against its rows among all the tokens'
        alone_order, alone_offs, _ = grouped(torch, ids[:1])
        alone = product(x[:1].expand(TOP_K, HIDDEN).contiguous(), gate_up, alone_offs)
        full = product(rows, gate_up, offs)
        slots = ids.reshape(-1)[order]
        where = [int(np.nonzero((order // TOP_K == 0) & (slots == e))[0][0]) for e in ids[0][alone_order]]
        same = torch.equal(alone.view(torch.int16), full[where].view(torch.int16))
        busiest = np.bincount(ids.reshape(-1), minlength=EXPERTS).max()
        print(f"{tokens:>6} {active:>7} {busiest:>7} {up_ms:>10.3f} {down_ms:>8.3f} {floor:>8.3f} "
              f"{(up_ms + down_ms) / floor:>7.2f}  {same}")


if __name__ == "__main__":
    main()
