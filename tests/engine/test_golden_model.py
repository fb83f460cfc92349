"""The float64 golden reference against independent oracles: brute force, loops written from the formulas,
and the model against itself computed another way (naive vs absorbed MLA, one forward vs prefill + AR steps,
tree verify vs root->node paths, compaction vs the AR cache)."""
import copy
import dataclasses
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from kdspec.engine.golden import layers
from kdspec.engine.golden import model as R
from kdspec.engine.golden.sampling import choose_token
from kdspec.engine.model.config import PRESETS, YarnScaling
from kdspec.engine.model.weights import random_weights

# small-like, but with q_lora_rank, group-limited routing, YaRN whose mscale != mscale_all_dim (so the
# cos/sin magnitude is not 1), tied embeddings and a single dense layer.
MIXED = dataclasses.replace(
    PRESETS["small"], name="mixed", q_lora_rank=12, first_k_dense_replace=1, tie_word_embeddings=True,
    norm_topk_prob=True, rope_theta=10000.0,
    rope_scaling=YarnScaling(factor=8.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                             mscale=0.9, mscale_all_dim=0.7))
CONFIGS = {"tiny": PRESETS["tiny"], "small": PRESETS["small"], "mixed": MIXED}
TOL = 1e-10


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    cfg = CONFIGS[request.param]
    return R.ReferenceModel(cfg, random_weights(cfg, seed=7))


def _tokens(rng, cfg, count):
    return rng.integers(0, cfg.vocab_size, size=count).astype(np.int64)


def _prefilled(model, prompt, capacity):
    cache = model.new_cache(capacity)
    model.forward(cache, prompt, np.arange(len(prompt)))
    model.commit(cache, len(prompt))
    return cache


def _random_tree(rng, num_nodes):
    """parents [N+1] (node 0 the root, parent -1, parent < own index), depths, ancestor-or-self visibility."""
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, num_nodes)])
    depths = np.zeros(num_nodes, dtype=np.int64)
    visibility = np.zeros((num_nodes, num_nodes), dtype=bool)
    for i in range(num_nodes):
        node = i
        while node != -1:
            visibility[i, node] = True
            node = parents[node]
        depths[i] = visibility[i].sum() - 1
    return parents, depths, visibility


def _path(parents, node):
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


# ---------------------------------------------------------------------------------------------- RoPE
def _yarn_frequencies_loop(dim, base, ys):
    """Written from the official precompute_freqs_cis formula, one frequency at a time."""
    def correction_dim(rotations):
        return dim * math.log(ys.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(correction_dim(ys.beta_fast)), 0)
    high = min(math.ceil(correction_dim(ys.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        freq = 1.0 / base ** (2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep freq, 1: freq / factor
        out.append(freq / ys.factor * ramp + freq * (1.0 - ramp))
    return np.array(out)


YARN_CASES = [
    (PRESETS["tiny"].qk_rope_head_dim, PRESETS["tiny"].rope_theta, PRESETS["tiny"].rope_scaling),
    (64, 50000.0, PRESETS["k2-mini"].rope_scaling),
    (64, 10000.0, YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)),
    (16, 10000.0, YarnScaling(factor=4.0, original_max_position_embeddings=4, beta_fast=32.0, beta_slow=1.0)),
    (32, 10000.0, YarnScaling(factor=2.0, original_max_position_embeddings=1 << 20, beta_fast=32.0, beta_slow=1.0)),
]


@pytest.mark.parametrize("dim,base,ys", YARN_CASES)
def test_yarn_frequencies_match_formula_loop(dim, base, ys):
    cfg = dataclasses.replace(PRESETS["tiny"], qk_rope_head_dim=dim, rope_theta=base, rope_scaling=ys)
    expected = _yarn_frequencies_loop(dim, base, ys)
    got = layers.rope_frequencies(cfg)
    np.testing.assert_allclose(got, expected, rtol=1e-14, atol=0)
    # The blend must actually do something in the K2-like cases: low-frequency pairs divided by factor.
    if ys.original_max_position_embeddings == 4096:
        plain = 1.0 / base ** (np.arange(0, dim, 2) / dim)
        assert got[0] == pytest.approx(plain[0]) and got[-1] == pytest.approx(plain[-1] / ys.factor)


def test_rope_cos_sin_angles_and_mscale_magnitude():
    cfg = MIXED
    ys = cfg.rope_scaling
    positions = np.array([0, 1, 5, 100, 511])
    cos, sin = R.rope_cos_sin(cfg, positions)
    m = (0.1 * ys.mscale * math.log(ys.factor) + 1) / (0.1 * ys.mscale_all_dim * math.log(ys.factor) + 1)
    assert m != pytest.approx(1.0)
    freqs = _yarn_frequencies_loop(cfg.qk_rope_head_dim, cfg.rope_theta, ys)
    for a, p in enumerate(positions):
        for i, f in enumerate(freqs):
            assert cos[a, i] == pytest.approx(m * math.cos(p * f), abs=1e-12)
            assert sin[a, i] == pytest.approx(m * math.sin(p * f), abs=1e-12)
    cos1, sin1 = R.rope_cos_sin(PRESETS["small"], positions)  # no YaRN: plain frequencies, magnitude 1
    np.testing.assert_allclose(cos1 ** 2 + sin1 ** 2, 1.0, atol=1e-14)
    np.testing.assert_allclose(np.arctan2(sin1[3], cos1[3]) % (2 * np.pi),
                               (100 / 50000.0 ** (np.arange(0, 8, 2) / 8)) % (2 * np.pi), atol=1e-12)


def test_apply_rope_is_complex_rotation_of_adjacent_pairs():
    cfg = PRESETS["small"]
    rng = np.random.default_rng(1)
    positions = rng.integers(0, 500, size=6)
    x = rng.standard_normal((6, 3, cfg.qk_rope_head_dim))
    cos, sin = R.rope_cos_sin(cfg, positions)
    angle = np.outer(positions, layers.rope_frequencies(cfg))[:, None, :]
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)  # the official apply_rotary_emb
    expected = np.stack([z.real, z.imag], axis=-1).reshape(x.shape)
    np.testing.assert_allclose(layers.apply_rope(x, cos, sin), expected, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_adjacent_pair_rope_scores_equal_hf_rotate_half_after_permutation(name):
    cfg = CONFIGS[name]
    r = cfg.qk_rope_head_dim
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((5, r)), rng.standard_normal((7, r))
    q_pos, k_pos = rng.integers(0, 200, size=5), rng.integers(0, 200, size=7)
    q_cos, q_sin = R.rope_cos_sin(cfg, q_pos)
    k_cos, k_sin = R.rope_cos_sin(cfg, k_pos)
    ours = layers.apply_rope(q, q_cos, q_sin) @ layers.apply_rope(k, k_cos, k_sin).T

    perm = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])  # HF: [evens | odds]

    def hf_rope(x, cos, sin):
        x = x[:, perm]
        rotate_half = np.concatenate([-x[:, r // 2:], x[:, :r // 2]], axis=1)
        return x * np.concatenate([cos, cos], axis=1) + rotate_half * np.concatenate([sin, sin], axis=1)

    hf = hf_rope(q, q_cos, q_sin) @ hf_rope(k, k_cos, k_sin).T
    np.testing.assert_allclose(ours, hf, atol=1e-12)
    assert np.abs(ours - q @ k.T).max() > 1e-3  # the rotation is not a no-op


# ---------------------------------------------------------------------------------------- small layers
def test_rms_norm_and_swiglu_against_loops():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((3, 10)), rng.standard_normal(10)
    got = R.rms_norm(x.astype(np.float32), w.astype(np.float32), 1e-5)
    for i in range(3):
        xi = x[i].astype(np.float32).astype(np.float64)
        rms = math.sqrt(sum(v * v for v in xi) / 10 + 1e-5)
        for j in range(10):
            assert got[i, j] == pytest.approx(xi[j] / rms * float(np.float32(w[j])), rel=1e-13)
    gate, up, down = rng.standard_normal((4, 10)), rng.standard_normal((4, 10)), rng.standard_normal((10, 4))
    y = layers.swiglu(x, gate, up, down)
    for i in range(3):
        hidden = [(g := float(gate[a] @ x[i])) / (1 + math.exp(-g)) * float(up[a] @ x[i]) for a in range(4)]
        np.testing.assert_allclose(y[i], [sum(down[j, a] * hidden[a] for a in range(4)) for j in range(10)],
                                   rtol=1e-12)


# ------------------------------------------------------------------------------------------------ MLA
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mla_naive_equals_absorbed(name):
    cfg = CONFIGS[name]
    h, n, r, v, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    rng = np.random.default_rng(4)
    s, t = 5, 11
    q_nope, q_pe = rng.standard_normal((s, h, n)), rng.standard_normal((s, h, r))
    kv_c, k_pe = rng.standard_normal((t, c)), rng.standard_normal((t, r))
    w_uk, w_uv = R.split_kv_b(cfg, rng.standard_normal((h * (n + v), c)) / np.sqrt(c))
    visibility = rng.random((s, t)) < 0.5
    visibility[:, 0] = True
    args = (q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, visibility, cfg.softmax_scale)
    absorbed, naive = R.mla_attention_absorbed(*args), R.mla_attention_naive(*args)
    assert absorbed.shape == (s, h, v)
    assert np.abs(absorbed - naive).max() <= TOL
    # Rows a query cannot see must not matter.
    hidden = ~visibility[2]
    kv_c2, k_pe2 = kv_c.copy(), k_pe.copy()
    kv_c2[hidden] += 100.0
    k_pe2[hidden] -= 50.0
    changed = R.mla_attention_absorbed(q_nope, q_pe, kv_c2, k_pe2, w_uk, w_uv, visibility, cfg.softmax_scale)
    assert np.abs(changed[2] - absorbed[2]).max() <= TOL


def test_mla_latent_core_against_per_head_loop():
    rng = np.random.default_rng(5)
    s, h, t, c, r, scale = 3, 2, 6, 4, 2, 0.37
    q_lat, q_pe = rng.standard_normal((s, h, c)), rng.standard_normal((s, h, r))
    kv_c, k_pe = rng.standard_normal((t, c)), rng.standard_normal((t, r))
    visibility = np.tril(np.ones((s, t), dtype=bool), k=t - s)
    got = layers.mla_attention_latent(q_lat, q_pe, kv_c, k_pe, visibility, scale)
    for i in range(s):
        for head in range(h):
            keys = [j for j in range(t) if visibility[i, j]]
            logits = [scale * (q_lat[i, head] @ kv_c[j] + q_pe[i, head] @ k_pe[j]) for j in keys]
            weights = np.exp(np.array(logits) - max(logits))
            weights /= weights.sum()
            np.testing.assert_allclose(got[i, head], sum(wj * kv_c[j] for wj, j in zip(weights, keys)), atol=1e-13)


def test_attention_rejects_a_query_that_sees_nothing():
    vis = np.array([[True, False], [False, False]])
    with pytest.raises(ValueError, match="query 1 sees no key"):
        layers.mla_attention_latent(np.ones((2, 1, 3)), np.ones((2, 1, 2)), np.ones((2, 3)), np.ones((2, 2)), vis, 1.0)


# ------------------------------------------------------------------------------------------------ MoE
def _gate_brute_force(cfg, x, gate_weight, bias):
    """Scores by per-expert dot products; the allowed groups by enumerating every topk_group-subset and
    keeping the one with the largest exact (Fraction) sum of group scores, ties to the smallest subset."""
    e, k, groups = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group
    per_group = e // groups
    ids, weights = [], []
    for row in x:
        s = [1.0 / (1.0 + math.exp(-float(np.dot(row, gate_weight[j])))) for j in range(e)]
        biased = [s[j] + float(bias[j]) for j in range(e)]
        group_score = [sum(sorted(biased[g * per_group:(g + 1) * per_group], reverse=True)[:2]) for g in range(groups)]
        best = max(itertools.combinations(range(groups), cfg.topk_group),
                   key=lambda combo: (sum(Fraction(group_score[g]) for g in combo), [-g for g in combo]))
        allowed = [j for j in range(e) if j // per_group in best] if groups > 1 else list(range(e))
        picked = sorted(allowed, key=lambda j: (-biased[j], j))[:k]
        w = [s[j] for j in picked]
        total = sum(w) if cfg.norm_topk_prob else 1.0
        ids.append(picked)
        weights.append([wj / total * cfg.routed_scaling_factor for wj in w])
    return np.array(ids), np.array(weights)


GATE_CONFIGS = [
    PRESETS["small"],  # 8 experts in 4 groups, keep 2, top-3, no normalisation
    MIXED,
    PRESETS["tiny"],   # one group
    dataclasses.replace(PRESETS["small"], n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=3,
                        norm_topk_prob=True),
]


@pytest.mark.parametrize("cfg", GATE_CONFIGS, ids=lambda c: f"{c.name}-e{c.n_routed_experts}g{c.n_group}")
@pytest.mark.parametrize("quantised", [False, True], ids=["random", "ties"])
def test_moe_gate_matches_brute_force(cfg, quantised):
    rng = np.random.default_rng(6)
    d, e = cfg.hidden_size, cfg.n_routed_experts
    if quantised:
        # Dyadic values: every dot product is exact in any order, so ties below are true ties on both sides.
        x = rng.integers(-4, 5, size=(40, d)) / 4.0
        gate_weight = rng.integers(-8, 9, size=(e, d)) / 32.0
        bias = rng.integers(-4, 5, size=e) / 16.0
        half = e // 2
        gate_weight[half:], bias[half:] = gate_weight[:half], bias[:half]  # expert j+e/2 == j: tied scores
        if cfg.n_group > 2:
            per_group = e // cfg.n_group  # and one group a copy of another: tied group scores
            gate_weight[per_group:2 * per_group] = gate_weight[:per_group]
            bias[per_group:2 * per_group] = bias[:per_group]
    else:
        x = rng.standard_normal((40, d))
        gate_weight = rng.standard_normal((e, d)) / np.sqrt(d)
        bias = 0.2 * rng.standard_normal(e)
    ids, weights = layers.moe_gate(cfg, x, gate_weight, bias)
    expected_ids, expected_weights = _gate_brute_force(cfg, x, gate_weight, bias)
    assert ids.dtype == np.int64 and weights.dtype == np.float64
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-12)
    if cfg.n_group > 1:  # the group limit must bind somewhere, or this test proves little
        unlimited = dataclasses.replace(cfg, n_group=1, topk_group=1)
        assert not np.array_equal(layers.moe_gate(unlimited, x, gate_weight, bias)[0], ids)


def test_moe_gate_greedy_ignores_bias_and_groups():
    cfg = dataclasses.replace(PRESETS["small"], topk_method="greedy")
    rng = np.random.default_rng(8)
    x, gate_weight = rng.standard_normal((10, cfg.hidden_size)), rng.standard_normal((8, cfg.hidden_size))
    ids, _ = layers.moe_gate(cfg, x, gate_weight, rng.standard_normal(8))
    s = 1 / (1 + np.exp(-x @ gate_weight.T))
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.sort(np.argsort(-s, axis=1)[:, :3], axis=1))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_equals_dense_sum_over_chosen_experts(name):
    cfg = CONFIGS[name]
    weights = random_weights(cfg, seed=9)
    layer = cfg.num_hidden_layers - 1
    lw = R.layer_weights(weights, layer)
    x = np.random.default_rng(9).standard_normal((6, cfg.hidden_size))
    ids, gate_w = layers.moe_gate(cfg, x, lw["mlp.gate.weight"], lw["mlp.gate.e_score_correction_bias"])
    expected = np.zeros_like(x)
    for i in range(len(x)):  # every expert on every token, then pick: a different order of work
        for e in range(cfg.n_routed_experts):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            y = layers.swiglu(x[i:i + 1], weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"],
                         weights[p + "down_proj.weight"])[0]
            expected[i] += sum(gate_w[i, slot] for slot in range(ids.shape[1]) if ids[i, slot] == e) * y
        p = f"model.layers.{layer}.mlp.shared_experts."
        expected[i] += layers.swiglu(x[i:i + 1], weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"],
                                weights[p + "down_proj.weight"])[0]
    np.testing.assert_allclose(R.moe(cfg, x, lw), expected, atol=1e-12)


# ---------------------------------------------------------------------------------------------- model
def _hf_style_logits(cfg, weights, tokens):
    """An independent transcription of HF's DeepseekV3 forward for one causal sequence, no cache: keys and
    values from kv_b_proj(c).view(t, h, n + v), per-token expert loop. Reuses only the separately tested
    rms_norm, RoPE and gate."""
    h, n, r, v, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    W = {name: w.astype(np.float64) for name, w in weights.items()}
    s = len(tokens)
    cos, sin = R.rope_cos_sin(cfg, np.arange(s))
    eps = cfg.rms_norm_eps
    ffn = lambda x, p: (lambda g: g / (1 + np.exp(-g)))(x @ W[p + "gate_proj.weight"].T) \
        * (x @ W[p + "up_proj.weight"].T) @ W[p + "down_proj.weight"].T
    x = W["model.embed_tokens.weight"][tokens]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        hx = R.rms_norm(x, W[p + "input_layernorm.weight"], eps)
        if cfg.q_lora_rank is None:
            q = hx @ W[p + "self_attn.q_proj.weight"].T
        else:
            q = R.rms_norm(hx @ W[p + "self_attn.q_a_proj.weight"].T, W[p + "self_attn.q_a_layernorm.weight"], eps) \
                @ W[p + "self_attn.q_b_proj.weight"].T
        q = q.reshape(s, h, n + r)
        q = np.concatenate([q[..., :n], layers.apply_rope(q[..., n:], cos, sin)], axis=-1)
        compressed = hx @ W[p + "self_attn.kv_a_proj_with_mqa.weight"].T
        k_pe = layers.apply_rope(compressed[:, c:], cos, sin)
        kv = (R.rms_norm(compressed[:, :c], W[p + "self_attn.kv_a_layernorm.weight"], eps)
              @ W[p + "self_attn.kv_b_proj.weight"].T).reshape(s, h, n + v)
        keys = np.concatenate([kv[..., :n], np.repeat(k_pe[:, None, :], h, axis=1)], axis=-1)
        out = np.zeros((s, h, v))
        for head in range(h):
            scores = q[:, head] @ keys[:, head].T * cfg.softmax_scale
            scores[np.triu_indices(s, 1)] = -np.inf
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, head] = (probs / probs.sum(axis=1, keepdims=True)) @ kv[:, head, n:]
        x = x + out.reshape(s, h * v) @ W[p + "self_attn.o_proj.weight"].T
        hx = R.rms_norm(x, W[p + "post_attention_layernorm.weight"], eps)
        if not cfg.is_moe_layer(layer):
            x = x + ffn(hx, p + "mlp.")
            continue
        ids, gate_w = layers.moe_gate(cfg, hx, W[p + "mlp.gate.weight"], W[p + "mlp.gate.e_score_correction_bias"])
        y = ffn(hx, p + "mlp.shared_experts.") if cfg.n_shared_experts else np.zeros_like(hx)
        for i in range(s):
            for slot in range(ids.shape[1]):
                y[i] += gate_w[i, slot] * ffn(hx[i:i + 1], p + f"mlp.experts.{ids[i, slot]}.")[0]
        x = x + y
    head = W["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    return R.rms_norm(x, W["model.norm.weight"], eps) @ head.T


def test_model_matches_hf_style_transcription(model):
    tokens = _tokens(np.random.default_rng(13), model.cfg, 8)
    got = model.forward(model.new_cache(8), tokens, np.arange(8))
    assert np.abs(got - _hf_style_logits(model.cfg, model.weights, tokens)).max() <= TOL


def test_model_naive_equals_absorbed(model):
    cfg = model.cfg
    naive = R.ReferenceModel(cfg, model.weights, absorbed=False)
    tokens = _tokens(np.random.default_rng(10), cfg, 9)
    a = model.forward(model.new_cache(16), tokens, np.arange(9))
    b = naive.forward(naive.new_cache(16), tokens, np.arange(9))
    assert a.shape == (9, cfg.vocab_size) and a.dtype == np.float64
    assert np.abs(a - b).max() <= TOL


def test_prefill_then_ar_steps_equal_one_forward(model):
    cfg = model.cfg
    total, prompt_len = 14, 5
    tokens = _tokens(np.random.default_rng(11), cfg, total)
    whole_cache = model.new_cache(total)
    whole = model.forward(whole_cache, tokens, np.arange(total))
    model.commit(whole_cache, total)

    cache = model.new_cache(total)
    steps = [model.forward(cache, tokens[:prompt_len], np.arange(prompt_len))]
    model.commit(cache, prompt_len)
    for p in range(prompt_len, total):
        steps.append(model.forward(cache, tokens[p:p + 1], np.array([p])))
        model.commit(cache, 1)
    assert cache.length == whole_cache.length == total
    assert np.abs(np.concatenate(steps) - whole).max() <= TOL
    for layer in range(cfg.num_hidden_layers):
        assert np.abs(cache.c[layer] - whole_cache.c[layer]).max() <= TOL
        assert np.abs(cache.k_pe[layer] - whole_cache.k_pe[layer]).max() <= TOL


@pytest.mark.parametrize("tree_seed", [0, 1, 2])
def test_tree_verify_equals_each_root_to_node_path(model, tree_seed):
    cfg = model.cfg
    rng = np.random.default_rng(100 + tree_seed)
    prompt_len, num_nodes = 4, 9
    prefix = _prefilled(model, _tokens(rng, cfg, prompt_len), prompt_len + num_nodes)
    parents, depths, visibility = _random_tree(rng, num_nodes)
    tree_tokens = _tokens(rng, cfg, num_nodes)
    tree_cache = copy.deepcopy(prefix)
    tree_logits = model.forward(tree_cache, tree_tokens, prompt_len + depths, visibility)
    assert tree_cache.length == prompt_len  # forward does not commit
    worst = 0.0
    for node in range(num_nodes):
        path = _path(parents, node)
        path_cache = copy.deepcopy(prefix)
        path_logits = model.forward(path_cache, tree_tokens[path], prompt_len + np.arange(len(path)))
        worst = max(worst, np.abs(path_logits[-1] - tree_logits[node]).max())
        row_path, row_tree = prompt_len + len(path) - 1, prompt_len + node
        for layer in range(cfg.num_hidden_layers):
            worst = max(worst, np.abs(path_cache.c[layer][row_path] - tree_cache.c[layer][row_tree]).max(),
                        np.abs(path_cache.k_pe[layer][row_path] - tree_cache.k_pe[layer][row_tree]).max())
    assert worst <= TOL
    assert depths.max() >= 2  # a real tree, not just the root's children


@pytest.mark.parametrize("tree_seed", [0, 1, 2, 3])
def test_compaction_gives_the_ar_cache_of_the_accepted_path(model, tree_seed):
    cfg = model.cfg
    rng = np.random.default_rng(200 + tree_seed)
    prompt_len, num_nodes = 3, 10
    capacity = prompt_len + num_nodes
    prompt = _tokens(rng, cfg, prompt_len)
    parents, depths, visibility = _random_tree(rng, num_nodes)
    tree_tokens = _tokens(rng, cfg, num_nodes)
    accepted = np.array(_path(parents, int(np.argmax(depths))))  # the deepest root->leaf path

    cache = _prefilled(model, prompt, capacity)
    model.forward(cache, tree_tokens, prompt_len + depths, visibility)
    before = copy.deepcopy(cache)
    model.compact(cache, accepted)
    assert cache.length == prompt_len + len(accepted)

    ar = _prefilled(model, prompt, capacity)
    for j, node in enumerate(accepted):
        model.forward(ar, tree_tokens[node:node + 1], np.array([prompt_len + j]))
        model.commit(ar, 1)
    rows = slice(0, cache.length)
    for layer in range(cfg.num_hidden_layers):
        assert np.abs(cache.c[layer][rows] - ar.c[layer][rows]).max() <= TOL
        assert np.abs(cache.k_pe[layer][rows] - ar.k_pe[layer][rows]).max() <= TOL
        # and exactly the row moves of a plain loop over a snapshot
        for new, old in ((cache.c[layer], before.c[layer]), (cache.k_pe[layer], before.k_pe[layer])):
            expected = old.copy()
            for j, node in enumerate(accepted):
                expected[prompt_len + j] = old[prompt_len + node]
            np.testing.assert_array_equal(new[rows], expected[rows])


def test_compaction_with_sources_overlapping_destinations():
    # accepted [0, 2, 3]: row P+2 -> P+1 and P+3 -> P+2 (a source read after a write in a naive loop order).
    cfg = PRESETS["tiny"]
    model = R.ReferenceModel(cfg, random_weights(cfg, seed=1))
    cache = _prefilled(model, np.arange(2), 8)
    model.forward(cache, np.arange(2, 6), np.arange(2, 6))
    before = [row.copy() for row in cache.c]
    model.compact(cache, np.array([0, 3, 1]))
    for layer in range(cfg.num_hidden_layers):
        np.testing.assert_array_equal(cache.c[layer][2:5], before[layer][[2, 5, 3]])


# ---------------------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_tokens_logits_and_cache(model, temperature):
    cfg = model.cfg
    prompt = _tokens(np.random.default_rng(12), cfg, 6)
    run = R.decode(model, prompt, 10, temperature=temperature, seed=5)
    assert run.tokens.shape == (10,) and run.logits.shape == (10, cfg.vocab_size)
    # One causal forward over prompt + tokens: row P-1+i predicts token i.
    full = np.concatenate([prompt, run.tokens])
    check = model.new_cache(len(full))
    logits = model.forward(check, full, np.arange(len(full)))
    assert np.abs(logits[len(prompt) - 1:-1] - run.logits).max() <= TOL
    for i, token in enumerate(run.tokens):
        if temperature == 0:
            assert token == int(np.flatnonzero(run.logits[i] == run.logits[i].max())[0])
        else:
            assert token == choose_token(run.logits[i], temperature, 5, len(prompt) + i)
    assert run.cache.length == len(full)
    for layer in range(cfg.num_hidden_layers):
        assert np.abs(run.cache.c[layer] - check.c[layer]).max() <= TOL
    if temperature == 0:
        assert np.array_equal(R.decode(model, prompt, 10).tokens, run.tokens)  # the default is greedy, seed unused


# -------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_one_line_errors():
    cfg = PRESETS["tiny"]
    model = R.ReferenceModel(cfg, random_weights(cfg, seed=0))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        model.new_cache(cfg.max_position_embeddings + 1)
    cache = model.new_cache(4)
    with pytest.raises(ValueError, match="token ids"):
        model.forward(cache, np.array([cfg.vocab_size]), np.array([0]))
    with pytest.raises(ValueError, match="positions"):
        model.forward(cache, np.array([1, 2]), np.array([0]))
    with pytest.raises(ValueError, match="do not fit"):
        model.forward(cache, np.arange(5), np.arange(5))
    with pytest.raises(ValueError, match="visibility"):
        model.forward(cache, np.arange(2), np.arange(2), np.ones((2, 3), dtype=bool))
    model.forward(cache, np.arange(2), np.arange(2))
    with pytest.raises(ValueError, match="commit of 3 rows"):
        model.commit(cache, 3)
    with pytest.raises(ValueError, match="accepted"):
        model.compact(cache, np.array([0, 2]))
    weights = random_weights(cfg, seed=0)
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        R.ReferenceModel(cfg, weights)
