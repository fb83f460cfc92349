"""The device model: the whole forward on the Numba kernels (backend ``cuda`` on a GPU, ``sim`` under the CUDA
simulator), implementing the model protocol of docs/architecture.md.

Dense projections (q/kv/o projections, the per-head absorb products, the dense and shared-expert GEMMs, the
router GEMM and the LM head) go through a vendor BLAS: cuBLAS via torch on ``cuda``, numpy's BLAS on host
copies under ``sim``. Everything else is Numba: embedding, RMSNorm (residual add fused), RoPE, the KV cache
write, MLA attention, the MoE router, the grouped routed experts, SiLU-mul, compaction, and (DeviceTreeOps)
argmax / sampling / tree build / accept.

Shapes (DeepSeek letters): s tokens, h heads, d hidden, c kv_lora_rank, n nope, r rope, v v_head_dim,
e experts, f moe_intermediate_size. Activations are float32; the cache is one array [layers, capacity, c + r].
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from numba_kernels import (embedding, kv_compact, kv_write, mla_attention, moe_experts, moe_router, rmsnorm, rope,
                           sampling, swiglu, tree_accept, tree_build)
from . import ddtree_ref
from .records import TARGET_TOPK
from .config import ModelConfig
from .reference import rope_cos_sin, split_kv_b
from .weights import check_weights


MAX_CAUSAL_MASKS = 16  # token counts whose causal mask stays on the device
MAX_GRAPH_SHAPES = 8  # token counts with captured graphs (AR: 1; DDTree: the verify size; a few cut trees)


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


class _SimOps:
    """Under the simulator: device arrays are simulator arrays; dense products run in numpy (float32 BLAS)."""

    name = "sim"

    def upload(self, a: np.ndarray):
        return cuda.to_device(np.ascontiguousarray(a))

    def dense_weight(self, w: np.ndarray):
        return np.ascontiguousarray(w, dtype=np.float32)

    @staticmethod
    def _host(x):
        return x._ary if hasattr(x, "_ary") else np.asarray(x)  # the simulator's array, no copy

    def linear(self, x, w):
        """x [s, in] device, w [out, in] -> device [s, out]."""
        return cuda.to_device(self._host(x) @ w.T)

    def heads_matmul(self, x, w, transpose_w: bool):
        """Per head: x [s, h, a] @ w[h] ([h, a, b], or [h, b, a] transposed) -> device [s, h, b]."""
        xh = self._host(x)
        return cuda.to_device(np.ascontiguousarray(np.einsum("sha,hba->shb" if transpose_w else "sha,hab->shb",
                                                             xh, w)))

    def to_host(self, x) -> np.ndarray:
        return np.array(self._host(x))


class _Unsynced:
    """A device array's interface without its stream field (torch would otherwise wait on that stream)."""

    def __init__(self, array):
        self.array = array
        self.__cuda_array_interface__ = {**array.__cuda_array_interface__, "stream": None}


class _TorchOps:
    """On a GPU: dense products through cuBLAS (torch); numba kernels share torch's current stream."""

    name = "cuda"

    def __init__(self, weight_dtype: str):
        import torch
        self.torch = torch
        self.weight_dtype = torch.bfloat16 if weight_dtype == "bfloat16" else torch.float32
        from . import cuda_graphs  # GPU only (the simulator has no memory-manager plugins)
        cuda_graphs.use_torch_allocator()  # graph capture needs it; eager launches allocate faster too
        self.segment_graphs = cuda_graphs.SegmentGraphs

    def upload(self, a: np.ndarray):
        return cuda.to_device(np.ascontiguousarray(a))

    def dense_weight(self, w: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to("cuda", self.weight_dtype)

    def _t(self, x):
        return self.torch.as_tensor(_Unsynced(x), device="cuda")

    @staticmethod
    def _numba(t):
        """A Numba view of torch tensor ``t``. Without the interface's stream field: every launch and product
        runs on one stream in order, and a stream sync would stop a graph capture."""
        return cuda.from_cuda_array_interface({**t.__cuda_array_interface__, "stream": None}, owner=t, sync=False)

    def _x(self, x, w):
        # bf16 weights: the GEMM reads bf16 operands on the tensor cores with fp32 accumulation, so the
        # activation is rounded to bf16 too; fp32 weights keep the whole product in fp32.
        x = self._t(x)
        return x if w.dtype == self.torch.float32 else x.to(w.dtype)

    def _product(self, op, a, b):
        """a @ b (mm or bmm) with an fp32 result. bf16 operands write fp32 straight from the accumulator
        (out_dtype): a bf16-rounded output would round differently for different row counts (cuBLAS picks
        its kernel by shape), and a verify forward must agree with the AR forward at near-ties."""
        if a.dtype == self.torch.float32:
            return op(a, b)
        try:
            return op(a, b, out_dtype=self.torch.float32)
        except (TypeError, NotImplementedError, RuntimeError):  # torch < 2.9, or no such kernel here
            return op(a, b).float()

    def linear(self, x, w):
        out = self._product(self.torch.mm, self._x(x, w), w.t())
        return self._numba(out.contiguous())

    def heads_matmul(self, x, w, transpose_w: bool):
        xh = self._x(x, w).transpose(0, 1)  # [h, s, a]
        out = self._product(self.torch.bmm, xh, w.transpose(1, 2) if transpose_w else w)  # [h, s, b]
        return self._numba(out.transpose(0, 1).contiguous())

    def to_host(self, x) -> np.ndarray:
        return x.copy_to_host() if hasattr(x, "copy_to_host") else self._t(x).cpu().numpy()

    def copy(self, x):
        return self._numba(self._t(x).clone())


class DeviceLogits:
    """Logits [s, V] float32 left on the device: token choice runs there; ``np.asarray`` copies them to the
    host once, only when something (a step record) reads them."""

    def __init__(self, device, to_host):
        self.device, self._to_host, self._host = device, to_host, None
        self._topk = None  # (k, device ids, values, margins) when token choice already ran the top-k

    @property
    def shape(self):
        return tuple(self.device.shape)

    def __len__(self) -> int:
        return self.device.shape[0]

    def __getitem__(self, key) -> "DeviceLogits":
        return DeviceLogits(self.device[key], self._to_host)

    def rows(self, indices) -> np.ndarray:
        """Host copy of the rows ``indices`` only (e.g. the accepted nodes): float32 [len(indices), V]."""
        if self._host is not None:
            return self._host[np.asarray(indices)]
        return np.stack([self._to_host(self.device[int(i):int(i) + 1])[0] for i in indices])

    def topk(self, k: int):
        """Per row on the device: (ids int32 [s, k], values float32 [s, k], top1 - top2 margin float32 [s]);
        past V padded with -1 / NaN, ties -> lower id (as engine.records.target_topk)."""
        s, vocab = self.shape
        width = min(k, vocab)
        if self._topk is not None and self._topk[0] == width:
            found = self._topk[1:]
        else:
            found = sampling.topk_rows(self.device, width)
        ids, values, margins = (a if isinstance(a, np.ndarray) else self._to_host(a) for a in found)
        if width < k:
            ids = np.concatenate([ids, np.full((s, k - width), -1, np.int32)], axis=1)
            values = np.concatenate([values, np.full((s, k - width), np.nan, np.float32)], axis=1)
        return ids, values, margins

    def __array__(self, dtype=None, copy=None):
        if self._host is None:
            self._host = self._to_host(self.device)
        return self._host if dtype is None else self._host.astype(dtype)


class DeviceCache:
    """The MLA cache on the device: kv [layers, capacity, c + r] float32, rows [normed latent | roped k_pe]."""

    def __init__(self, cfg: ModelConfig, capacity: int):
        self.kv = cuda.device_array((cfg.num_hidden_layers, capacity, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                                    dtype=np.float32)
        self.latent = cfg.kv_lora_rank
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[1]

    @property
    def c(self):
        """Per layer latent rows [capacity, c] (device views), as the golden cache names them."""
        return [self.kv[layer, :, :self.latent] for layer in range(self.kv.shape[0])]

    @property
    def k_pe(self):
        return [self.kv[layer, :, self.latent:] for layer in range(self.kv.shape[0])]


class DeviceModel:
    """The model protocol on the Numba kernels. ``backend`` "cuda" (torch + a GPU) or "sim" (simulator);
    ``graphs``: on cuda, replay captured CUDA graphs of the layer stack (engine/cuda_graphs.py)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], backend: str, weight_dtype: str = "float32",
                 graphs: bool = True):
        if backend not in ("cuda", "sim"):
            raise ValueError(f"device backend must be 'cuda' or 'sim', got {backend!r}")
        if weight_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"weight_dtype must be 'float32' or 'bfloat16', got {weight_dtype!r}")
        check_weights(cfg, weights)
        self.cfg, self.backend, self.weight_dtype = cfg, backend, weight_dtype
        self.ops = _SimOps() if backend == "sim" else _TorchOps(weight_dtype)
        self.max_cache_rows = cfg.max_position_embeddings
        ops, bf16 = self.ops, weight_dtype == "bfloat16"
        cos, sin = rope_cos_sin(cfg, np.arange(cfg.max_position_embeddings, dtype=np.int64))
        self.rope = rope.RopeTable(ops.upload(cos.astype(np.float32)), ops.upload(sin.astype(np.float32)))
        table = weights["model.embed_tokens.weight"]
        self.embed = ops.upload(_bf16_bits(table) if bf16 else table)
        self.final_norm = ops.upload(weights["model.norm.weight"])
        self.lm_head = ops.dense_weight(weights["model.embed_tokens.weight" if cfg.tie_word_embeddings
                                                else "lm_head.weight"])
        self.layers = [self._load_layer(weights, i) for i in range(cfg.num_hidden_layers)]
        self.use_graphs = backend == "cuda" and graphs
        self._graphs, self._shapes_seen = {}, {}
        self._causal_masks = {}  # s -> device mask; an AR step must not pay an upload (alloc + synced copy)

    def _load_layer(self, weights, i: int) -> dict:
        cfg, ops = self.cfg, self.ops
        p = f"model.layers.{i}."
        w = lambda name: weights[p + name]  # noqa: E731
        layer = dict(input_norm=ops.upload(w("input_layernorm.weight")),
                     post_norm=ops.upload(w("post_attention_layernorm.weight")),
                     kv_a=ops.dense_weight(w("self_attn.kv_a_proj_with_mqa.weight")),
                     kv_norm=ops.upload(w("self_attn.kv_a_layernorm.weight")),
                     o_proj=ops.dense_weight(w("self_attn.o_proj.weight")))
        if cfg.q_lora_rank is None:
            layer["q_proj"] = ops.dense_weight(w("self_attn.q_proj.weight"))
        else:
            layer["q_a"] = ops.dense_weight(w("self_attn.q_a_proj.weight"))
            layer["q_norm"] = ops.upload(w("self_attn.q_a_layernorm.weight"))
            layer["q_b"] = ops.dense_weight(w("self_attn.q_b_proj.weight"))
        w_uk, w_uv = split_kv_b(cfg, w("self_attn.kv_b_proj.weight"))  # [h, n, c], [h, v, c]
        layer["w_uk"] = ops.dense_weight(np.asarray(w_uk, dtype=np.float32))
        layer["w_uv"] = ops.dense_weight(np.asarray(w_uv, dtype=np.float32))
        if cfg.is_moe_layer(i):
            bf16 = self.weight_dtype == "bfloat16"
            stack = lambda names: np.stack([np.concatenate([w(f"mlp.experts.{e}.{n}.weight") for n in names])  # noqa: E731
                                            for e in range(cfg.n_routed_experts)])
            gate_up, down = stack(("gate_proj", "up_proj")), stack(("down_proj",))
            layer["experts_gate_up"] = ops.upload(_bf16_bits(gate_up) if bf16 else gate_up)  # [e, 2f, d]
            layer["experts_down"] = ops.upload(_bf16_bits(down) if bf16 else down)  # [e, d, f]
            layer["router"] = ops.dense_weight(w("mlp.gate.weight"))
            layer["router_bias"] = ops.upload(w("mlp.gate.e_score_correction_bias"))
            if cfg.n_shared_experts:
                layer["ffn_gate_up"] = ops.dense_weight(np.concatenate([w("mlp.shared_experts.gate_proj.weight"),
                                                                        w("mlp.shared_experts.up_proj.weight")]))
                layer["ffn_down"] = ops.dense_weight(w("mlp.shared_experts.down_proj.weight"))
        else:
            layer["ffn_gate_up"] = ops.dense_weight(np.concatenate([w("mlp.gate_proj.weight"),
                                                                    w("mlp.up_proj.weight")]))
            layer["ffn_down"] = ops.dense_weight(w("mlp.down_proj.weight"))
        return layer

    # -- model protocol ------------------------------------------------------------------------------
    def new_cache(self, capacity: int) -> DeviceCache:
        if not isinstance(capacity, (int, np.integer)) or not 1 <= capacity <= self.max_cache_rows:
            raise ValueError(f"cache capacity must be in 1..{self.max_cache_rows}, got {capacity!r}")
        return DeviceCache(self.cfg, int(capacity))

    def forward(self, cache: DeviceCache, tokens, positions, visibility=None):
        """Logits float32 [s, V] for ``tokens`` at ``positions`` (cuda: DeviceLogits, left on the device;
        sim: a numpy array); writes cache rows length..length+s-1.

        The layer stack runs as segments (engine/cuda_graphs.py): on cuda with graphs on, a token count seen
        before replays its captured segments, with the cache write and attention launched between them."""
        cfg, ops = self.cfg, self.ops
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        s = tokens.shape[0]
        if tokens.ndim != 1 or s < 1 or positions.shape != (s,):
            raise ValueError(f"tokens and positions must be 1-D of one length, got {tokens.shape}, {positions.shape}")
        if cache.length + s > cache.capacity:
            raise ValueError(f"{s} new rows after {cache.length} exceed the cache capacity {cache.capacity}")
        if positions.min() < 0 or positions.max() >= cfg.max_position_embeddings:
            raise ValueError(f"positions must be in 0..{cfg.max_position_embeddings - 1}")
        if visibility is None:
            mask = self._causal_mask(s)
        else:
            mask = ops.upload(mla_attention.pack_visibility(np.asarray(visibility, dtype=bool)))
        graphs = self._graphs_for(s)
        if graphs is None:
            state = self._new_state(s)
            state["tokens"].copy_to_device(tokens)
            state["positions"].copy_to_device(positions)
            for k in range(len(self.layers) + 1):
                self._run_segment(k, state, 0)
                if k < len(self.layers):
                    self._attend(k, state, cache, mask)
        else:
            state = graphs.state
            state["tokens"].copy_to_device(tokens)
            state["positions"].copy_to_device(positions)
            for k in range(len(self.layers) + 1):
                graphs.replay(k)
                if k < len(self.layers):
                    self._attend(k, state, cache, mask)
        logits = state["logits"]
        if self.backend == "sim":  # no real device: records read the host array directly (the simulated
            return ops.to_host(logits)  # top-k kernel would cost seconds per step in Python)
        if graphs is not None:  # the graph's logits buffer is overwritten by the next step of this shape
            logits = ops.copy(logits)
        return DeviceLogits(logits, ops.to_host)

    def _causal_mask(self, s: int):
        """The device causal mask for s tokens, uploaded once per token count (kernels only read it)."""
        mask = self._causal_masks.get(s)
        if mask is None:
            mask = self.ops.upload(mla_attention.causal_visibility(s))
            if len(self._causal_masks) < MAX_CAUSAL_MASKS:  # prefills of many lengths must not pile up
                self._causal_masks[s] = mask
        return mask

    # -- segments (engine/cuda_graphs.py) -----------------------------------------------------------
    def _new_state(self, s: int) -> dict:
        """The arrays that cross segment boundaries for s tokens (graph inputs / outputs, attention output)."""
        cfg = self.cfg
        return dict(tokens=cuda.device_array(s, np.int64), positions=cuda.device_array(s, np.int64),
                    o_lat=cuda.device_array((s, cfg.num_attention_heads, cfg.kv_lora_rank), np.float32))

    def _graphs_for(self, s: int):
        """The captured segments for s tokens, or None to run eagerly. A shape is captured the second time it
        is seen (the first run compiles every kernel and warms cuBLAS); prefills (one-off shapes) stay eager."""
        if not self.use_graphs:
            return None
        if s in self._graphs:
            return self._graphs[s]
        seen = self._shapes_seen.get(s, 0) + 1
        self._shapes_seen[s] = seen
        if seen < 2 or len(self._graphs) >= MAX_GRAPH_SHAPES:
            return None
        self._graphs[s] = self.ops.segment_graphs(self.ops.torch, self._run_segment, len(self.layers) + 1,
                                                    self._new_state(s))
        return self._graphs[s]

    def _run_segment(self, k: int, state: dict, stream) -> None:
        """Segment k: k = 0 embeds; 0 < k <= L finishes layer k-1 from its attention output; k < L then
        normalises and projects layer k (q_lat, q_pe, kv_a for the eager cache write and attention);
        k = L ends with the final norm and the LM head (state["logits"]). Graph mode: ``state`` keeps what the
        captures left there, so nothing a later segment or an attention reads may be overwritten by another."""
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        if k == 0:
            state["residual"] = embedding.embed_tokens(self.embed, state["tokens"], stream=stream)
            normed = rmsnorm.rms_norm(state["residual"], self.layers[0]["input_norm"], eps, stream=stream)
        else:
            layer = self.layers[k - 1]
            s = state["o_lat"].shape[0]
            o = ops.heads_matmul(state["o_lat"], layer["w_uv"], transpose_w=True)  # [s, h, v]
            attn = ops.linear(o.reshape(s, cfg.num_attention_heads * cfg.v_head_dim), layer["o_proj"])
            normed = rmsnorm.add_rms_norm(attn, state["residual"], layer["post_norm"], eps, stream=stream)
            delta = (self._moe(layer, normed, stream) if cfg.is_moe_layer(k - 1)
                     else self._dense_ffn(layer, normed, stream))
            weight = self.final_norm if k == len(self.layers) else self.layers[k]["input_norm"]
            normed = rmsnorm.add_rms_norm(delta, state["residual"], weight, eps, stream=stream)
        if k == len(self.layers):
            state["logits"] = ops.linear(normed, self.lm_head)
            return
        layer = self.layers[k]
        h, n, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        s = normed.shape[0]
        if cfg.q_lora_rank is None:
            q = ops.linear(normed, layer["q_proj"])
        else:
            q_a = rmsnorm.rms_norm(ops.linear(normed, layer["q_a"]), layer["q_norm"], eps, stream=stream)
            q = ops.linear(q_a, layer["q_b"])
        q = q.reshape(s, h, n + r)
        # One entry per layer: a replay runs all segments, and attention i must read layer i's arrays.
        state[("q_pe", k)] = rope.apply_rope(q[:, :, n:], self.rope, state["positions"], stream=stream)
        state[("q_lat", k)] = ops.heads_matmul(q[:, :, :n], layer["w_uk"], transpose_w=False)  # [s, h, c]
        state[("kv_a", k)] = ops.linear(normed, layer["kv_a"])

    def _attend(self, i: int, state: dict, cache: DeviceCache, mask) -> None:
        """Layer i's cache write and attention (eager: both take the cache length as a launch scalar)."""
        cfg = self.cfg
        kv_write.write_kv_rows(cache.kv, i, cache.length, state[("kv_a", i)], self.layers[i]["kv_norm"],
                               cfg.rms_norm_eps, self.rope, state["positions"])
        mla_attention.mla_attention(state[("q_lat", i)], state[("q_pe", i)], cache.kv[i], cache.length, mask,
                                    cfg.softmax_scale, out=state["o_lat"])

    def _dense_ffn(self, layer, x, stream):
        gate_up = self.ops.linear(x, layer["ffn_gate_up"])
        return self.ops.linear(swiglu.silu_mul(gate_up, stream=stream), layer["ffn_down"])

    def _moe(self, layer, x, stream):
        cfg = self.cfg
        bias = None if cfg.topk_method == "greedy" else layer["router_bias"]  # greedy routing ignores the bias
        expert_ids, expert_weights = moe_router.route_experts(self.ops.linear(x, layer["router"]), bias,
                                                              **moe_router.router_options(cfg), stream=stream)
        if cfg.n_shared_experts:
            shared = self._dense_ffn(layer, x, stream)
            return moe_experts.moe_experts(x, expert_ids, expert_weights, layer["experts_gate_up"],
                                           layer["experts_down"], out=shared, accumulate=True, stream=stream)
        return moe_experts.moe_experts(x, expert_ids, expert_weights, layer["experts_gate_up"], layer["experts_down"],
                                       stream=stream)

    def commit(self, cache: DeviceCache, s: int) -> None:
        cache.length += int(s)

    def compact(self, cache: DeviceCache, accepted) -> None:
        accepted = np.asarray(accepted, dtype=np.int32)
        kv_compact.compact_rows(cache.kv, np.array([cache.length], np.int32), accepted[None, :],
                                np.array([len(accepted)], np.int32))
        cache.length += len(accepted)


class DeviceTreeOps:
    """Token choice, tree build and accept on the device kernels (one request per launch here)."""

    @staticmethod
    def choose_tokens(logits, temperature: float, seed: int, positions: np.ndarray) -> np.ndarray:
        """logits: DeviceLogits (chosen where they are) or a host array [s, V] (uploaded)."""
        kept = logits if isinstance(logits, DeviceLogits) else None
        logits = (logits.device if kept is not None
                  else cuda.to_device(np.ascontiguousarray(logits, dtype=np.float32)))
        if temperature == 0 and kept is not None and logits.shape[1] >= TARGET_TOPK:
            # Greedy choice = the first of the top-k (same tie rule); the step record then reuses the top-k
            # instead of another pass over the vocabulary.
            top_ids, top_values, margins = sampling.topk_rows(logits, TARGET_TOPK)
            host_ids = top_ids.copy_to_host()
            kept._topk = (TARGET_TOPK, host_ids, top_values, margins)  # ids already here: one copy fewer
            ids = host_ids[:, 0]
        elif temperature == 0:
            ids = sampling.argmax_rows(logits)
        else:
            ids = sampling.sample_rows(logits, float(temperature), int(seed), np.asarray(positions, dtype=np.int64))
        ids = ids.copy_to_host() if hasattr(ids, "copy_to_host") else np.asarray(ids)
        return ids.astype(np.int64)

    @staticmethod
    def build_tree(draft_logprobs, draft_ids, root_token: int, budget: int, prefix_len: int) -> ddtree_ref.Tree:
        ddtree_ref.check_draft(draft_logprobs, draft_ids, budget)
        batch = tree_build.build_trees(np.ascontiguousarray(draft_logprobs[None], dtype=np.float32),
                                       np.ascontiguousarray(draft_ids[None], dtype=np.int32),
                                       np.array([root_token], np.int32), np.array([prefix_len], np.int32), budget)
        built = {name: values[0] for name, values in batch.to_host().items()}  # three device reads in all
        count = int(built["num_nodes"])
        bits = built["visibility"][:count]  # [N+1, W] uint32, bit j of row i: j is an ancestor-or-self of i
        visibility = ((bits[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(count, -1)[:, :count]
        return ddtree_ref.Tree(tokens=built["tokens"][:count].astype(np.int64), parents=built["parents"][:count],
                               depths=built["depths"][:count], ranks=built["ranks"][:count],
                               scores=built["scores"][:count], positions=built["positions"][:count].astype(np.int64),
                               visibility=visibility.astype(bool))

    @staticmethod
    def accept(parents, tokens, target_choice) -> tuple[np.ndarray, int]:
        count = len(parents)
        depth_limit = count  # a path has at most num_nodes nodes
        accepted, tau, bonus = tree_accept.accept_trees(np.asarray(parents, np.int32)[None],
                                                        np.asarray(tokens, np.int32)[None],
                                                        np.asarray(target_choice, np.int32)[None],
                                                        np.array([count], np.int32), depth_limit)
        host = lambda a: a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)  # noqa: E731
        tau = int(host(tau)[0])
        return host(accepted)[0, :tau].astype(np.int32), int(host(bonus)[0])
