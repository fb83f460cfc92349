"""Suite ``moe``: the grouped routed-expert kernels at Kimi K2 sizes (e 384 experts, d 7168, f 2048, top-8, bf16
weights), s = 1..256 tokens with random distinct top-8 routing: numba_kernels.moe.experts (fp32 activations and
arithmetic, the fp32 compute mode's kernels) and, with torch on a GPU, experts_tc (bf16 activations on the tensor
cores, the bf16 mode's), the latter timed as graph replays (common.time_graph), as the device model runs them.

Weight bytes read = distinct experts picked x 3 d f x 2 bytes (each expert's gate, up and down matrices read
once per launch); over the kernel time, against the device copy bandwidth measured in the same run. The peer
is torch's per-expert loop as Hugging Face models write it (gather the expert's tokens, bf16 matmuls for
gate/up and down, weighted index_add), with the token grouping done on the host outside its timing.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.bench.common import ceilings, progress, row, time_gpu, time_graph, torch_cuda
from kdspec.numba_kernels.moe.experts import moe_experts
from kdspec.numba_kernels.moe.experts_tc import fragment_layout

SUITE = "moe"
TARGET_FRACTION = 0.6  # of the measured copy bandwidth, at 64 tokens
TARGET_TOKENS = 64
TC_TARGET_FRACTION = 0.8  # the tensor-core experts (bf16 mode), at 1 and 256 tokens (issue #19)
TC_TARGET_TOKENS = (1, 256)


def _routing(tokens: int, experts: int, k: int, rng: np.random.Generator):
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :k].astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32)
    return ids, (weights / weights.sum(1, keepdims=True)).astype(np.float32)


def _torch_moe(torch, x_bf16, groups, weights, gate_up, down, out):
    """HF-style loop over the active experts; groups: [(expert, token index tensor, slot index tensor)]."""
    out.zero_()
    for expert, tok, slot in groups:
        gate, up = (x_bf16[tok] @ gate_up[expert].T).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        out.index_add_(0, tok, (h @ down[expert].T).float() * weights[tok, slot, None])
    return out


def _expert_weights(torch, experts: int, d: int, f: int, rng: np.random.Generator):
    """(gate_up, down) bf16 bits as device arrays [e, 2f, d] / [e, d, f], the same as torch tensors and the same
    in the tensor-core kernels' fragment_layout (None, None, None without torch). With torch the 34 GB of bf16
    weights (and their 34 GB in fragment_layout) are made on the GPU."""
    if torch is None:
        bits = lambda a: (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
        gate_up = cuda.to_device(bits(rng.standard_normal((experts, 2 * f, d)) * d ** -0.5))
        down = cuda.to_device(bits(rng.standard_normal((experts, d, f)) * f ** -0.5))
        return gate_up, down, None, None, None
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up_t = torch.randn((experts, 2 * f, d), generator=gen, device="cuda", dtype=torch.bfloat16).mul_(d ** -0.5)
    down_t = torch.randn((experts, d, f), generator=gen, device="cuda", dtype=torch.bfloat16).mul_(f ** -0.5)
    bits = [t.view(torch.int16) for t in (gate_up_t, down_t)]
    gate_up, down = (cuda.as_cuda_array(t) for t in bits)
    laid = tuple(cuda.as_cuda_array(fragment_layout(t)) for t in bits)
    return gate_up, down, gate_up_t, down_t, laid


def _torch_peer(torch, x_host, ids, weights, gate_up_t, down_t) -> tuple[float, np.ndarray]:
    """(seconds of the torch loop, its output float32 [s, d])."""
    tokens, d = x_host.shape
    x_bf16 = torch.as_tensor(x_host, device="cuda").to(torch.bfloat16)
    w_t = torch.as_tensor(weights, device="cuda")
    groups = []
    for expert in np.unique(ids):
        tok, slot = np.nonzero(ids == expert)
        groups.append((int(expert), torch.as_tensor(tok, device="cuda"), torch.as_tensor(slot, device="cuda")))
    out_t = torch.empty((tokens, d), device="cuda", dtype=torch.float32)
    peer = time_gpu(lambda: _torch_moe(torch, x_bf16, groups, w_t, gate_up_t, down_t, out_t), warmup=2, repeats=10)
    return peer, out_t.cpu().numpy()


def _checked(result: np.ndarray, want: np.ndarray | None, what: str) -> float | None:
    """The max relative difference of ``result`` from torch's ``want`` (None without torch); raises when the
    output was not fully written (it starts NaN) or differs past 5%."""
    if not np.isfinite(result).all():
        raise RuntimeError(f"moe: output not fully written ({what})")
    if want is None:
        return None
    err = float(np.abs(want - result).max() / max(np.abs(want).max(), 1e-30))
    if err > 0.05:  # torch rounds activations to bf16: a few 1e-3 relative is expected
        raise RuntimeError(f"moe: ours and torch differ by {err:.3g} relative ({what})")
    return err


def run(quick: bool = False) -> list[dict]:
    experts, k, d, f = (4, 2, 16, 8) if quick else (384, 8, 7168, 2048)
    token_counts = (1, 4) if quick else (1, 8, 64, 256)
    torch = torch_cuda()
    bandwidth = ceilings(quick)["copy_bytes_per_s"]
    rng = np.random.default_rng(0)
    progress(f"moe: weights e={experts} d={d} f={f} bf16")
    gate_up, down, gate_up_t, down_t, laid = _expert_weights(torch, experts, d, f, rng)
    expert_bytes = 3 * d * f * 2
    rows = []
    for tokens in token_counts:
        progress(f"moe: {tokens} tokens")
        ids, weights = _routing(tokens, experts, k, rng)
        x_host = rng.standard_normal((tokens, d)).astype(np.float32)
        x, ids_dev, weights_dev = cuda.to_device(x_host), cuda.to_device(ids), cuda.to_device(weights)
        y = cuda.to_device(np.full((tokens, d), np.nan, np.float32))
        ours = time_gpu(lambda: moe_experts(x, ids_dev, weights_dev, gate_up, down, out=y),
                        warmup=1 if quick else 3, repeats=2 if quick else 10)
        peer, want = (None, None) if torch is None else _torch_peer(torch, x_host, ids, weights, gate_up_t, down_t)
        err = _checked(y.copy_to_host(), want, f"{tokens} tokens")
        distinct = len(np.unique(ids))
        weight_bytes = distinct * expert_bytes
        fraction = weight_bytes / ours / bandwidth
        note = f"{distinct} distinct experts; ours {ours * 1e3:.3g} ms; {100 * fraction:.1f}% of copy bandwidth"
        peer_value = ratio = None
        if torch is not None:
            peer_value, ratio = weight_bytes / peer / 1e9, peer / ours
            note += f"; torch {peer * 1e3:.3g} ms, max rel diff {err:.1e}"
        target = ok = None
        if tokens == TARGET_TOKENS and not quick:
            target = f">= {100 * TARGET_FRACTION:g}% of copy BW, > torch"
            ok = fraction >= TARGET_FRACTION and ratio is not None and ratio > 1.0
        rows.append(row(SUITE, f"experts s={tokens} k={k} d={d} f={f}", weight_bytes / ours / 1e9, "GB/s",
                        peer="torch loop bf16" if torch is not None else None, peer_value=peer_value, ratio=ratio,
                        target=target, ok=ok, note=note))
        if torch is not None:
            rows.append(_tensor_core_row(torch, x, ids_dev, weights_dev, *laid, want, peer, weight_bytes,
                                         bandwidth, f"s={tokens} k={k} d={d} f={f}", distinct))
    if torch is not None:
        del gate_up, down, gate_up_t, down_t, laid
        torch.cuda.empty_cache()  # give the 34 GB back before the next suite
    return rows


def _tensor_core_row(torch, x, ids, weights, gate_up, down, want, peer, weight_bytes, bandwidth, shape, distinct):
    """The bf16 compute mode's experts (tensor cores, experts_tc.py; gate_up and down in its fragment_layout)
    timed as the device model runs them: one moe_experts call (plan, bf16 x, gate_up, down, combine) captured as a
    CUDA graph and replayed."""
    tokens = x.shape[0]
    poison = np.full((tokens, x.shape[1]), np.nan, np.float32)
    y = cuda.to_device(poison)
    eager = time_gpu(lambda: moe_experts(x, ids, weights, gate_up, down, out=y, tensor_cores=True), 3, 10)
    err = _checked(y.copy_to_host(), want, f"tensor cores, {tokens} tokens")
    replay = time_graph(torch, lambda stream: moe_experts(x, ids, weights, gate_up, down, out=y, stream=stream,
                                                          tensor_cores=True),
                        after_capture=lambda: y.copy_to_device(poison))
    _checked(y.copy_to_host(), want, f"tensor cores in a graph, {tokens} tokens")
    fraction = weight_bytes / replay / bandwidth
    target = ok = None
    if tokens in TC_TARGET_TOKENS:
        target = f">= {100 * TC_TARGET_FRACTION:g}% of copy BW"
        ok = fraction >= TC_TARGET_FRACTION
    note = (f"{distinct} distinct experts; a graph replay {replay * 1e3:.3g} ms, {100 * fraction:.1f}% of copy "
            f"bandwidth; the call from Python {eager * 1e3:.3g} ms; torch {peer * 1e3:.3g} ms (from Python: the "
            f"ratio is against our call from Python), max rel diff {err:.1e}")
    return row(SUITE, f"experts tensor cores {shape}", weight_bytes / replay / 1e9, "GB/s", peer="torch loop bf16",
               peer_value=weight_bytes / peer / 1e9, ratio=peer / eager, target=target, ok=ok, note=note)
