"""The block drafter in torch (training side), batched over sequences and anchors; engine/model/drafter.py states the math.

Batching: S sequences share their context rows; each has A anchors P (blocks). A block's L + 1 queries attend
to the S-th sequence's context rows t < P (a [S, A, T] mask) and to the block's own rows, nothing else. The
context features and each layer's context key/value rows are computed once per sequence for all its anchors.
Parameter names are the safetensors tensor names.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kdspec.engine.model.drafter import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., r/2] float32 of angle position * theta^(-2i/r); angles formed in float64."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=positions.device) / rope_dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [..., r]; cos, sin broadcast to [..., r/2]."""
    x = x.float()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, h, c, r, f = cfg.hidden_size, cfg.num_heads, cfg.latent_dim, cfg.rope_dim, cfg.intermediate_size
        self.cfg = cfg
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_lat = nn.Linear(d, h * c, bias=False)
        self.q_pe = nn.Linear(d, h * r, bias=False)
        self.kv = nn.Linear(d, c + r, bias=False)
        self.kv_ctx = nn.Linear(d, c + r, bias=False)
        self.kv_norm = RMSNorm(c, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(h * c, d, bias=False)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def key_rows(self, u_p: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[..., c + r] projections -> [..., c + r] keys: normed latent | roped rope part."""
        c = self.cfg.latent_dim
        return torch.cat((self.kv_norm(u_p[..., :c]), apply_rope(u_p[..., c:], cos, sin)), dim=-1)

    def forward(self, x: torch.Tensor, ctx_keys: torch.Tensor, ctx_visible: torch.Tensor,
                block_cos: torch.Tensor, block_sin: torch.Tensor) -> torch.Tensor:
        """x [S, A, J, d] block rows; ctx_keys [S, T, c + r] (this layer's); ctx_visible [S, A, T] bool."""
        cfg = self.cfg
        S, A, J, _ = x.shape
        h, c, r, T = cfg.num_heads, cfg.latent_dim, cfg.rope_dim, ctx_keys.shape[1]
        a = self.input_norm(x)
        q_lat = self.q_lat(a).view(S, A, J, h, c).float()
        q_pe = apply_rope(self.q_pe(a).view(S, A, J, h, r), block_cos[..., None, :], block_sin[..., None, :])
        q = torch.cat((q_lat, q_pe), dim=-1)                                   # [S, A, J, h, c + r]
        blk_keys = self.key_rows(self.kv(a), block_cos, block_sin)             # [S, A, J, c + r]
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else q.dtype
        q, ctx_k, blk_k = q.to(dtype), ctx_keys.to(dtype), blk_keys.to(dtype)
        s_ctx = torch.matmul(q.reshape(S, A * J * h, c + r), ctx_k.transpose(1, 2)).view(S, A, J * h, T)
        s_blk = torch.matmul(q.reshape(S, A, J * h, c + r), blk_k.transpose(-1, -2))   # [S, A, J*h, J]
        s_ctx = s_ctx.float().masked_fill(~ctx_visible[:, :, None, :], float("-inf"))
        p = torch.softmax(torch.cat((s_ctx, s_blk.float()), dim=-1) * cfg.softmax_scale, dim=-1).to(dtype)
        o = torch.matmul(p[..., :T].reshape(S, A * J * h, T), ctx_k[..., :c]).view(S, A, J * h, c) + \
            torch.matmul(p[..., T:], blk_k[..., :c])                            # [S, A, J*h, c]
        x = x + self.o_proj(o.reshape(S, A, J, h * c)).float()
        m = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m)).float()


class BlockDrafter(nn.Module):
    """The drafter: ``forward`` gives the final-normed hidden rows of depths 1..L; logits = them . lm_head^T."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layers) * d, d, bias=False)
        self.fc_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)

    def reset_parameters(self, seed: int, std: float = 0.02) -> None:
        """Normal(0, std) matrices (output projections scaled by 1/sqrt(2 num_layers)), mask_embedding
        Normal(0, std), norms 1."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                scale = std / (2 * self.cfg.num_layers) ** 0.5 if name.endswith(("o_proj.weight",
                                                                                  "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * scale)

    def forward(self, ctx_hidden: torch.Tensor, anchors: torch.Tensor, bonus: torch.Tensor,
                embed_weight: torch.Tensor) -> torch.Tensor:
        """Args:
            ctx_hidden [S, T, n*d]: the target's tapped hidden states of each sequence's rows (row t at position t).
            anchors [S, A] int64: P per block (1 <= P <= T); the block sees context rows t < P.
            bonus [S, A] int64: the token at position P.
            embed_weight [V, d]: the target's embedding.
        Returns:
            [S, A, L, d] float32: RMSNorm_norm of the block rows j = 1..L (row j predicts position P + j).
        """
        cfg = self.cfg
        T = ctx_hidden.shape[1]
        J = cfg.block_size
        f = self.fc_norm(self.fc(ctx_hidden))                                  # [S, T, d]
        t = torch.arange(T, device=ctx_hidden.device)
        ctx_cos, ctx_sin = rope_cos_sin(t, cfg.rope_dim, cfg.rope_theta)          # [T, r/2]
        block_pos = anchors[..., None] + torch.arange(J, device=anchors.device)  # [S, A, J]
        block_cos, block_sin = rope_cos_sin(block_pos, cfg.rope_dim, cfg.rope_theta)
        ctx_visible = t[None, None, :] < anchors[..., None]                     # [S, A, T]
        x0 = F.embedding(bonus, embed_weight).float()[:, :, None, :]
        x = torch.cat((x0, self.mask_embedding.float().expand(*bonus.shape, J - 1, -1)), dim=2)
        for layer in self.layers:
            ctx_keys = layer.key_rows(layer.kv_ctx(f), ctx_cos, ctx_sin)
            x = layer(x, ctx_keys, ctx_visible, block_cos, block_sin)
        return self.norm(x[:, :, 1:])


def depth_weights(depths: int, gamma: float, device=None) -> torch.Tensor:
    """w_j = exp(-(j - 1) / gamma) for j = 1..L, divided by their sum (float32 [L])."""
    w = torch.exp(-torch.arange(depths, dtype=torch.float64, device=device) / gamma)
    return (w / w.sum()).float()


def block_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head_weight: torch.Tensor,
               weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy: mean over blocks of sum_j w_j CE_j (w normalised). hidden [..., L, d], labels
    [..., L]; returns (loss, per-depth mean CE [L] detached)."""
    logits = F.linear(hidden, lm_head_weight).float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    ce = ce.view(labels.shape)
    return (ce * weights).sum(-1).mean(), ce.detach().reshape(-1, labels.shape[-1]).mean(0)


def bf16_state(model: BlockDrafter) -> dict[str, np.ndarray]:
    """The parameters as bf16 bit patterns (uint16 numpy), the names in config order."""
    state = dict(model.named_parameters())
    return {name: state[name].detach().to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)
            for name in model.cfg.parameter_shapes()}


def round_to_bf16(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
