"""Suite ``attention``: tree-verify MLA attention (numba_kernels.attention, absorbed form) at Kimi K2 dims
(h 64, c 512, r 64), contexts P of 1k..32k cached rows, s = 8..256 tree tokens under a random tree mask.

Achieved FLOP/s counts the work each query must do: for every visible key row, the score (c + r MACs) and
the weighted latent sum (c MACs), 2 FLOP per MAC, summed over the keys each query actually sees (the prefix
plus its ancestors and itself). Compared with the fp32 FMA ceiling measured in the same run, and with torch
doing the same computation (fp32 matmul, masked softmax, matmul; TF32 off), whose output is checked against ours.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.bench.common import ceilings, progress, row, time_gpu, torch_cuda
from kdspec.numba_kernels.attention.common import pack_visibility
from kdspec.numba_kernels.attention.dispatch import mla_attention

SUITE = "attention"
TARGET_FRACTION = 0.5   # of the measured FMA ceiling, at 8k context with 64 tree tokens
TARGET_POINT = (8192, 64)


def random_tree_visibility(tokens: int, rng: np.random.Generator) -> np.ndarray:
    """bool [s, s]: a random tree (parent of node i uniform in 0..i-1), [i, j] when j is i or an ancestor."""
    visible = np.eye(tokens, dtype=bool)
    for i in range(1, tokens):
        visible[i] |= visible[rng.integers(0, i)]
    return visible


def attention_flops(prefix_len: int, visible: np.ndarray, heads: int, latent: int, rope: int) -> float:
    keys = prefix_len * visible.shape[0] + int(visible.sum())  # (query, key) pairs, per head
    return float(keys) * heads * (2 * (latent + rope) + 2 * latent)


def _torch_attention(torch, q_cat, cache, bias, heads, latent, scale):
    """q_cat [s*h, c+r], cache [t, c+r], bias [s, t] (0 / -inf) -> o_lat [s*h, c] in fp32."""
    scores = (q_cat @ cache.T) * scale
    s = bias.shape[0]
    scores = scores.view(s, heads, -1) + bias[:, None, :]
    return (torch.softmax(scores, dim=-1).view(s * heads, -1) @ cache[:, :latent])


def _time_torch_peer(torch, q_lat, q_pe, layer, prefix_len: int, visible: np.ndarray, scale: float,
                     result: np.ndarray) -> tuple[float, float]:
    """(seconds of torch's masked attention on the same inputs, its max |difference| from ``result``);
    raises past 1e-3."""
    tokens, heads, latent = result.shape
    rope = q_pe.shape[2]
    t_cache = torch.as_tensor(layer, device="cuda")
    q_cat = torch.cat([torch.as_tensor(q_lat, device="cuda"), torch.as_tensor(q_pe, device="cuda")],
                      dim=-1).reshape(tokens * heads, latent + rope)
    bias = torch.zeros((tokens, prefix_len + tokens), device="cuda")
    bias[:, prefix_len:].masked_fill_(~torch.as_tensor(visible, device="cuda"), float("-inf"))
    peer = time_gpu(lambda: _torch_attention(torch, q_cat, t_cache, bias, heads, latent, scale), warmup=2, repeats=10)
    want = _torch_attention(torch, q_cat, t_cache, bias, heads, latent, scale).cpu().numpy()
    err = float(np.abs(want.reshape(result.shape) - result).max())
    if err > 1e-3:
        raise RuntimeError(f"attention: ours and torch differ by {err:.3g} (P={prefix_len}, s={tokens})")
    return peer, err


def run(quick: bool = False) -> list[dict]:
    heads, latent, rope = (2, 16, 4) if quick else (64, 512, 64)
    contexts = (8,) if quick else (1024, 8192, 32768)
    token_counts = (4,) if quick else (8, 64, 256)
    scale = (128 + rope) ** -0.5
    torch = torch_cuda()
    peak = ceilings(quick)["fma_flops"]
    rng = np.random.default_rng(0)
    max_rows = max(contexts) + max(token_counts)
    cache_host = rng.standard_normal((max_rows, latent + rope)).astype(np.float32)
    cache = cuda.to_device(cache_host)
    rows = []
    for tokens in token_counts:
        visible = random_tree_visibility(tokens, rng)
        mask = cuda.to_device(pack_visibility(visible))
        q_lat_host = rng.standard_normal((tokens, heads, latent)).astype(np.float32)
        q_pe_host = rng.standard_normal((tokens, heads, rope)).astype(np.float32)
        q_lat, q_pe = cuda.to_device(q_lat_host), cuda.to_device(q_pe_host)
        out = cuda.to_device(np.full((tokens, heads, latent), np.nan, np.float32))
        for prefix_len in contexts:
            progress(f"attention: context {prefix_len}, {tokens} tree tokens")
            layer = cache[:prefix_len + tokens]
            ours = time_gpu(lambda: mla_attention(q_lat, q_pe, layer, prefix_len, mask, scale, out=out),
                            warmup=1 if quick else 3, repeats=2 if quick else 10)
            result = out.copy_to_host()
            if not np.isfinite(result).all():
                raise RuntimeError(f"attention: output not fully written (P={prefix_len}, s={tokens})")
            flops = attention_flops(prefix_len, visible, heads, latent, rope)
            achieved = flops / ours
            peer_value, ratio, note = None, None, ""
            if torch is not None:
                peer, err = _time_torch_peer(torch, q_lat, q_pe, layer, prefix_len, visible, scale, result)
                peer_value, ratio = flops / peer / 1e12, peer / ours
                note = f"ours {ours * 1e3:.3g} ms, torch {peer * 1e3:.3g} ms, max|diff| {err:.1e}; "
            fraction = achieved / peak
            note += f"{100 * fraction:.1f}% of fp32 FMA peak"
            target = ok = None
            if (prefix_len, tokens) == TARGET_POINT:
                target = f">= {100 * TARGET_FRACTION:g}% of FMA peak, > torch"
                ok = fraction >= TARGET_FRACTION and (ratio is not None and ratio > 1.0)
            rows.append(row(SUITE, f"P={prefix_len} s={tokens} h={heads}", achieved / 1e12, "TFLOP/s",
                            peer="torch fp32" if torch is not None else None, peer_value=peer_value, ratio=ratio,
                            target=target, ok=ok, note=note))
    return rows
