"""The float64 golden reference model (docs/architecture.md, model protocol) and golden decoding.

The layers are the functions of engine/golden/layers.py, re-exported here. All arithmetic is float64; float32
weights are widened where used. ``ReferenceModel(cfg, weights)`` computes with numpy; ``device="cpu"`` or
``"cuda"`` runs the same functions on torch float64 tensors of that device (engine/golden/arrays.py): the weights
are widened there once, the cache lives there, and forward still returns numpy logits. ``decode`` hands back a
GoldenRun on the host either way.
Dimension letters: s query tokens, t key rows, c kv_lora_rank, r qk_rope_head_dim, V vocab.
"""
from __future__ import annotations

import numpy as np

from kdspec.engine.golden.arrays import TorchNumpy, to_host
from kdspec.engine.golden.ddtree import compaction_moves, move_rows
from kdspec.engine.golden.layers import (
    dense_mlp,
    f64,
    layer_weights,
    linear,
    mla_attention_absorbed,
    mla_attention_naive,
    mla_projections,
    moe,
    rms_norm,
    rope_cos_sin,
    split_kv_b,
)
from kdspec.engine.golden.sampling import choose_token
from kdspec.engine.model.config import ModelConfig
from kdspec.engine.model.weights import SeededWeights, check_weights


# --------------------------------------------------------------------------------------------- model
def check_hidden_layers(cfg: ModelConfig, hidden_layers) -> None:
    """Raise ValueError unless every index names a hidden state 0..num_hidden_layers."""
    bad = [i for i in hidden_layers if not 0 <= int(i) <= cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"hidden layer {bad[0]} does not exist: the model has hidden states "
                         f"0..{cfg.num_hidden_layers}")


class ReferenceCache:
    """Per layer: latent rows c [capacity, c] and rope keys k_pe [capacity, r], float64.

    ``length`` rows are committed; ``in_flight`` rows after them were written by the last forward and wait
    for commit() or compact(). ``hidden`` [n, capacity, d] keeps the residual stream at ``hidden_layers`` of
    every row (index i: the stream entering layer i; i == layers: the stream leaving the last layer, before the
    final norm), committed and compacted with the cache: what a block drafter reads. ``xp``: the array
    namespace (numpy, or arrays.TorchNumpy: the rows are then tensors on its device).
    """

    def __init__(self, cfg: ModelConfig, capacity: int, hidden_layers: tuple[int, ...] = (), xp=np):
        self.c = [xp.zeros((capacity, cfg.kv_lora_rank)) for _ in range(cfg.num_hidden_layers)]
        self.k_pe = [xp.zeros((capacity, cfg.qk_rope_head_dim)) for _ in range(cfg.num_hidden_layers)]
        self.hidden_layers = tuple(int(i) for i in hidden_layers)
        self.hidden = xp.zeros((len(self.hidden_layers), capacity, cfg.hidden_size))
        self.length = 0
        self.in_flight = 0

    @property
    def capacity(self) -> int:
        return self.c[0].shape[0]

    def to_host(self) -> ReferenceCache:
        """This cache with numpy rows (itself when they are numpy already)."""
        if isinstance(self.c[0], np.ndarray):
            return self
        host = object.__new__(ReferenceCache)
        host.c, host.k_pe = [to_host(rows) for rows in self.c], [to_host(rows) for rows in self.k_pe]
        host.hidden, host.hidden_layers = to_host(self.hidden), self.hidden_layers
        host.length, host.in_flight = self.length, self.in_flight
        return host


class ReferenceModel:
    """The golden model (docs/architecture.md, model protocol). ``absorbed=False`` uses naive MLA.

    ``device`` None computes with numpy; a torch device ("cpu", "cuda") with torch float64 tensors there (the
    weights widened to float64 on it once: 8 bytes a parameter).
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], absorbed: bool = True,
                 device: str | None = None):
        check_weights(cfg, weights)
        self.xp = np if device is None else TorchNumpy.of(device)
        if device is not None:
            weights = {name: self._widened(weights, name) for name in weights}
        self.cfg, self.weights, self.absorbed, self.device = cfg, weights, absorbed, device
        self.layers = [layer_weights(weights, i) for i in range(cfg.num_hidden_layers)]
        self.kv_b = [split_kv_b(cfg, lw["self_attn.kv_b_proj.weight"]) for lw in self.layers]  # (W_UK, W_UV)
        self.lm_head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]

    def _widened(self, weights, name: str):
        """Tensor ``name`` as float64 on this model's torch device: a seeded preset's drawn there (the same bits
        as on the host, without the host copy), a checkpoint's copied."""
        xp = self.xp
        if isinstance(weights, SeededWeights):
            return weights.draw(xp.torch, name, xp.device).to(xp.float64)
        return xp.asarray(weights[name], dtype=xp.float64)

    def new_cache(self, capacity: int, hidden_layers: tuple[int, ...] = ()) -> ReferenceCache:
        if not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"cache capacity must be a positive integer, got {capacity!r}")
        if capacity > self.cfg.max_position_embeddings:
            raise ValueError(f"cache capacity {capacity} exceeds max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        check_hidden_layers(self.cfg, hidden_layers)
        return ReferenceCache(self.cfg, int(capacity), hidden_layers, self.xp)

    def _check_forward(self, cache: ReferenceCache, tokens, positions, visibility):
        tokens, positions = np.asarray(tokens), np.asarray(positions)
        s = tokens.shape[0] if tokens.ndim == 1 else -1
        if s < 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a non-empty 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if positions.shape != (s,) or not np.issubdtype(positions.dtype, np.integer):
            raise ValueError(f"positions must be integer [{s}] like tokens, got {positions.dtype} {positions.shape}")
        if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in 0..{self.cfg.vocab_size - 1}, got {tokens.min()}..{tokens.max()}")
        if positions.min() < 0 or positions.max() >= self.cfg.max_position_embeddings:
            raise ValueError(f"positions must be in 0..{self.cfg.max_position_embeddings - 1}, "
                             f"got {positions.min()}..{positions.max()}")
        if cache.length + s > cache.capacity:
            raise ValueError(f"{s} new rows after {cache.length} do not fit the cache of {cache.capacity} rows")
        if visibility is None:
            visibility = np.tril(np.ones((s, s), dtype=bool))
        visibility = np.asarray(visibility)
        if visibility.shape != (s, s) or visibility.dtype != np.bool_:
            raise ValueError(f"visibility must be bool [{s}, {s}], got {visibility.dtype} {visibility.shape}")
        return tokens, positions, visibility

    def forward(self, cache: ReferenceCache, tokens, positions, visibility=None) -> np.ndarray:
        """Write rows cache.length.. for tokens [s] at positions [s]; return logits [s, V] float64.

        Query i sees every committed row and in-flight row j where visibility[i, j] (bool [s, s]; None:
        causal). cache.length is not changed.
        """
        cfg, xp = self.cfg, self.xp
        tokens, positions, visibility = self._check_forward(cache, tokens, positions, visibility)
        start, s = cache.length, tokens.shape[0]
        end = start + s
        # the mask and the RoPE tables are made on the host (numpy's cos / sin on every device) and moved
        seen = xp.asarray(np.concatenate([np.ones((s, start), dtype=bool), visibility], axis=1))  # [s, end]
        cos, sin = (xp.asarray(a) for a in rope_cos_sin(cfg, positions))
        attention = mla_attention_absorbed if self.absorbed else mla_attention_naive
        x = f64(self.weights["model.embed_tokens.weight"][xp.asarray(tokens)], xp)
        for i, lw in enumerate(self.layers):
            self._keep_hidden(cache, i, x, start, end)
            hx = rms_norm(x, lw["input_layernorm.weight"], cfg.rms_norm_eps)
            q_nope, q_pe, kv_c, k_pe = mla_projections(cfg, hx, lw, cos, sin)
            cache.c[i][start:end] = kv_c
            cache.k_pe[i][start:end] = k_pe
            o = attention(q_nope, q_pe, cache.c[i][:end], cache.k_pe[i][:end], *self.kv_b[i], seen,
                          cfg.softmax_scale)
            x = x + linear(o.reshape(s, -1), lw["self_attn.o_proj.weight"])
            hx = rms_norm(x, lw["post_attention_layernorm.weight"], cfg.rms_norm_eps)
            x = x + (moe(cfg, hx, lw) if cfg.is_moe_layer(i) else dense_mlp(hx, lw))
        cache.in_flight = s
        self._keep_hidden(cache, len(self.layers), x, start, end)
        return to_host(linear(rms_norm(x, self.weights["model.norm.weight"], cfg.rms_norm_eps), self.lm_head))

    def hidden_rows(self, cache: ReferenceCache, stop: int) -> np.ndarray:
        """The kept hidden states of rows 0..stop-1: float64 [n, stop, d] (a numpy copy)."""
        return np.array(to_host(cache.hidden[:, :stop]))

    @staticmethod
    def _keep_hidden(cache: ReferenceCache, index: int, x: np.ndarray, start: int, end: int) -> None:
        for slot, kept in enumerate(cache.hidden_layers):
            if kept == index:
                cache.hidden[slot, start:end] = x

    def commit(self, cache: ReferenceCache, s: int) -> None:
        """Keep the first s in-flight rows (prefill / AR step): cache.length += s."""
        if not 0 <= s <= cache.in_flight:
            raise ValueError(f"commit of {s} rows, but the last forward left {cache.in_flight} in flight")
        cache.length += s
        cache.in_flight = 0

    def compact(self, cache: ReferenceCache, accepted) -> None:
        """DDTree: in-flight row P+accepted[j] -> P+j in every layer, then length = P + len(accepted)."""
        accepted = np.asarray(accepted)
        if (accepted.ndim != 1 or len(accepted) == 0 or not np.issubdtype(accepted.dtype, np.integer)
                or accepted.min() < 0 or accepted.max() >= cache.in_flight):
            raise ValueError(f"accepted must be non-empty integer node indices in 0..{cache.in_flight - 1}, "
                             f"got {accepted.tolist()}")
        src, dst = (self.xp.asarray(a) for a in compaction_moves(cache.length, accepted))
        for rows in cache.c + cache.k_pe + list(cache.hidden):
            move_rows(rows, src, dst)
        cache.length += len(accepted)
        cache.in_flight = 0


# ---------------------------------------------------------------------------------------- golden run
class GoldenRun:
    """tokens [m] int64 (new tokens), logits [m, V] float64 (logits[i] chose tokens[i]) and the final cache,
    whose rows 0 .. len(prompt)+m-1 are the golden AR cache (the last new token is fed too); all numpy, on the
    host, whichever device computed them."""

    def __init__(self, tokens: np.ndarray, logits: np.ndarray, cache: ReferenceCache):
        self.tokens, self.logits, self.cache = tokens, logits, cache


def decode(model: ReferenceModel, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
           seed: int = 0) -> GoldenRun:
    """Prefill the prompt in one forward, then one AR step per token.

    Token i sits at absolute position P+i (P = len(prompt)) and is chosen from logits[i] by
    engine.golden.sampling.choose_token(logits[i], temperature, seed, P+i): argmax at T=0 (ties -> lowest id),
    on the host for every device of the model (so ties and the noise are numpy's).
    """
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    if prompt.ndim != 1 or len(prompt) == 0:
        raise ValueError(f"prompt must be a non-empty 1-D list of token ids, got shape {prompt.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    p = len(prompt)
    cache = model.new_cache(p + max_new_tokens)
    tokens = np.empty(max_new_tokens, dtype=np.int64)
    logits = np.empty((max_new_tokens, model.cfg.vocab_size), dtype=np.float64)
    step_logits = model.forward(cache, prompt, np.arange(p))[-1]
    model.commit(cache, p)
    for i in range(max_new_tokens):
        logits[i] = step_logits
        tokens[i] = choose_token(step_logits, temperature, seed, p + i)
        step_logits = model.forward(cache, tokens[i:i + 1], np.array([p + i]))[0]
        model.commit(cache, 1)
    return GoldenRun(tokens, logits, cache.to_host())
