"""The device model: the whole forward on the Numba kernels (backend ``cuda`` on a GPU, ``sim`` under the CUDA
simulator), implementing the model protocol of docs/architecture.md.

Dense projections (q/kv/o projections, the per-head absorb products, the dense and shared-expert GEMMs, the
router GEMM and the LM head) go through a vendor BLAS: cuBLAS via torch on ``cuda``, numpy's BLAS on host
copies under ``sim``. Everything else is Numba: embedding, RMSNorm (residual add fused), RoPE, the KV cache
write, MLA attention, the MoE router, the grouped routed experts, SiLU-mul, compaction (tree_ops.py: argmax /
sampling / tree build / accept). ops.py holds the two backends' dense products, cache.py the KV cache,
logits.py the logits left on the device.

Shapes (DeepSeek letters): s tokens, h heads, d hidden, c kv_lora_rank, n nope, r rope, v v_head_dim,
e experts, f moe_intermediate_size. Activations are float32; the cache is one array [layers, capacity, c + r].

Batch invariance (on by default with bf16 weights): every row of a forward gets the bits it would get in a
forward of any other number of rows, so a tree-verify forward equals the 1-row AR forwards of each node's path
bit for bit and DDTree's output is the engine's own AR output in bf16 too. The dense products run at one fixed
row count (ops.TorchOps' fixed_rows), attention through attention/invariant.py (keys in compacted order; with bf16
weights its tensor-core form attention/invariant_tc.py, ``tensor_core_attention``: tf32 operands, fp32 sums);
everything else is per row already (norms, RoPE, router). The routed experts of the batch-invariant bf16 model
run through torch's grouped GEMM on cuda (``grouped_experts``, grouped_experts.py: gate, up and down rounded to
bf16 as that GEMM writes them); where it cannot run (the simulator, GPUs before Hopper) on the Numba tensor
cores (``tensor_core_experts``, when d and f are multiples of 32: moe/experts_tc.py, bf16 activations as the
dense products have; their launch shape follows the token count without changing a token's bits); otherwise the
SIMT grouped experts, whose launch shape does not depend on the token count.
"""
from __future__ import annotations

import weakref

import numpy as np
from numba import cuda

from kdspec.engine.device.cache import DeviceCache
from kdspec.engine.device.grouped_experts import grouped_experts, grouped_experts_supported
from kdspec.engine.device.logits import DeviceLogits
from kdspec.engine.device.ops import SimOps, TorchOps
from kdspec.engine.golden.model import check_hidden_layers, rope_cos_sin, split_kv_b
from kdspec.engine.model.config import ModelConfig
from kdspec.engine.model.safetensors_io import float32_to_bf16_bits
from kdspec.engine.model.weights import SeededWeights, check_weights
from kdspec.numba_kernels import embedding, kv_write, rmsnorm, rope
from kdspec.numba_kernels.attention.common import causal_visibility, pack_visibility
from kdspec.numba_kernels.attention.dispatch import mla_attention
from kdspec.numba_kernels.attention import invariant_tc
from kdspec.numba_kernels.attention.invariant import mla_attention_invariant, visible_keys
from kdspec.numba_kernels.host_arrays import is_device_array
from kdspec.numba_kernels.moe import experts as moe_experts
from kdspec.numba_kernels.moe import experts_tc as moe_experts_tc
from kdspec.numba_kernels.moe import router as moe_router
from kdspec.numba_kernels.moe import swiglu
from kdspec.numba_kernels.tree import compact as kv_compact

MAX_CAUSAL_MASKS = 16  # token counts whose causal mask (and key table) stays on the device
MAX_GRAPH_SHAPES = 8  # token counts with captured graphs (AR: 1; DDTree: the verify size; a few cut trees)
INVARIANT_ROWS = 128  # rows of every dense product in batch-invariant mode (budget 127 in one call, 255 in two)


class DeviceModel:
    """The model protocol on the Numba kernels. ``backend`` "cuda" (torch + a GPU) or "sim" (simulator);
    ``graphs``: on cuda, replay captured CUDA graphs of the layer stack (engine/cuda_graphs.py);
    ``batch_invariant``: see the module docstring (None: on with bf16 weights, off with fp32);
    ``grouped_experts``: the routed experts through torch's grouped GEMM (engine/device/grouped_experts.py: cuda on
    a Hopper GPU or newer, bf16 weights, d and f multiples of 8; None: on for the batch-invariant bf16 model where
    allowed); ``tensor_core_experts``: the routed experts on the Numba tensor-core kernels instead (bf16 weights; d,
    f multiples of 32; None: on for the batch-invariant bf16 model where the grouped GEMM is not);
    ``tensor_core_attention``: the batch-invariant attention on the tensor cores (bf16 weights, batch-invariant;
    c + r a multiple of 4; None: on where allowed, on cuda)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], backend: str, weight_dtype: str = "float32",
                 graphs: bool = True, batch_invariant: bool | None = None, tensor_core_experts: bool | None = None,
                 tensor_core_attention: bool | None = None, grouped_experts: bool | None = None):
        if backend not in ("cuda", "sim"):
            raise ValueError(f"device backend must be 'cuda' or 'sim', got {backend!r}")
        if weight_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"weight_dtype must be 'float32' or 'bfloat16', got {weight_dtype!r}")
        check_weights(cfg, weights)
        self.cfg, self.backend, self.weight_dtype = cfg, backend, weight_dtype
        self.batch_invariant = weight_dtype == "bfloat16" if batch_invariant is None else bool(batch_invariant)
        if tensor_core_experts and (weight_dtype != "bfloat16" or not moe_experts_tc.supports(
                cfg.hidden_size, cfg.moe_intermediate_size)):
            raise ValueError(f"tensor_core_experts needs bf16 weights and hidden_size, moe_intermediate_size multiples "
                             f"of {moe_experts_tc.CHUNK} (got {weight_dtype}, {cfg.hidden_size}, "
                             f"{cfg.moe_intermediate_size})")
        grouped_allowed = backend == "cuda" and weight_dtype == "bfloat16" and not tensor_core_experts and \
            grouped_experts_supported(cfg.hidden_size, cfg.moe_intermediate_size)
        if grouped_experts and not grouped_allowed:
            raise ValueError(f"grouped_experts needs the cuda backend on a Hopper GPU or newer, bf16 weights and "
                             f"hidden_size, moe_intermediate_size multiples of 8, and replaces tensor_core_experts "
                             f"(got {backend}, {weight_dtype}, {cfg.hidden_size}, {cfg.moe_intermediate_size}, "
                             f"tensor_core_experts={tensor_core_experts})")
        self.grouped_experts = grouped_allowed and self.batch_invariant if grouped_experts is None \
            else bool(grouped_experts)
        if tensor_core_experts is None:
            tensor_core_experts = not self.grouped_experts and self.batch_invariant and weight_dtype == "bfloat16" \
                and moe_experts_tc.supports(cfg.hidden_size, cfg.moe_intermediate_size)
        self.tensor_core_experts = bool(tensor_core_experts)
        attention_tc_allowed = self.batch_invariant and weight_dtype == "bfloat16" and invariant_tc.supports(
            cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        if tensor_core_attention and not attention_tc_allowed:
            raise ValueError(f"tensor_core_attention needs bf16 weights, batch invariance and kv_lora_rank + "
                             f"qk_rope_head_dim a multiple of 4 (got {weight_dtype}, batch_invariant="
                             f"{self.batch_invariant}, {cfg.kv_lora_rank} + {cfg.qk_rope_head_dim})")
        # (off by default under the simulator, whose mma model runs 5x slower than the fp32 kernel there; tests
        # ask for it by name)
        self.tensor_core_attention = attention_tc_allowed and backend == "cuda" if tensor_core_attention is None \
            else bool(tensor_core_attention)
        self.ops = (SimOps(row_by_row=self.batch_invariant) if backend == "sim"
                    else TorchOps(weight_dtype, INVARIANT_ROWS if self.batch_invariant else None))
        self.max_cache_rows = cfg.max_position_embeddings
        ops, bf16 = self.ops, weight_dtype == "bfloat16"
        # A seeded preset on cuda is drawn on the GPU, tensor by tensor (the host's bits, no host copy and no
        # upload: seconds for k2-mini); anything else is read on the host and copied.
        self._drawn = backend == "cuda" and isinstance(weights, SeededWeights)
        weight = (lambda name: weights.draw(ops.torch, name)) if self._drawn else weights.__getitem__
        cos, sin = rope_cos_sin(cfg, np.arange(cfg.max_position_embeddings, dtype=np.int64))
        self.rope = rope.RopeTable(ops.upload(cos.astype(np.float32)), ops.upload(sin.astype(np.float32)))
        self.embed = ops.upload(weight("model.embed_tokens.weight"), bf16)
        self.final_norm = ops.upload(weight("model.norm.weight"))
        self.lm_head = ops.dense_weight(weight("model.embed_tokens.weight" if cfg.tie_word_embeddings
                                               else "lm_head.weight"))
        self.layers = [self._load_layer(weight, i) for i in range(cfg.num_hidden_layers)]
        self.use_graphs = backend == "cuda" and graphs
        self._graphs, self._shapes_seen = {}, {}
        self._causal_masks = {}  # s -> device mask; an AR step must not pay an upload (alloc + synced copy)
        self._key_tables = {}  # s -> VisibleKeys buffers of batch-invariant attention
        self.hidden_layers: tuple[int, ...] = ()  # hidden states the current cache keeps (new_cache)
        self._released = None  # (weak reference to the last cache made, its storage): reused once it is released

    def _load_layer(self, weight, i: int) -> dict:
        """Layer ``i``'s device weights; ``weight(name)`` gives a tensor (host array, or torch tensor on the GPU)."""
        cfg, ops = self.cfg, self.ops
        p = f"model.layers.{i}."
        w = lambda name: weight(p + name)  # noqa: E731
        cat = ops.torch.cat if self._drawn else np.concatenate
        layer = dict(input_norm=ops.upload(w("input_layernorm.weight")),
                     post_norm=ops.upload(w("post_attention_layernorm.weight")),
                     kv_norm=ops.upload(w("self_attn.kv_a_layernorm.weight")),
                     o_proj=ops.dense_weight(w("self_attn.o_proj.weight")))
        if cfg.q_lora_rank is None:
            layer["q_proj"] = ops.dense_weight(w("self_attn.q_proj.weight"))
            layer["kv_a"] = ops.dense_weight(w("self_attn.kv_a_proj_with_mqa.weight"))
        else:  # q_a and kv_a read the same input: one product [s, q_lora_rank + c + r]
            layer["q_kv_a"] = ops.dense_weight(cat([w("self_attn.q_a_proj.weight"),
                                                    w("self_attn.kv_a_proj_with_mqa.weight")]))
            layer["q_norm"] = ops.upload(w("self_attn.q_a_layernorm.weight"))
            layer["q_b"] = ops.dense_weight(w("self_attn.q_b_proj.weight"))
        w_uk, w_uv = split_kv_b(cfg, w("self_attn.kv_b_proj.weight"))  # [h, n, c], [h, v, c] float64, exact
        layer["w_uk"] = ops.dense_weight(w_uk if self._drawn else np.asarray(w_uk, dtype=np.float32))
        layer["w_uv"] = ops.dense_weight(w_uv if self._drawn else np.asarray(w_uv, dtype=np.float32))
        if cfg.is_moe_layer(i):
            names = lambda parts: [[f"{p}mlp.experts.{e}.{n}.weight" for n in parts]  # noqa: E731
                                   for e in range(cfg.n_routed_experts)]
            layer["experts_gate_up"] = self._upload_stacked(weight, names(("gate_proj", "up_proj")))  # [e, 2f, d]
            layer["experts_down"] = self._upload_stacked(weight, names(("down_proj",)))  # [e, d, f]
            layer["router"] = ops.dense_weight(w("mlp.gate.weight"))
            layer["router_bias"] = ops.upload(w("mlp.gate.e_score_correction_bias"))
            if cfg.n_shared_experts:
                layer["ffn_gate_up"] = ops.dense_weight(cat([w("mlp.shared_experts.gate_proj.weight"),
                                                             w("mlp.shared_experts.up_proj.weight")]))
                layer["ffn_down"] = ops.dense_weight(w("mlp.shared_experts.down_proj.weight"))
        else:
            layer["ffn_gate_up"] = ops.dense_weight(cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
            layer["ffn_down"] = ops.dense_weight(w("mlp.down_proj.weight"))
        return layer

    def _upload_stacked(self, weight, names: list[list[str]]):
        """Device [e, rows, cols] (float32, or bf16 bits as uint16) from each expert's row blocks ``names[e]``
        ([rows_i, cols] each, stacked along rows), read (or drawn) and copied block by block: no copy of the whole
        stack anywhere else (17 GB on k2-mini). For the tensor-core experts each block is stored in
        moe_experts_tc.fragment_layout (its rows are whole 16-row tiles: gate, up and down blocks alike)."""
        bf16 = self.weight_dtype == "bfloat16"
        laid = moe_experts_tc.fragment_layout if self.tensor_core_experts else (lambda block: block)
        first = [weight(name) for name in names[0]]
        rows, cols = sum(block.shape[0] for block in first), first[0].shape[1]
        if self._drawn:
            torch = self.ops.torch
            out = torch.empty((len(names), rows, cols), dtype=torch.bfloat16 if bf16 else torch.float32,
                              device="cuda")
        else:
            out = cuda.device_array((len(names), rows, cols), np.uint16 if bf16 else np.float32)
        for e, expert in enumerate(names):
            start = 0
            for block in first if e == 0 else map(weight, expert):
                if self._drawn:
                    out[e, start:start + block.shape[0]] = laid(block)  # torch rounds to bf16 to nearest even
                else:
                    host = float32_to_bf16_bits(block) if bf16 else np.ascontiguousarray(block, dtype=np.float32)
                    out[e, start:start + block.shape[0]].copy_to_device(laid(host))
                start += block.shape[0]
        return self.ops.device_view(out) if self._drawn else out

    # -- model protocol ------------------------------------------------------------------------------
    def new_cache(self, capacity: int, hidden_layers: tuple[int, ...] = ()) -> DeviceCache:
        """A cache of at least ``capacity`` rows (see below) keeping the hidden states of ``hidden_layers``."""
        if not isinstance(capacity, (int, np.integer)) or not 1 <= capacity <= self.max_cache_rows:
            raise ValueError(f"cache capacity must be in 1..{self.max_cache_rows}, got {capacity!r}")
        check_hidden_layers(self.cfg, hidden_layers)
        hidden_layers = tuple(int(i) for i in hidden_layers)
        if hidden_layers != self.hidden_layers:  # the captured segments copy the kept states out: capture anew
            self.hidden_layers, self._graphs, self._shapes_seen = hidden_layers, {}, {}
        # The last cache's device arrays, once nothing holds that cache, serve a new one that fits in them (its
        # capacity is then theirs, at least the one asked for): the step graphs (engine/device/step.py) captured
        # their addresses, and stay valid for the next decode.
        storage = None
        if self._released is not None:
            last, kept = self._released
            if last() is None and kept[0].shape[1] >= capacity and kept[1].shape[0] == len(hidden_layers):
                storage = kept
        cache = DeviceCache(self.cfg, int(capacity), hidden_layers, storage=storage)
        self._released = (weakref.ref(cache), cache.storage)
        return cache

    def hidden_rows(self, cache: DeviceCache, stop: int) -> np.ndarray:
        """The kept hidden states of rows 0..stop-1, copied to the host: float32 [n, stop, d]."""
        rows = [self.ops.to_host(cache.hidden[slot, :stop]) for slot in range(len(cache.hidden_layers)) if stop]
        return np.stack(rows) if rows else np.zeros((len(cache.hidden_layers), stop, self.cfg.hidden_size),
                                                    np.float32)

    def forward(self, cache: DeviceCache, tokens, positions, visibility=None):
        """Logits float32 [s, V] for ``tokens`` at ``positions`` (cuda: DeviceLogits, left on the device;
        sim: a numpy array); writes cache rows length..length+s-1. visibility: None (causal), bool [s, s], or
        the packed bitmask uint32 [s, W] already on the device (DeviceTreeOps.build_tree's), used as it is.

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
        elif is_device_array(visibility):  # already packed on the device (the tree build's bitmask)
            mask = visibility
        else:
            mask = ops.upload(pack_visibility(np.asarray(visibility, dtype=bool)))
        keys = self._visible_keys(mask, s) if self.batch_invariant else None
        graphs = self._graphs_for(s)
        if graphs is None:
            state = self._new_state(s)
            state["tokens"].copy_to_device(tokens)
            state["positions"].copy_to_device(positions)
            for k in range(len(self.layers) + 1):
                self._run_segment(k, state, 0)
                if k < len(self.layers):
                    self._attend(k, state, cache.kv, cache.length, mask, keys, 0)
        else:
            state = graphs.state
            state["tokens"].copy_to_device(tokens)
            state["positions"].copy_to_device(positions)
            for k in range(len(self.layers) + 1):
                graphs.replay(k)
                if k < len(self.layers):
                    self._attend(k, state, cache.kv, cache.length, mask, keys, 0)
        start = cache.length
        for slot in range(len(cache.hidden_layers)):
            cache.hidden[slot, start:start + s].copy_to_device(state[("hidden", slot)])
        logits = state["logits"]
        if self.backend == "sim":  # no real device: records read the host array directly (the simulated
            return ops.to_host(logits)  # top-k kernel would cost seconds per step in Python)
        if graphs is not None:  # the graph's logits buffer is overwritten by the next step of this shape
            logits = ops.copy(logits)
        return DeviceLogits(logits, ops.to_host)

    def _visible_keys(self, mask, s: int):
        """The compacted key table of this forward (attention/invariant.py): one for all its layers, written
        into a buffer kept per token count (a step must not pay an allocation)."""
        table = visible_keys(mask, s, out=self._key_tables.get(s))
        if s not in self._key_tables and len(self._key_tables) < MAX_CAUSAL_MASKS:
            self._key_tables[s] = table
        return table

    def _causal_mask(self, s: int):
        """The device causal mask for s tokens, uploaded once per token count (kernels only read it)."""
        mask = self._causal_masks.get(s)
        if mask is None:
            mask = self.ops.upload(causal_visibility(s))
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
        for slot, index in enumerate(self.hidden_layers):
            if index == k:  # the residual stream entering layer k (k = L: leaving the last one)
                state[("hidden", slot)] = ops.copy(state["residual"])
        if k == len(self.layers):
            state["logits"] = ops.linear(normed, self.lm_head)
            return
        layer = self.layers[k]
        h, n, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        s = normed.shape[0]
        if cfg.q_lora_rank is None:
            q = ops.linear(normed, layer["q_proj"])
            kv_a = ops.linear(normed, layer["kv_a"])
        else:
            q_kv_a = ops.linear(normed, layer["q_kv_a"])
            q_a = rmsnorm.rms_norm(q_kv_a[:, :cfg.q_lora_rank], layer["q_norm"], eps, stream=stream)
            q = ops.linear(q_a, layer["q_b"])
            kv_a = q_kv_a[:, cfg.q_lora_rank:]
        q = q.reshape(s, h, n + r)
        # One entry per layer: a replay runs all segments, and attention i must read layer i's arrays.
        state[("q_pe", k)] = rope.apply_rope(q[:, :, n:], self.rope, state["positions"], stream=stream)
        state[("q_lat", k)] = ops.heads_matmul(q[:, :, :n], layer["w_uk"], transpose_w=False)  # [s, h, c]
        state[("kv_a", k)] = kv_a

    def _attend(self, i: int, state: dict, kv, prefix, mask, keys, stream) -> None:
        """Layer i's cache write and attention into cache rows kv [layers, t, c + r] from row ``prefix`` on (the
        host's length, launched eagerly between segments; or the device's int32 [1] length cell inside a captured
        step, batch-invariant mode only); ``keys``: the compacted key table of batch-invariant mode (None
        otherwise)."""
        cfg = self.cfg
        kv_write.write_kv_rows(kv, i, prefix, state[("kv_a", i)], self.layers[i]["kv_norm"], cfg.rms_norm_eps,
                               self.rope, state["positions"], stream=stream)
        if keys is not None:
            invariant = invariant_tc.mla_attention_invariant_tc if self.tensor_core_attention \
                else mla_attention_invariant
            invariant(state[("q_lat", i)], state[("q_pe", i)], kv[i], prefix, mask, cfg.softmax_scale, keys=keys,
                      out=state["o_lat"], stream=stream)
        else:
            mla_attention(state[("q_lat", i)], state[("q_pe", i)], kv[i], prefix, mask, cfg.softmax_scale,
                          out=state["o_lat"], stream=stream)

    # -- the forward of a step on the device (engine/device/step.py) ----------------------------------
    def supports_device_steps(self, cache: DeviceCache) -> bool:
        """Whether a whole step can run on the device over ``cache``: batch-invariant attention (it reads the
        prefix length from the device) and no kept hidden states (their copy-out takes the length on the host)."""
        return self.batch_invariant and not cache.hidden_layers

    def new_step_state(self, s: int) -> dict:
        """The arrays one on-device forward of s tokens reads and writes (tokens and positions: rows of one
        int64 [2, s] buffer, ``ids``, so that the host uploads both in one copy)."""
        ids = cuda.device_array((2, s), np.int64)
        return dict(ids=ids, tokens=ids[0], positions=ids[1], o_lat=self._new_state(s)["o_lat"])

    def forward_on_device(self, state: dict, cache: DeviceCache, mask, key_table, stream) -> None:
        """The forward of ``state``'s tokens (new_step_state) with every launch on ``stream`` and nothing read
        back, so that a CUDA graph can capture it: the cache rows written from the device's length cell on,
        logits left in state["logits"] [s, V]. mask: the visibility bitmask uint32 [s, >= ceil(s/32)] on the
        device; key_table: a VisibleKeys buffer of s tokens (attention/invariant.py), filled here."""
        s = state["tokens"].shape[0]
        keys = visible_keys(mask, s, out=key_table, stream=stream)
        for k in range(len(self.layers) + 1):
            self._run_segment(k, state, stream)
            if k < len(self.layers):
                self._attend(k, state, cache.kv, cache.length_cell, mask, keys, stream)

    def _dense_ffn(self, layer, x, stream):
        gate_up = self.ops.linear(x, layer["ffn_gate_up"])
        return self.ops.linear(swiglu.silu_mul(gate_up, stream=stream), layer["ffn_down"])

    def _moe(self, layer, x, stream):
        cfg = self.cfg
        bias = None if cfg.topk_method == "greedy" else layer["router_bias"]  # greedy routing ignores the bias
        expert_ids, expert_weights = moe_router.route_experts(self.ops.linear(x, layer["router"]), bias,
                                                              **moe_router.router_options(cfg), stream=stream)
        if self.grouped_experts:
            out = self._dense_ffn(layer, x, stream) if cfg.n_shared_experts else \
                cuda.device_array(x.shape, np.float32, stream=stream)
            return grouped_experts(self.ops, x, expert_ids, expert_weights, layer["experts_gate_up"],
                                   layer["experts_down"], out=out, accumulate=bool(cfg.n_shared_experts),
                                   stream=stream)
        if cfg.n_shared_experts:
            shared = self._dense_ffn(layer, x, stream)
            return moe_experts.moe_experts(x, expert_ids, expert_weights, layer["experts_gate_up"],
                                           layer["experts_down"], out=shared, accumulate=True, stream=stream,
                                           tensor_cores=self.tensor_core_experts)
        return moe_experts.moe_experts(x, expert_ids, expert_weights, layer["experts_gate_up"], layer["experts_down"],
                                       stream=stream, tensor_cores=self.tensor_core_experts)

    def commit(self, cache: DeviceCache, s: int) -> None:
        cache.length += int(s)

    def compact(self, cache: DeviceCache, accepted) -> None:
        accepted = np.asarray(accepted, dtype=np.int32)
        if np.array_equal(accepted, np.arange(len(accepted))):
            # The accepted path is the first tau in-flight rows (the root and a chain of first children, as the
            # best-first build numbers them): every row is in place already, no kernel to launch.
            cache.length += len(accepted)
            return
        for rows in (cache.kv, cache.hidden) if cache.hidden_layers else (cache.kv,):
            kv_compact.compact_rows(rows, np.array([cache.length], np.int32), accepted[None, :],
                                    np.array([len(accepted)], np.int32))
        cache.length += len(accepted)
