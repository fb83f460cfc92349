"""The float64 golden reference: the layers of a DeepSeek-V3 / Kimi K2 model as plain numpy functions.

Semantics follow the official DeepSeek-V3 ``inference/model.py`` (RoPE on adjacent pairs, YaRN blend of
``precompute_freqs_cis``, absorbed MLA, noaux_tc gate) plus HF's choices where the two differ (YaRN applied
whenever ``rope_scaling`` is set, cos/sin times HF's mscale ratio, ``norm_topk_prob``).
Everything computes in float64; float32 weights are widened where they are used.
Kernels are tested against these functions; engine/golden/model.py builds the model from them.
Each function computes with the namespace of its arrays (arrays.py): numpy for numpy arrays, the same math on a
torch device for torch tensors (the golden on a GPU), so there is one definition of the reference.

Dimension letters: s query tokens, t key rows, h heads, d hidden, c kv_lora_rank, n qk_nope_head_dim,
r qk_rope_head_dim, v v_head_dim, e routed experts, k experts per token, f FFN width, V vocab.
"""
from __future__ import annotations

import math

import numpy as np

from kdspec.engine.golden.arrays import namespace
from kdspec.engine.model.config import ModelConfig

# linear() widens weights to float64 in row blocks of this many elements, so a [V, d] LM head of a
# Kimi-sized model never needs a full float64 copy.
_WIDEN_BLOCK_ELEMENTS = 1 << 24


def f64(a, xp=None):
    """``a`` as float64 in namespace ``xp`` (default: its own; a numpy array moves to xp's torch device)."""
    xp = namespace(a) if xp is None else xp
    return xp.asarray(a, dtype=xp.float64)


def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [..., in] @ weight[out, in]^T -> [..., out] float64 (torch.nn.Linear layout, no bias)."""
    xp = namespace(x, weight)
    x = f64(x, xp)
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: input width {x.shape[-1]} does not match weight {tuple(weight.shape)}")
    rows = max(1, _WIDEN_BLOCK_ELEMENTS // max(1, weight.shape[1]))
    if weight.shape[0] <= rows:
        return x @ f64(weight, xp).T
    out = xp.empty(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=xp.float64)
    for start in range(0, weight.shape[0], rows):
        out[..., start:start + rows] = x @ f64(weight[start:start + rows], xp).T
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [..., d] -> x / sqrt(mean(x^2) + eps) * weight, float64."""
    xp = namespace(x, weight)
    x = f64(x, xp)
    return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps) * f64(weight, xp)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + namespace(x).exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + namespace(x).exp(-x))


def swiglu(x: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray) -> np.ndarray:
    """SwiGLU FFN: down(silu(gate x) * up x). x [s, d]; gate_w, up_w [f, d]; down_w [d, f] -> [s, d]."""
    return linear(silu(linear(x, gate_w)) * linear(x, up_w), down_w)


# ---------------------------------------------------------------------------------------------- RoPE
def yarn_get_mscale(scale: float, mscale: float) -> float:
    """HF DeepSeek-V3 ``yarn_get_mscale``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _find_correction_dim(num_rotations: float, dim: int, base: float, max_position: int) -> float:
    return dim * math.log(max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def _find_correction_range(low_rot: float, high_rot: float, dim: int, base: float,
                           max_position: int) -> tuple[int, int]:
    low = math.floor(_find_correction_dim(low_rot, dim, base, max_position))
    high = math.ceil(_find_correction_dim(high_rot, dim, base, max_position))
    return max(low, 0), min(high, dim - 1)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [r/2] float64 of rotary pair i, YaRN-blended when ``cfg.rope_scaling`` is set."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ys = cfg.rope_scaling
    if ys is None:
        return freqs
    low, high = _find_correction_range(ys.beta_fast, ys.beta_slow, dim, base, ys.original_max_position_embeddings)
    if low == high:
        high += 0.001  # as the official code: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    smooth = 1.0 - ramp  # 1: keep the original frequency (high-frequency pairs), 0: interpolate by factor
    return freqs / ys.factor * (1.0 - smooth) + freqs * smooth


def rope_cos_sin(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [s, r/2] float64 of angle position * freq_i, times HF's YaRN mscale ratio (1 for the presets)."""
    positions = np.asarray(positions)
    if positions.ndim != 1 or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"positions must be a 1-D integer array, got {positions.dtype} shape {positions.shape}")
    angles = np.outer(positions.astype(np.float64), rope_frequencies(cfg))
    ys = cfg.rope_scaling
    magnitude = 1.0 if ys is None else (yarn_get_mscale(ys.factor, ys.mscale)
                                        / yarn_get_mscale(ys.factor, ys.mscale_all_dim))
    return np.cos(angles) * magnitude, np.sin(angles) * magnitude


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate adjacent pairs (x[2i], x[2i+1]) by angle i. x [s, ..., r]; cos, sin [s, r/2] -> [s, ..., r]."""
    xp = namespace(x, cos, sin)
    x = f64(x, xp)
    if x.shape[0] != cos.shape[0] or x.shape[-1] != 2 * cos.shape[-1]:
        raise ValueError(f"apply_rope: x {tuple(x.shape)} does not fit cos/sin {tuple(cos.shape)}")
    expand = (slice(None),) + (None,) * (x.ndim - 2) + (slice(None),)  # [s, 1.., r/2]
    c, s_ = f64(cos, xp)[expand], f64(sin, xp)[expand]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = xp.empty_like(x)
    out[..., 0::2] = even * c - odd * s_
    out[..., 1::2] = even * s_ + odd * c
    return out


# ----------------------------------------------------------------------------------------------- MLA
def split_kv_b(cfg: ModelConfig, kv_b_weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj weight [h*(n+v), c] -> W_UK [h, n, c], W_UV [h, v, c] (float64)."""
    h, n, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    w = f64(kv_b_weight).reshape(h, n + v, cfg.kv_lora_rank)  # in the weight's namespace
    return w[:, :n], w[:, n:]


def _check_attention_inputs(q_pe, kv_c, k_pe, visibility) -> None:
    xp = namespace(q_pe, visibility)
    s, t = q_pe.shape[0], kv_c.shape[0]
    if k_pe.shape[0] != t or tuple(visibility.shape) != (s, t):
        raise ValueError(f"attention: {s} queries over {t} latent rows and {k_pe.shape[0]} rope rows need "
                         f"visibility [{s}, {t}], got {tuple(visibility.shape)}")
    if visibility.dtype != xp.bool_:
        raise ValueError(f"attention: visibility must be bool, got {visibility.dtype}")
    blind = xp.flatnonzero(~xp.any(visibility, axis=1))
    if len(blind):
        raise ValueError(f"attention: query {int(blind[0])} sees no key row")


def masked_softmax(scores: np.ndarray, visibility: np.ndarray) -> np.ndarray:
    """Softmax over the last axis t of scores [s, h, t] where visibility [s, t] is True; 0 elsewhere."""
    xp = namespace(scores)
    masked = xp.where(visibility[:, None, :], scores, -xp.inf)
    e = xp.exp(masked - xp.max(masked, axis=-1, keepdims=True))
    return e / xp.sum(e, axis=-1, keepdims=True)


def mla_attention_latent(q_lat: np.ndarray, q_pe: np.ndarray, kv_c: np.ndarray, k_pe: np.ndarray,
                         visibility: np.ndarray, scale: float) -> np.ndarray:
    """The absorbed attention core, in latent space.

    Args:
        q_lat [s, h, c]: q_nope already multiplied by W_UK; q_pe [s, h, r]: roped.
        kv_c [t, c]: normed latent rows; k_pe [t, r]: roped rope keys (one key shared by all heads).
        visibility [s, t] bool; scale: softmax scale.
    Returns:
        o_lat [s, h, c] float64 = softmax((q_lat . c_t + q_pe . k_pe_t) * scale) @ kv_c.
    """
    xp = namespace(q_lat, q_pe, kv_c, k_pe)
    q_lat, q_pe, kv_c, k_pe = (f64(a, xp) for a in (q_lat, q_pe, kv_c, k_pe))
    _check_attention_inputs(q_pe, kv_c, k_pe, visibility)
    scores = (xp.einsum("shc,tc->sht", q_lat, kv_c) + xp.einsum("shr,tr->sht", q_pe, k_pe)) * scale
    return xp.einsum("sht,tc->shc", masked_softmax(scores, visibility), kv_c)


def mla_attention_absorbed(q_nope: np.ndarray, q_pe: np.ndarray, kv_c: np.ndarray, k_pe: np.ndarray,
                           w_uk: np.ndarray, w_uv: np.ndarray, visibility: np.ndarray, scale: float) -> np.ndarray:
    """MLA with W_UK folded into the query and W_UV applied after the latent attention.

    Args:
        q_nope [s, h, n]; q_pe [s, h, r] (roped); kv_c [t, c]; k_pe [t, r] (roped);
        w_uk [h, n, c]; w_uv [h, v, c] (from split_kv_b); visibility [s, t] bool; scale.
    Returns:
        o [s, h, v] float64, per head, before o_proj.
    """
    xp = namespace(q_nope, w_uk)
    q_lat = xp.einsum("shn,hnc->shc", f64(q_nope, xp), f64(w_uk, xp))
    o_lat = mla_attention_latent(q_lat, q_pe, kv_c, k_pe, visibility, scale)
    return xp.einsum("shc,hvc->shv", o_lat, f64(w_uv, xp))


def mla_attention_naive(q_nope: np.ndarray, q_pe: np.ndarray, kv_c: np.ndarray, k_pe: np.ndarray,
                        w_uk: np.ndarray, w_uv: np.ndarray, visibility: np.ndarray, scale: float) -> np.ndarray:
    """MLA with per-head keys and values expanded from the latent rows; same arguments and result as
    mla_attention_absorbed: k = [c W_UK^T | k_pe], v = c W_UV^T, o = softmax(q . k * scale) v."""
    xp = namespace(q_nope, q_pe, kv_c, k_pe)
    q_nope, q_pe, kv_c, k_pe = (f64(a, xp) for a in (q_nope, q_pe, kv_c, k_pe))
    _check_attention_inputs(q_pe, kv_c, k_pe, visibility)
    h, t = w_uk.shape[0], kv_c.shape[0]
    k_nope = xp.einsum("tc,hnc->thn", kv_c, f64(w_uk, xp))                 # [t, h, n]
    values = xp.einsum("tc,hvc->thv", kv_c, f64(w_uv, xp))                 # [t, h, v]
    keys = xp.concatenate([k_nope, xp.broadcast_to(k_pe[:, None, :], (t, h, k_pe.shape[1]))], axis=-1)
    queries = xp.concatenate([q_nope, q_pe], axis=-1)                      # [s, h, n+r]
    scores = xp.einsum("shd,thd->sht", queries, keys) * scale
    return xp.einsum("sht,thv->shv", masked_softmax(scores, visibility), values)


# ----------------------------------------------------------------------------------------------- MoE
def moe_gate(cfg: ModelConfig, x: np.ndarray, gate_weight: np.ndarray,
             bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """noaux_tc routing. x [s, d]; gate_weight [e, d]; bias [e] (e_score_correction_bias) or None.

    Returns (expert_ids [s, k] int64, expert_weights [s, k] float64), best first. Ties (in groups and in
    experts) go to the lower index. topk_method "greedy" picks the top-k sigmoid scores, without bias or groups.
    """
    scores = sigmoid(linear(x, gate_weight))                               # [s, e], unbiased
    xp = namespace(scores)
    s, e, k = scores.shape[0], cfg.n_routed_experts, cfg.num_experts_per_tok
    greedy = cfg.topk_method == "greedy"
    choice = xp.copy(scores) if (greedy or bias is None) else scores + f64(bias, xp)
    if cfg.n_group > 1 and not greedy:
        grouped = choice.reshape(s, cfg.n_group, e // cfg.n_group)
        group_scores = xp.sum(xp.sort(grouped, axis=-1)[..., -2:], axis=-1)  # sum of each group's top-2
        keep = xp.argsort(-group_scores, axis=-1, kind="stable")[:, :cfg.topk_group]
        dropped = xp.ones((s, cfg.n_group), dtype=xp.bool_)
        xp.put_along_axis(dropped, keep, False, axis=-1)
        choice = xp.where(xp.repeat(dropped, e // cfg.n_group, axis=-1), -xp.inf, choice)
    expert_ids = xp.asarray(xp.argsort(-choice, axis=-1, kind="stable")[:, :k], dtype=xp.int64)
    weights = xp.take_along_axis(scores, expert_ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    return expert_ids, weights * cfg.routed_scaling_factor


def layer_weights(weights: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """The tensors of one layer, keyed without the ``model.layers.{layer}.`` prefix (e.g. ``mlp.gate.weight``)."""
    prefix = f"model.layers.{layer}."
    return {name[len(prefix):]: w for name, w in weights.items() if name.startswith(prefix)}


def moe(cfg: ModelConfig, x: np.ndarray, lw: dict[str, np.ndarray]) -> np.ndarray:
    """MoE FFN: sum_i w_i expert_i(x) + shared(x). x [s, d]; lw from layer_weights() -> [s, d] float64."""
    xp = namespace(x)
    x = f64(x, xp)
    expert_ids, expert_weights = moe_gate(cfg, x, lw["mlp.gate.weight"], lw.get("mlp.gate.e_score_correction_bias"))
    out = xp.zeros_like(x)
    for expert in xp.unique(expert_ids).tolist():  # only experts some token picked: Kimi-sized layers stay cheap
        rows, slot = xp.nonzero(expert_ids == expert)
        p = f"mlp.experts.{expert}."
        y = swiglu(x[rows], lw[p + "gate_proj.weight"], lw[p + "up_proj.weight"], lw[p + "down_proj.weight"])
        out[rows] += expert_weights[rows, slot][:, None] * y
    if cfg.n_shared_experts:
        out += swiglu(x, lw["mlp.shared_experts.gate_proj.weight"], lw["mlp.shared_experts.up_proj.weight"],
                      lw["mlp.shared_experts.down_proj.weight"])
    return out


def dense_mlp(x: np.ndarray, lw: dict[str, np.ndarray]) -> np.ndarray:
    """The dense SwiGLU MLP of the first first_k_dense_replace layers. x [s, d] -> [s, d]."""
    return swiglu(x, lw["mlp.gate_proj.weight"], lw["mlp.up_proj.weight"], lw["mlp.down_proj.weight"])


def mla_projections(cfg: ModelConfig, x: np.ndarray, lw: dict[str, np.ndarray], cos: np.ndarray,
                    sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Query parts and new cache rows of one MLA layer.

    Args:
        x [s, d] (after input_layernorm); lw from layer_weights(); cos, sin [s, r/2] from rope_cos_sin.
    Returns:
        q_nope [s, h, n], q_pe [s, h, r] (roped), kv_c [s, c] (kv_a_layernorm applied), k_pe [s, r] (roped).
    """
    h, n, r, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q = linear(x, lw["self_attn.q_proj.weight"])
    else:
        q_a = rms_norm(linear(x, lw["self_attn.q_a_proj.weight"]), lw["self_attn.q_a_layernorm.weight"],
                       cfg.rms_norm_eps)
        q = linear(q_a, lw["self_attn.q_b_proj.weight"])
    q = q.reshape(x.shape[0], h, n + r)
    kv = linear(x, lw["self_attn.kv_a_proj_with_mqa.weight"])
    kv_c = rms_norm(kv[:, :c], lw["self_attn.kv_a_layernorm.weight"], cfg.rms_norm_eps)
    return q[..., :n], apply_rope(q[..., n:], cos, sin), kv_c, apply_rope(kv[:, c:], cos, sin)
