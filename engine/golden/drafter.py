"""The float64 golden of the DFlash-style block drafter (engine/model/drafter.py has the config and tensors).

One forward drafts a whole block. Inputs: the target's hidden states of the committed rows 0..P-1 at the
drafter's target_layers, hidden [n, P, d]; the bonus token b (position P). Context row t gives the feature
f_t = RMSNorm(fc(concat_n hidden[:, t])); the block's rows are [embed(b), mask, ..., mask] at positions P..P+L.
Each layer: pre-norm multi-query attention with one shared latent key/value row per token, as MLA's absorbed
form (context rows' kv from f_t by kv_ctx, block rows' kv from the block by kv; latent RMS-normed, rope part
roped at the row's position; every block row sees every context row and every block row), then a SwiGLU FFN.
Row j >= 1 of the final norm through the target's lm_head gives the distribution of the token at P + j.
RoPE: adjacent pairs, inv_freq = theta^(-2i/r), no YaRN.
"""
from __future__ import annotations

import numpy as np

from kdspec.engine.golden.layers import apply_rope, f64, linear, mla_attention_latent, rms_norm, swiglu
from kdspec.engine.model.drafter import DrafterConfig


def drafter_rope_cos_sin(cfg: DrafterConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [s, r/2] float64 of the drafter's plain RoPE."""
    inv_freq = cfg.rope_theta ** (-np.arange(0, cfg.rope_dim, 2, dtype=np.float64) / cfg.rope_dim)
    angles = np.outer(np.asarray(positions, dtype=np.float64), inv_freq)
    return np.cos(angles), np.sin(angles)


def context_features(cfg: DrafterConfig, weights: dict, hidden: np.ndarray) -> np.ndarray:
    """f [P, d] float64 from the target's hidden states hidden [n, P, d]."""
    stacked = np.concatenate([f64(h) for h in hidden], axis=-1)  # [P, n*d]
    return rms_norm(linear(stacked, weights["fc.weight"]), weights["fc_norm.weight"], cfg.rms_norm_eps)


def _kv_rows(cfg: DrafterConfig, x: np.ndarray, weight: np.ndarray, norm: np.ndarray, positions: np.ndarray):
    kv = linear(x, weight)
    latent = rms_norm(kv[:, :cfg.latent_dim], norm, cfg.rms_norm_eps)
    return latent, apply_rope(kv[:, cfg.latent_dim:], *drafter_rope_cos_sin(cfg, positions))


def draft_logits(cfg: DrafterConfig, weights: dict, embed: np.ndarray, lm_head: np.ndarray, hidden: np.ndarray,
                 bonus: int) -> np.ndarray:
    """logits [L, V] float64: row j-1 is the distribution of the token at position P + j (P = hidden.shape[1])."""
    prefix = hidden.shape[1]
    h, c, r, eps = cfg.num_heads, cfg.latent_dim, cfg.rope_dim, cfg.rms_norm_eps
    context = context_features(cfg, weights, hidden)
    x = np.stack([f64(embed[bonus])] + [f64(weights["mask_embedding"])] * cfg.num_depths)  # [L+1, d]
    block_positions = prefix + np.arange(cfg.block_size)
    cos, sin = drafter_rope_cos_sin(cfg, block_positions)
    visible = np.ones((cfg.block_size, prefix + cfg.block_size), dtype=bool)
    for k in range(cfg.num_layers):
        w = lambda name: weights[f"layers.{k}.{name}.weight"]  # noqa: E731
        a = rms_norm(x, w("input_norm"), eps)
        q_lat = linear(a, w("q_lat")).reshape(cfg.block_size, h, c)
        q_pe = apply_rope(linear(a, w("q_pe")).reshape(cfg.block_size, h, r), cos, sin)
        ctx_latent, ctx_pe = _kv_rows(cfg, context, w("kv_ctx"), w("kv_norm"), np.arange(prefix))
        blk_latent, blk_pe = _kv_rows(cfg, a, w("kv"), w("kv_norm"), block_positions)
        o_lat = mla_attention_latent(q_lat, q_pe, np.concatenate([ctx_latent, blk_latent]),
                                     np.concatenate([ctx_pe, blk_pe]), visible, cfg.softmax_scale)
        x = x + linear(o_lat.reshape(cfg.block_size, h * c), w("o_proj"))
        x = x + swiglu(rms_norm(x, w("post_norm"), eps), w("gate_proj"), w("up_proj"), w("down_proj"))
    return linear(rms_norm(x[1:], weights["norm.weight"], eps), lm_head)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    shifted = f64(logits) - np.max(logits, axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
