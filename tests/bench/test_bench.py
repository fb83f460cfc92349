"""`kdtree bench` suites in --quick toy mode (CUDA simulator in CI): the rows' shape, not speeds; the roofline
byte count and the HF weight mapping against independent references."""
import io
import json
import math

import numpy as np
import pytest

from kdspec.engine.bench import common, runner
from kdspec.engine.model.config import PRESETS
from kdspec.engine.model.weights import parameter_shapes, random_weights

ROW_KEYS = set(common.ROW_KEYS)


def check_rows(rows, suite, count=None):
    mine = [r for r in rows if r["suite"] == suite]
    assert mine, f"no rows for suite {suite}"
    if count is not None:
        assert len(mine) == count
    for r in mine:
        assert set(r) == ROW_KEYS
        assert r["metric"] != "suite failed", r["note"]
        assert isinstance(r["value"], (int, float)) and math.isfinite(r["value"]), r
        assert r["ok"] in (None, True, False)
    json.dumps(rows)  # rows are JSON-serialisable
    return mine


# ------------------------------------------------------------------------------------------ common
def test_row_ratio_and_table():
    r = common.row("tree", "build", np.float32(3.0), "ms", peer="heapq", peer_value=np.float64(6.0), target=">= 1x",
                   ok=np.bool_(False))
    assert set(r) == ROW_KEYS and r["ratio"] == 0.5 and r["ok"] is False and type(r["value"]) is float
    assert common.row("x", "y", 1.0, peer_value=0.0)["ratio"] is None
    assert common.row("x", "y", None)["ratio"] is None
    table = common.format_table([r, common.row("e2e", "AR tokens/s", 1234.5, "tok/s", note="n")]).splitlines()
    assert len(table) == 4 and table[0].startswith("suite") and set(table[1]) == {"-"}
    assert "NO" in table[2] and "heapq" in table[2] and table[3].endswith("n")


@pytest.mark.sim
def test_ceilings_are_positive():
    c = common.ceilings(quick=True)
    assert c["copy_bytes_per_s"] > 0 and c["fma_flops"] > 0
    rows = common.ceiling_rows(quick=True)
    assert [r["unit"] for r in rows] == ["GB/s", "TFLOP/s"]


# ------------------------------------------------------------------------------------------ runner
def test_runner_rejects_unknown_suite():
    with pytest.raises(ValueError, match="unknown bench suite 'nope'"):
        runner.run(["nope"], quick=True)


@pytest.mark.sim
def test_runner_failed_suite_is_one_row(monkeypatch):
    from kdspec.engine.bench import tree

    def broken(quick=False):
        raise RuntimeError("kernel exploded\nsecond line")
    monkeypatch.setattr(tree, "run", broken)
    out = io.StringIO()
    rows = runner.run(["tree"], json=True, quick=True, out=out)
    failed = [r for r in rows if r["suite"] == "tree"]
    assert len(failed) == 1 and failed[0]["ok"] is False and failed[0]["note"] == "RuntimeError: kernel exploded"
    assert json.loads(out.getvalue()) == rows


@pytest.mark.sim
def test_runner_runs_suites_in_the_known_order_and_frees_the_model_after_its_last_suite(monkeypatch):
    from kdspec.engine.bench import e2e, trace, tree
    calls = []
    for module in (tree, e2e, trace):
        monkeypatch.setattr(module, "run", lambda quick=False, name=module.__name__.rsplit(".", 1)[1]:
                            calls.append(name) or [])
    monkeypatch.setattr(runner, "release_model", lambda quick: calls.append("release"))
    runner.run(["trace", "e2e", "tree", "trace"], quick=True, out=io.StringIO())
    assert calls == ["tree", "e2e", "trace", "release"]  # each once, in the known order; the model freed after trace
    calls.clear()
    runner.run(["e2e", "tree"], quick=True, out=io.StringIO())
    assert calls == ["tree", "e2e", "release"]


# ------------------------------------------------------------------------------------------ suites
@pytest.mark.sim
def test_kernel_suites_quick():
    out = io.StringIO()
    rows = runner.run(["tree", "attention", "moe"], quick=True, out=out)
    tree_rows = check_rows(rows, "tree", count=2)
    assert all(r["peer"] == "heapq (Python)" and r["ratio"] > 0 for r in tree_rows)
    check_rows(rows, "attention", count=1)
    check_rows(rows, "moe", count=2)
    assert out.getvalue().splitlines()[0].startswith("suite")  # the table comes last, on stdout


@pytest.mark.sim
def test_e2e_and_trace_quick():
    rows = runner.run(["e2e", "trace"], json=True, quick=True, out=io.StringIO())
    e2e = check_rows(rows, "e2e")
    metrics = [r["metric"] for r in e2e]
    assert metrics[0] == "AR tokens/s" and any(m.startswith("DDTree oracle") for m in metrics)
    assert any("roofline" in m for m in metrics) and metrics[-1] == "engine AR vs HF transformers AR"
    oracle = next(r for r in e2e if r["metric"].startswith("DDTree oracle"))
    assert oracle["target"] == "output = AR" and oracle["ok"] is True, oracle  # 4/4 tokens = AR (tiny, fp32)
    trace = check_rows(rows, "trace", count=4)
    assert [r["unit"] for r in trace] == ["%", "B", "%", "B"]
    assert all(r["value"] > 0 for r in trace if r["unit"] == "B")


def test_hf_row_says_how_the_engine_computes():
    from types import SimpleNamespace

    from kdspec.engine.bench.e2e import precision
    assert precision(SimpleNamespace(weight_dtype="float32", batch_invariant=False)) == "fp32"
    assert precision(SimpleNamespace(weight_dtype="bfloat16", batch_invariant=True)) == \
        "bf16 dense products, the rest fp32, batch-invariant"
    assert precision(SimpleNamespace(weight_dtype="bfloat16", batch_invariant=False)) == \
        "bf16 dense products, the rest fp32"
    assert precision(SimpleNamespace(weight_dtype="bfloat16", batch_invariant=True, tensor_core_experts=True,
                                     tensor_core_attention=True)) == \
        "bf16 dense products, bf16 routed experts, tf32 attention, the rest fp32, batch-invariant"


def test_ddtree_speed_targets_are_the_issues():
    from kdspec.engine.bench.e2e import speed_target
    text, ok = speed_target("oracle", 7)
    assert text == ">= 4.5x AR" and ok(4.5) and not ok(4.49)
    text, ok = speed_target("oracle", 255)
    assert text == "> 1x AR" and ok(1.01) and not ok(1.0)
    assert [speed_target("noisy:0.7", b)[0] for b in (7, 15, 31, 63, 127)] == ["> 1x AR"] * 4 + [""]
    assert speed_target("oracle", 63) == ("", None)


# ------------------------------------------------------------------------------------------ roofline
def test_step_bytes_all_experts_is_every_weight():
    """With every routed expert touched, a one-token step at P = 0 moves every parameter but the embedding
    table (bf16 matrices, fp32 vectors), one embedding row, and one cache row read and written per layer."""
    from kdspec.engine.bench.e2e import step_bytes
    for name in ("tiny", "small"):
        cfg = PRESETS[name]
        shapes = parameter_shapes(cfg)
        want = sum(int(np.prod(s)) * (2 if len(s) == 2 else 4) for n, s in shapes.items()
                   if n != "model.embed_tokens.weight")
        want += cfg.hidden_size * 2 + 2 * cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
        moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
        assert step_bytes(cfg, 1, 0, [cfg.n_routed_experts] * moe_layers) == want
        # one expert fewer per MoE layer: 3 d f bf16 values fewer each
        fewer = step_bytes(cfg, 1, 0, [cfg.n_routed_experts - 1] * moe_layers)
        assert want - fewer == moe_layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2


def test_step_flops_from_the_dimensions():
    """step_flops against the MLA / MoE dimensions written out by hand: per row, every projection, the router,
    the shared expert, top-k of the routed experts, lm_head; attention over every key in latent + rope width
    (scores) and latent width (values)."""
    from kdspec.engine.bench.e2e import step_flops
    for name in ("tiny", "small"):
        c = PRESETS[name]
        d, h, lat, rope = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        q_width = h * (c.qk_nope_head_dim + rope)
        q = d * c.q_lora_rank + c.q_lora_rank * q_width if c.q_lora_rank else d * q_width
        attention = q + d * (lat + rope) + lat * h * (c.qk_nope_head_dim + c.v_head_dim) + h * c.v_head_dim * d
        f = c.moe_intermediate_size
        moe = d * c.n_routed_experts + 3 * d * f * (c.n_shared_experts + c.num_experts_per_tok)
        mlp = [3 * d * c.intermediate_size if layer < c.first_k_dense_replace else moe
               for layer in range(c.num_hidden_layers)]
        per_row = c.num_hidden_layers * attention + sum(mlp) + c.vocab_size * d
        for tokens, prefix in ((1, 0), (5, 17)):
            keys = prefix + tokens
            want = 2 * tokens * (per_row + c.num_hidden_layers * h * keys * (2 * lat + rope))
            assert step_flops(c, tokens, prefix) == want, (name, tokens, prefix)


def test_busy_seconds_is_the_union_clipped_to_the_window():
    from kdspec.engine.bench.e2e import busy_seconds
    assert busy_seconds([], 0.0, 10.0) == 0.0
    assert busy_seconds([(1, 3), (2, 4), (6, 7)], 0, 10) == 4         # overlapping kernels count once
    assert busy_seconds([(6, 7), (1, 3), (2, 4)], 0, 10) == 4         # in any order
    assert busy_seconds([(1, 3), (2, 4), (6, 7)], 2.5, 6.5) == 2      # clipped: 2.5..4 and 6..6.5
    assert busy_seconds([(1, 9), (2, 3)], 0, 10) == 8                 # one inside another
    assert busy_seconds([(-5, -1), (11, 12)], 0, 10) == 0             # outside the window


# ------------------------------------------------------------------------------------------ HF peer
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_hf_peer_matches_golden(name):
    """Our weights loaded into transformers' DeepseekV3ForCausalLM (fp32, CPU) give the float64 golden's logits."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kdspec.engine.bench.e2e import hf_model
    from kdspec.engine.golden.model import ReferenceModel
    cfg = PRESETS[name]
    weights = random_weights(cfg, 3)
    model = hf_model(cfg, {k: torch.from_numpy(v) for k, v in weights.items()}, torch.float32, "cpu")
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 24)
    golden = ReferenceModel(cfg, weights)
    want = golden.forward(golden.new_cache(32), ids, np.arange(len(ids)))
    with torch.no_grad():
        got = model(torch.from_numpy(ids)[None]).logits[0].double().numpy()
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
