"""DeviceDrafter: the block drafter's forward (engine/model/drafter.py has the math) on the device model's ops and
kernels, reading the target's kept hidden states where the device cache keeps them; only the [L, K] draft comes
back to the host. The golden is engine/golden/drafter.py draft_logits (float64); this is fp32.

One draft at prefix P (the bonus token at position P, block rows at P .. P + L):
    f = fc_norm(sum_i hidden[i, :P] . fc_i^T)       fc_i: the columns of fc.weight for tapped layer i (ops.linear
        each, summed by rmsnorm.add_rms_norm: cache.hidden is [n, capacity, d], so the golden's concatenation
        [P, n*d] is not one array on the device; the sum of the n products is the same product)
    x = [embed_tokens[b], mask, ..., mask]          numba_kernels.embedding (the target's device table, and a
                                                    one-row table of the mask embedding)
    per layer: input_norm (rmsnorm); q_lat, q_pe, kv, kv_ctx (ops.linear); RoPE of q_pe (numba_kernels.rope);
        kv_norm + RoPE of both kinds of kv row straight into the drafter's latent rows (numba_kernels.kv_write:
        context rows 0..P-1, block rows P..P+L of a scratch [layers, rows, c + r]); the latent attention by the
        engine's MLA kernel (attention.dispatch.mla_attention: q_lat is the absorbed query as it is, the block
        rows in flight with every bit of the visibility set, the context rows the prefix); o_proj; post_norm with
        the residual add (rmsnorm.add_rms_norm); SwiGLU (ops.linear, moe.swiglu.silu_mul, ops.linear)
    final norm (fused with the last residual add); lm_head (the target's device weight) on rows 1..L;
    log-softmax and top-K per row (numba_kernels.sampling: log_softmax_rows, topk_rows).
The RoPE tables are the drafter's own plain RoPE (theta^(-2i/r), golden drafter_rope_cos_sin rounded to fp32),
uploaded once for every position the target has plus one block.
Dimension letters: d hidden, n tapped layers, c latent_dim, r rope_dim, h heads, f intermediate, V vocab,
L depths, K top-K, P prefix.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.device.model import DeviceModel
from kdspec.engine.golden.drafter import drafter_rope_cos_sin
from kdspec.engine.model.drafter import DrafterConfig, DrafterError
from kdspec.numba_kernels import embedding, kv_write, rmsnorm, rope, sampling
from kdspec.numba_kernels.attention.common import MAX_LATENT, MAX_ROPE, pack_visibility
from kdspec.numba_kernels.attention.dispatch import mla_attention
from kdspec.numba_kernels.moe import swiglu


class DeviceDrafter:
    """The trained block drafter on ``model``'s backend (DeviceModel, "sim" or "cuda"), fp32.

    Args:
        cfg, weights: the drafter (engine/model/drafter.py load_drafter; float32 arrays).
        model: the target's DeviceModel (its ops, embedding table and lm_head are shared).
        top_k: K candidates per depth (1..V).
    draft(committed_tokens, bonus_token, position, cache) -> (ids int32 [L, K], log-probs float32 [L, K]), as
    engine.decode.drafters.BlockDrafter; ``cache`` (the run's DeviceCache) must keep cfg.target_layers.
    Raises DrafterError when the attention kernels cannot take the drafter's latent / rope widths here (the
    simulator's toy limits).
    """

    def __init__(self, cfg: DrafterConfig, weights: dict, model: DeviceModel, top_k: int):
        if not isinstance(model, DeviceModel):
            raise TypeError(f"a device drafter runs on a DeviceModel, got {type(model).__name__}")
        cfg.check_target(model.cfg)
        vocab = model.cfg.vocab_size
        if not 1 <= top_k <= vocab:
            raise ValueError(f"top_k must be in 1..vocab ({vocab}), got {top_k}")
        if cfg.latent_dim > MAX_LATENT or cfg.rope_dim > MAX_ROPE:
            raise DrafterError(f"drafter latent_dim {cfg.latent_dim} / rope_dim {cfg.rope_dim} exceed what the "
                               f"attention kernels take on backend {model.backend!r} (latent <= {MAX_LATENT}, "
                               f"rope <= {MAX_ROPE}): use backend 'reference'")
        self.cfg, self.model, self.ops = cfg, model, model.ops
        self.num_depths, self.top_k, self.hidden_layers = cfg.num_depths, int(top_k), cfg.target_layers
        ops, d = self.ops, cfg.hidden_size
        self.fc = [ops.dense_weight(weights["fc.weight"][:, i * d:(i + 1) * d]) for i in range(len(cfg.target_layers))]
        self.fc_norm = ops.upload(weights["fc_norm.weight"])
        self.mask_table = ops.upload(weights["mask_embedding"].reshape(1, d))
        self.layers = [self._load_layer(weights, k) for k in range(cfg.num_layers)]
        self.norm = ops.upload(weights["norm.weight"])
        # every position a draft can touch: committed rows < the target's positions, then one block
        self.max_rows = model.cfg.max_position_embeddings + cfg.block_size
        cos, sin = drafter_rope_cos_sin(cfg, np.arange(self.max_rows))
        self.rope = rope.RopeTable(ops.upload(cos.astype(np.float32)), ops.upload(sin.astype(np.float32)))
        self.positions = ops.upload(np.arange(self.max_rows, dtype=np.int64))
        self.mask_ids = ops.upload(np.zeros(cfg.num_depths, dtype=np.int64))
        self.visibility = ops.upload(pack_visibility(np.ones((cfg.block_size, cfg.block_size), dtype=bool)))
        self.kv_rows = None  # latent rows [layers, rows, c + r]: context 0..P-1, block P..P+L (grown on demand)

    def _load_layer(self, weights: dict, k: int) -> dict:
        ops = self.ops

        def w(name):
            return weights[f"layers.{k}.{name}.weight"]
        return {"input_norm": ops.upload(w("input_norm")), "q_lat": ops.dense_weight(w("q_lat")),
                "q_pe": ops.dense_weight(w("q_pe")), "kv": ops.dense_weight(w("kv")),
                "kv_ctx": ops.dense_weight(w("kv_ctx")), "kv_norm": ops.upload(w("kv_norm")),
                "o_proj": ops.dense_weight(w("o_proj")), "post_norm": ops.upload(w("post_norm")),
                "gate_up": ops.dense_weight(np.concatenate([w("gate_proj"), w("up_proj")])),
                "down": ops.dense_weight(w("down_proj"))}

    def _scratch(self, rows: int, capacity: int):
        """The latent rows, at least ``rows`` of them (allocated for the run's cache capacity plus a block)."""
        if self.kv_rows is None or self.kv_rows.shape[1] < rows:
            cfg = self.cfg
            size = min(max(rows, capacity + cfg.block_size), self.max_rows)
            self.kv_rows = cuda.device_array((cfg.num_layers, size, cfg.latent_dim + cfg.rope_dim), np.float32)
        return self.kv_rows

    def draft(self, committed_tokens, bonus_token: int, position: int, cache=None) -> tuple[np.ndarray, np.ndarray]:
        if cache is None:
            raise ValueError("a block drafter reads the target's hidden states: draft(..., cache=the run's cache)")
        if tuple(cache.hidden_layers) != self.hidden_layers:
            raise ValueError(f"the cache keeps hidden states {list(cache.hidden_layers)}, the drafter reads "
                             f"{list(self.hidden_layers)}")
        prefix = int(position)
        if not 0 <= prefix <= cache.length:
            raise ValueError(f"position {prefix} must be in 0..{cache.length} (the committed rows)")
        logits = self._logits(cache, prefix, int(bonus_token))
        logprobs = sampling.log_softmax_rows(logits, out=logits)
        ids, values, _ = sampling.topk_rows(logprobs, self.top_k)
        return self.ops.to_host(ids), self.ops.to_host(values)

    def _context(self, cache, prefix: int):
        """f [P, d] on the device: fc_norm of the tapped hidden states' projection."""
        eps, ops = self.cfg.rms_norm_eps, self.ops
        parts = [ops.linear(cache.hidden[slot, :prefix], w) for slot, w in enumerate(self.fc)]
        if len(parts) == 1:
            return rmsnorm.rms_norm(parts[0], self.fc_norm, eps)
        for part in parts[1:]:  # parts[0] += part; only the last call's norm is kept
            normed = rmsnorm.add_rms_norm(part, parts[0], self.fc_norm, eps)
        return normed

    def _logits(self, cache, prefix: int, bonus: int):
        """Logits [L, V] fp32 on the device of the block after ``prefix`` committed rows."""
        cfg, ops = self.cfg, self.ops
        s, h, c, r, eps = cfg.block_size, cfg.num_heads, cfg.latent_dim, cfg.rope_dim, cfg.rms_norm_eps
        if prefix + s > self.max_rows:
            raise ValueError(f"a block at {prefix} passes the drafter's {self.max_rows} positions")
        kv_rows = self._scratch(prefix + s, cache.capacity)
        block_positions = self.positions[prefix:prefix + s]
        context = self._context(cache, prefix) if prefix else None
        x = cuda.device_array((s, cfg.hidden_size), np.float32)
        embedding.embed_tokens(self.model.embed, np.array([bonus], dtype=np.int64), out=x[:1])
        embedding.embed_tokens(self.mask_table, self.mask_ids, out=x[1:])
        normed = rmsnorm.rms_norm(x, self.layers[0]["input_norm"], eps)
        for k, layer in enumerate(self.layers):
            q_lat = ops.linear(normed, layer["q_lat"]).reshape(s, h, c)
            q_pe = rope.apply_rope(ops.linear(normed, layer["q_pe"]).reshape(s, h, r), self.rope, block_positions)
            if prefix:
                kv_write.write_kv_rows(kv_rows, k, 0, ops.linear(context, layer["kv_ctx"]), layer["kv_norm"], eps,
                                       self.rope, self.positions[:prefix])
            kv_write.write_kv_rows(kv_rows, k, prefix, ops.linear(normed, layer["kv"]), layer["kv_norm"], eps,
                                   self.rope, block_positions)
            o_lat = mla_attention(q_lat, q_pe, kv_rows[k], prefix, self.visibility, cfg.softmax_scale)
            attn = ops.linear(o_lat.reshape(s, h * c), layer["o_proj"])
            mlp_in = rmsnorm.add_rms_norm(attn, x, layer["post_norm"], eps)
            delta = ops.linear(swiglu.silu_mul(ops.linear(mlp_in, layer["gate_up"])), layer["down"])
            weight = self.layers[k + 1]["input_norm"] if k + 1 < len(self.layers) else self.norm
            normed = rmsnorm.add_rms_norm(delta, x, weight, eps)
        return ops.linear(normed[1:], self.model.lm_head)
