"""Three moe_experts calls at k2-mini's 32 experts, s = 256, with MANY_PAIRS_CONFIG (or --config TEXT, as
experts_sass.py reads it: "wgmma:64,4,2"): a small process to put under Nsight Compute (tools/gpu_session.sh
ncu-experts); with --sass, the staged gate_up kernel's SASS instruction mix
(numba-cuda's inspect_sass: needs nvdisasm on PATH), the whole SASS written to $OUT/staged_gate_up.sass when OUT is
set. With --time "warps_t,warps_w,token_tiles,weight_tiles,stages;..." [--tokens 64,128,256]: the tensor-core
kernels alone (grouped_swiglu_tc, CUDA events) at each token count for each StagedConfig (or "wgmma:N,S,C", a
WgmmaConfig), after
MANY_PAIRS_CONFIG and the launcher's choice at that count, and whether each gives FEW_PAIRS_CONFIG's bits; with
--against OLD.py (a copy of an earlier experts_tc.py, in fragment layout or, older, natural layout), that module's
MANY_PAIRS_CONFIG and its choice in the same process, side by side, and whether they give the same bits; with
--skew SIGMA, routing skewed as a trained or random router's is (routing: uniform at 0, k2-mini-like at 2.5); with
--model-routing BUDGET, the routing of k2-mini's own MoE layers in its first DDTree oracle verify at that budget
(each layer's call timed in turn, summed: what the staged experts do in `kdtree bench e2e`'s verify)."""
import os, sys
import numpy as np
import torch
from numba import cuda
from kdspec.numba_kernels.moe import experts as moe
from kdspec.numba_kernels.moe import experts_tc as tc
E, K, D, F, S = 32, 8, 7168, 2048, 256
g = torch.Generator(device="cuda").manual_seed(0)
natural = ((torch.randn(E, 2 * F, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16).view(torch.int16),
           (torch.randn(E, D, F, device="cuda", generator=g) * F ** -0.5).to(torch.bfloat16).view(torch.int16))
gate_up, down = (tc.fragment_layout(t) for t in natural)  # the layout the tensor-core kernels read
rng = np.random.default_rng(0)
ids = cuda.to_device(np.argsort(rng.random((S, E)), 1)[:, :K].astype(np.int32))
w = cuda.to_device(np.full((S, K), 1 / K, np.float32))
x = cuda.to_device(rng.standard_normal((S, D)).astype(np.float32))
config = tc.MANY_PAIRS_CONFIG


def load_against(path):
    """An earlier experts_tc.py as a module of its own (its kernels beside today's in one process)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("experts_tc_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def routing(s: int, skew: float) -> np.ndarray:
    """Expert ids int32 [s, K]: each token's top K of (bias + Gumbel noise), bias ~ skew * N(0, 1) an expert (seed
    0): skew 0 is uniform; at s = 256 skew 2.5 leaves about 27 of the 32 experts active with the busiest few taking
    200+ pairs, as k2-mini's router does at B=255 (27.3 active a layer)."""
    bias = skew * np.random.default_rng(0).standard_normal(E)
    return np.argsort(-(bias + rng.gumbel(size=(s, E))), 1)[:, :K].astype(np.int32)


def model_routing(budget: int) -> list:
    """The expert ids int32 [nodes, K] of each MoE layer's call in k2-mini's first DDTree oracle verify at
    ``budget`` (bf16, batch-invariant, no graphs so that each call's ids can be read), the decode
    tools/step_profile.py profiles: the routing the staged experts see in `kdtree bench e2e`."""
    from kdspec.engine.device.model import DeviceModel
    from kdspec.engine.device.tree_ops import DeviceTreeOps
    from kdspec.engine.model.config import PRESETS
    from kdspec.engine.model.weights import SeededWeights
    from tools.step_profile import PROMPT_TOKENS, decodes  # (run from the repository root)
    cfg = PRESETS["k2-mini"]
    model = DeviceModel(cfg, SeededWeights(cfg, 0), "cuda", weight_dtype="bfloat16", batch_invariant=True,
                        graphs=False)
    oracle = decodes(model, DeviceTreeOps(), 8, [budget])[f"DDTree oracle B={budget}"]
    captured, original = [], moe.moe_experts
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace

    def recording(x, expert_ids, *args, **kwargs):
        if expert_ids.shape[0] not in (1, PROMPT_TOKENS) and len(captured) < moe_layers:  # the verify's, not prefill's
            captured.append(np.asarray(cuda.as_cuda_array(expert_ids).copy_to_host()))
        return original(x, expert_ids, *args, **kwargs)
    moe.moe_experts = recording
    try:
        oracle()
    finally:
        moe.moe_experts = original
    del model
    return captured


def time_configs(configs, token_counts, against=None, skew=0.0, model_budget=None) -> None:
    """Each config at each token count under routing(s, skew); with ``model_budget``, under the routings of
    k2-mini's MoE layers in its verify at that budget instead, one call a layer, timed together."""
    if model_budget:
        layer_routings = model_routing(model_budget)
        for layer, expert_ids in enumerate(layer_routings):
            counts = np.bincount(expert_ids.ravel(), minlength=E)
            print(f"k2-mini B={model_budget} MoE layer {layer}: {(counts > 0).sum()} experts active, busiest "
                  f"{sorted(counts.tolist())[::-1][:10]}", flush=True)
        time_routings(configs, f"B={model_budget} {len(layer_routings)} layers", layer_routings, against)
        return
    for s in token_counts:
        expert_ids = routing(s, skew)
        counts = np.bincount(expert_ids.ravel(), minlength=E)
        print(f"s={s:4d} routing skew {skew}: {(counts > 0).sum()} experts active, pairs an expert max {counts.max()}, "
              f"busiest {sorted(counts)[::-1][:8]}", flush=True)
        time_routings(configs, f"s={s:4d}", [expert_ids], against)


def time_routings(configs, label: str, routings: list, against=None) -> None:
    """ms for one tensor-core experts call under each routing (int32 [s, K]) in turn, per config, and whether
    each config gives FEW_PAIRS_CONFIG's bits under every routing."""
    from kdspec.engine.bench.common import time_gpu
    natural_views = tuple(moe.weight_view(cuda.as_cuda_array(t), name) for t, name in zip(natural, ("g", "d")))
    views = (moe.weight_view(cuda.as_cuda_array(gate_up), "w_gate_up"),
             moe.weight_view(cuda.as_cuda_array(down), "w_down"))
    calls = []  # (x, plan, act, pair_out) a routing
    for expert_ids in routings:
        s = expert_ids.shape[0]
        calls.append((cuda.to_device(rng.standard_normal((s, D)).astype(np.float32)),
                      moe.plan_pairs(cuda.to_device(np.ascontiguousarray(expert_ids, np.int32)), E),
                      cuda.device_array((s * K, F), np.float32), cuda.device_array((s * K, D), np.float32)))

    def run(kernels, c, weights):
        for x_s, plan, act, pair_out in calls:
            kernels.grouped_swiglu_tc(x_s, K, plan, *weights, act, pair_out, config=c)

    def bits(kernels, c, weights):
        for _, _, _, pair_out in calls:
            pair_out.copy_to_device(np.full(pair_out.shape, np.nan, np.float32))
        run(kernels, c, weights)
        return [pair_out.copy_to_host().view(np.uint32) for _, _, _, pair_out in calls]

    want = bits(tc, tc.FEW_PAIRS_CONFIG, views)
    s = routings[0].shape[0]
    chosen = tc.tc_config_for(s * K, E)  # the launcher's choice at this s
    for c in configs + ([chosen] if chosen not in configs else []):
        same = all(np.array_equal(a, b) for a, b in zip(bits(tc, c, views), want))
        ms = 1e3 * time_gpu(lambda: run(tc, c, views), 2, 10)
        print(f"{label} {tuple(c.__dict__.values())} {ms:7.3f} ms  bits {'same' if same else 'DIFFER'}", flush=True)
    if against is None:
        return
    old_views = views if hasattr(against, "fragment_layout") else natural_views  # the layout it reads
    old_chosen = against.tc_config_for(s * K, E)
    for old in [against.MANY_PAIRS_CONFIG] + ([old_chosen] if old_chosen != against.MANY_PAIRS_CONFIG else []):
        same = all(np.array_equal(a, b) for a, b in zip(bits(against, old, old_views), want))
        ms = 1e3 * time_gpu(lambda: run(against, old, old_views), 2, 10)
        print(f"{label} against {tuple(old.__dict__.values())} {ms:7.3f} ms  bits {'same' if same else 'DIFFER'}",
              flush=True)


if "--time" in sys.argv:
    spec = sys.argv[sys.argv.index("--time") + 1]
    tokens = sys.argv[sys.argv.index("--tokens") + 1] if "--tokens" in sys.argv else "64,128,256"
    against = load_against(sys.argv[sys.argv.index("--against") + 1]) if "--against" in sys.argv else None
    skew = float(sys.argv[sys.argv.index("--skew") + 1]) if "--skew" in sys.argv else 0.0
    budget = int(sys.argv[sys.argv.index("--model-routing") + 1]) if "--model-routing" in sys.argv else None
    from tools.experts_sass import config_from_text  # (run from the repository root)
    time_configs([config] + [config_from_text(c) for c in spec.split(";") if c],
                 [int(t) for t in tokens.split(",")], against, skew, budget)
    sys.exit(0)
if "--config" in sys.argv:
    from tools.experts_sass import config_from_text  # (run from the repository root)
    config = config_from_text(sys.argv[sys.argv.index("--config") + 1])
for _ in range(3):
    moe.moe_experts(x, ids, w, gate_up, down, tensor_cores=True, config=config)
cuda.synchronize()
if "--sass" in sys.argv:
    kernel = config.kernels()[0]
    sass = next(iter(kernel.inspect_sass().values())) if hasattr(kernel, "inspect_sass") else ""
    from tools.experts_sass import main_loop, mix  # the same counts as offline (run from the repository root)
    ops, loop = mix(sass.splitlines()), mix(main_loop(sass.splitlines()))
    print("SASS total", sum(ops.values()), ops.most_common(30))
    print("main loop", sum(loop.values()), "instructions,", loop["HMMA"], "HMMA:", loop.most_common(16))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "staged_gate_up.sass"), "w") as out:
            out.write(sass)
