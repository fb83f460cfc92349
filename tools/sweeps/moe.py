"""MoE experts sweep: every ExpertsConfig launch shape against a float64 reference, then its weight bandwidth.

    python3 -m tools.sweeps.moe          (H200: ~2-3 min; 34 GB of bf16 weights made with torch)
    python3 -m tools.sweeps.moe --sim    (CUDA simulator, toy sizes: a few seconds; the times mean nothing)
    python3 -m tools.sweeps.moe --experts 32 --tokens 1,8,16,64   (k2-mini's routing: 32 experts, so a
        verify of 8 tokens already gives each active expert ~3.4 tokens; --only c0,c9: a subset of configs)
    python3 -m tools.sweeps.moe --tensor-cores   (the bf16 tensor-core kernels, experts_tc.py: every TcConfig
        of TC_CONFIGS, named t0, t1, ..., beside the SIMT default; checked to TC_RTOL, since they round x and
        act to bf16 where the reference does not; --graphs: each call timed as a CUDA graph replay, as the
        device model runs it, without Python's launch time)

Kimi K2 sizes: E=384 experts, top-8, d=7168, f=2048, bf16 weights (bits in int16).
1. correctness: moe_experts with no config (default_config) and with every swept config against a float64
   reference (torch float64 on the GPU, numpy under --sim) on up to 16 tokens per s, rel tol 1e-4 of max |ref|;
   outputs NaN-poisoned first and checked fully written.
2. timing: CUDA-event medians of 12 calls after 3 warmups at s = 1, 8, 64, 256 tokens; weight GB/s = distinct
   experts x 3 d f x 2 bytes / time, next to the copy-bandwidth ceiling (kdspec.engine.bench.common.ceilings)
   and a torch read-only roofline (bf16 sum over the experts of s=64); a breakdown of the default config
   through the public launchers (plan_pairs, grouped_swiglu = gate_up + down, the rest = combine + launcher).
3. registers / local memory per config (gate_up / down); a table last, then the best config per s and the
   best single config over all s: make it DEFAULT_CONFIG (or default_config's choice) in
   numba_kernels/moe_experts.py.
"""
import math
import os
import sys

if "--sim" in sys.argv[1:]:  # before numba is imported: the simulator is chosen at import time
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from kdspec.engine.bench.common import ceilings, time_gpu, time_graph  # noqa: E402
from kdspec.numba_kernels.moe import experts as moe  # noqa: E402
from kdspec.numba_kernels.moe import experts_tc  # noqa: E402
from kdspec.numba_kernels.runtime import ON_SIMULATOR
from tools.sweeps.report import kernel_resources, log  # noqa: E402

C = moe.ExpertsConfig
if ON_SIMULATOR:
    E, K, D, F = 6, 2, 16, 8
    TOKENS = (1, 3, 9)
    CONFIGS = [C(1, 2, 3, 2, 2), C(2, 1, 2, 1, 3, 4), C(1, 3, 2, 2, 4, 2)]
    WARMUP, REPEATS = 0, 1
else:
    E, K, D, F = 384, 8, 7168, 2048
    TOKENS = (1, 8, 64, 256)
    # warps/block, gate rows/warp, down rows/warp, unroll, tokens/pass, widest word, register cap, streaming;
    # registers per thread from ptxas (sm_90, gate_up/down) as measured on 2026-11-29 in the comments
    CONFIGS = list(dict.fromkeys([
        moe.DEFAULT_CONFIG,
        C(8, 2, 4, 2, 4, 8),      # 16-byte loads x 2 words a trip (128/128 registers)
        C(8, 2, 4, 4, 4, 8),      # 16-byte loads x 4 (158/155: one block an SM)
        C(8, 1, 2, 4, 4, 8),      # fewer rows, 4 words a trip: same bytes in flight (99/106)
        C(8, 1, 2, 2, 4, 8),      # fewer rows per warp, more blocks (72/80: 3 blocks an SM)
        C(8, 2, 4, 4, 4, 4),      # 8-byte loads x 4 (128/105)
        C(8, 2, 4, 2, 4, 4),      # 8-byte loads x 2 (96/95)
        C(4, 2, 4, 2, 4, 4),      # the same in blocks of 4 warps
        C(8, 2, 4, 2, 2, 8),      # 2 tokens a pass (s=64: ~1.7 tokens per expert) (116/123)
        C(8, 1, 2, 2, 8, 8),      # 8 tokens a pass (s=256: ~5.3 tokens per expert) (91/104)
        C(8, 1, 2, 4, 8, 8),      # (128/128)
        C(4, 2, 4, 2, 4, 8),      # smaller blocks
        C(16, 2, 4, 2, 4, 8),     # larger blocks
        C(8, 2, 4, 2, 4, 2),      # 4-byte loads
        C(8, 2, 4, 2, 4, 8, 80),  # register cap: 3 blocks of 256 an SM (may spill)
        C(8, 1, 2, 4, 4, 8, 80),
        C(8, 2, 4, 2, 4, 8, 0, True),  # weights loaded evict-first (ld.global.cs)
        C(8, 1, 2, 4, 4, 8, 0, True),
        C(8, 1, 2, 2, 8, 8, 0, True),  # 8 tokens a pass, evict-first (k2-mini: 32 experts, several tokens each)
        C(8, 2, 4, 2, 8, 8, 0, True),
        C(8, 1, 2, 2, 16, 8, 0, True),  # 16 tokens a pass (k2-mini verify trees: ~60 tokens per expert at s=256)
        C(8, 2, 4, 2, 16, 8, 0, True),
        C(8, 1, 2, 1, 16, 8, 0, True),
        C(4, 1, 2, 2, 16, 8, 0, True),
        C(8, 1, 1, 2, 16, 8, 0, True),
        C(8, 1, 2, 2, 12, 8, 0, True),
    ]))
    WARMUP, REPEATS = 3, 12


def _option(name: str, default):
    """The value after ``name`` on the command line, or default."""
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args[:-1] else default


T, STAGED = experts_tc.TcConfig, experts_tc.StagedConfig
TC_CONFIGS = [experts_tc.FEW_PAIRS_CONFIG, experts_tc.MID_PAIRS_CONFIG,
              experts_tc.MANY_PAIRS_CONFIG, experts_tc.MOST_PAIRS_CONFIG] + ([] if ON_SIMULATOR else [
    # streaming: (k_split, n_tiles, chunks_per_step, register cap)
    T(4, 1, 1), T(4, 2, 1), T(4, 4, 1), T(8, 1, 2), T(4, 1, 3), T(4, 1, 4), T(4, 2, 2), T(4, 2, 2, 96),
    T(4, 2, 3), T(4, 3, 2), T(4, 4, 2), T(4, 2, 4), T(4, 3, 3), T(4, 4, 3),
    STAGED(2, 2, 4, 2, 4), STAGED(2, 4, 4, 2, 4), STAGED(2, 2, 4, 4, 4), STAGED(1, 4, 8, 2, 4), STAGED(2, 2, 4, 2, 8),
    STAGED(2, 4, 4, 2, 6), STAGED(1, 8, 8, 2, 4), STAGED(2, 2, 2, 4, 6), STAGED(3, 2, 4, 2, 4), STAGED(4, 2, 4, 2, 4),
    STAGED(2, 2, 6, 2, 4), STAGED(6, 1, 2, 4, 4), STAGED(5, 2, 4, 2, 4), STAGED(5, 2, 2, 4, 4),
    STAGED(5, 2, 2, 2, 3, 2), STAGED(4, 2, 2, 4, 3, 2), STAGED(2, 4, 4, 2, 3, 2), STAGED(2, 2, 4, 2, 4, 2),
    STAGED(4, 2, 4, 4, 3), STAGED(2, 4, 4, 4, 3)])
# staged: (warps_t, warps_w, token_tiles, weight_tiles, stages, chunks_per_stage, register cap)
TENSOR_CORES = "--tensor-cores" in sys.argv[1:]
GRAPHS = "--graphs" in sys.argv[1:] and not ON_SIMULATOR  # time each call as a CUDA graph replay
if TENSOR_CORES:
    CONFIGS = list(dict.fromkeys(TC_CONFIGS))
    if ON_SIMULATOR:
        D, F = 64, 32  # whole 32-column chunks
TC_RTOL = 1e-2  # x and act rounded to bf16 (2^-9 relative each) against a reference that keeps them fp32
E = int(_option("--experts", E))
TOKENS = tuple(int(t) for t in str(_option("--tokens", ",".join(map(str, TOKENS)))).split(","))
ONLY = set(_option("--only", "").split(",")) - {""}
RTOL = 1e-4
EXPERT_BYTES = 3 * D * F * 2  # one expert's bf16 gate, up and down



def config_name(index: int) -> str:
    if TENSOR_CORES:
        return f"t{index}" + ("*" if CONFIGS[index] in TC_CONFIGS[:4] else "")  # the four tc_config_for picks
    return f"c{index}" + ("*" if CONFIGS[index] == moe.DEFAULT_CONFIG else "")


def make_weights():
    """(w_gate_up [E, 2F, D], w_down [E, D, F]) as device int16 bf16 bits, plus the same weights for the
    reference: torch bf16 tensors on the GPU, numpy int16 bits under the simulator (fragment_weights lays them out
    for the tensor-core kernels)."""
    if ON_SIMULATOR:
        rng = np.random.default_rng(0)

        def bits(a):  # float -> bf16 bits (truncated): the reference widens the same bits
            return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
        gate_up = bits(rng.standard_normal((E, 2 * F, D)) * D ** -0.5)
        down = bits(rng.standard_normal((E, D, F)) * F ** -0.5)
        return cuda.to_device(gate_up), cuda.to_device(down), gate_up, down
    import torch
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn((E, 2 * F, D), generator=gen, device="cuda", dtype=torch.bfloat16).mul_(D ** -0.5)
    down = torch.randn((E, D, F), generator=gen, device="cuda", dtype=torch.bfloat16).mul_(F ** -0.5)
    torch.cuda.synchronize()
    return (cuda.as_cuda_array(gate_up.view(torch.int16)), cuda.as_cuda_array(down.view(torch.int16)), gate_up,
            down)


def fragment_weights(gate_up, down):
    """make_weights' reference copies as device arrays in the tensor-core kernels' experts_tc.fragment_layout."""
    if ON_SIMULATOR:
        return tuple(cuda.to_device(experts_tc.fragment_layout(w)) for w in (gate_up, down))
    import torch
    return tuple(cuda.as_cuda_array(experts_tc.fragment_layout(w.view(torch.int16))) for w in (gate_up, down))


def reference(x, ids, weights, tokens, gate_up, down):
    """float64 y[tokens] [len(tokens), D] = sum_slot w * down_e(silu(gate_e x) * up_e x), expert by expert,
    independent of the kernels. x float32 [s, D]; ids int32 [s, K]; weights float32 [s, K]."""
    if ON_SIMULATOR:
        def widen(b):
            return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        y = np.zeros((len(tokens), D))
        for i, t in enumerate(tokens):
            for slot in range(K):
                e = ids[t, slot]
                g, u, w = widen(gate_up[e, :F]), widen(gate_up[e, F:]), widen(down[e])
                xt = x[t].astype(np.float64)
                h = (g @ xt) / (1 + np.exp(-(g @ xt))) * (u @ xt)
                y[i] += weights[t, slot] * (w @ h)
        return y
    import torch
    xs = torch.as_tensor(x[tokens], device="cuda", dtype=torch.float64)
    y = torch.zeros((len(tokens), D), device="cuda", dtype=torch.float64)
    chosen = ids[tokens]
    for e in np.unique(chosen):
        rows, slots = np.nonzero(chosen == e)
        g, u, w = gate_up[int(e), :F].double(), gate_up[int(e), F:].double(), down[int(e)].double()
        xe = xs[torch.as_tensor(rows, device="cuda")]
        h = torch.nn.functional.silu(xe @ g.T) * (xe @ u.T)
        scale = torch.as_tensor(weights[tokens][rows, slots], device="cuda", dtype=torch.float64)[:, None]
        y.index_add_(0, torch.as_tensor(rows, device="cuda"), scale * (h @ w.T))
    return y.cpu().numpy()


def check(label: str, got: np.ndarray, want: np.ndarray, tokens, rtol: float = RTOL) -> bool:
    if not np.isfinite(got).all():
        log(f"  check {label}: FAIL output not fully written (NaN left) or non-finite")
        return False
    err = float(np.abs(got[tokens] - want).max() / np.abs(want).max())
    log(f"  check {label}: max err / max |ref| = {err:.2e} {'ok' if err <= rtol else 'FAIL'}")
    return err <= rtol


def breakdown(x, ids, gate_view, down_view, whole: float, config) -> dict:
    """Seconds of plan_pairs, grouped_swiglu (gate_up + down; with a TcConfig the tensor-core kernels and their
    bf16 rounding of x) alone, and the rest of a moe_experts call (combine and the launchers' host time, which
    the model's CUDA graphs do not pay)."""
    s = x.shape[0]
    plan = moe.plan_pairs(ids, E)
    act = cuda.device_array((s * K, F), np.float32)
    pair_out = cuda.device_array((s * K, D), np.float32)
    if isinstance(config, experts_tc.CONFIG_TYPES):
        def experts():
            experts_tc.grouped_swiglu_tc(x, K, plan, gate_view, down_view, act, pair_out, config=config)
    else:
        def experts():
            moe.grouped_swiglu(x, K, plan, gate_view, down_view, act, pair_out, config=config)
    parts = dict(plan=time_gpu(lambda: moe.plan_pairs(ids, E, plan), WARMUP, REPEATS),
                 experts=time_gpu(experts, WARMUP, REPEATS))
    parts["rest"] = whole - parts["plan"] - parts["experts"]
    return parts



def main() -> int:
    log(f"moe sweep: E={E} K={K} D={D} F={F} "
        f"{'CUDA simulator (times mean nothing)' if ON_SIMULATOR else cuda.get_current_device().name}")
    copy_bw = ceilings(quick=ON_SIMULATOR)["copy_bytes_per_s"]
    log(f"copy bandwidth ceiling (read + write): {copy_bw / 1e9:.0f} GB/s")
    w_gate_up, w_down, gate_up, down = make_weights()
    if not ON_SIMULATOR:  # a read-only roofline for context: torch's bf16 sum over 295 experts (s=64's count)
        import torch
        part = gate_up[:min(295, E)]
        read = time_gpu(lambda: torch.sum(part, dtype=torch.float32), WARMUP, REPEATS)
        log(f"read-only roofline (torch bf16 sum): {part.numel() * 2 / read / 1e9:.0f} GB/s "
            f"= {100 * part.numel() * 2 / read / copy_bw:.1f}% of copy bandwidth")
    gate_view = moe.weight_view(w_gate_up, "w_gate_up")
    down_view = moe.weight_view(w_down, "w_down")
    tc_gate_up, tc_down = fragment_weights(gate_up, down) if TENSOR_CORES else (None, None)
    rng = np.random.default_rng(0)
    table = []  # (s, name, seconds, bytes/s, ok)
    failures = 0
    for s in TOKENS:
        ids_h = np.argsort(rng.random((s, E)), axis=1)[:, :K].astype(np.int32)
        w_h = rng.random((s, K)).astype(np.float32)
        w_h /= w_h.sum(1, keepdims=True)
        x_h = rng.standard_normal((s, D)).astype(np.float32)
        x, ids, weights = cuda.to_device(x_h), cuda.to_device(ids_h), cuda.to_device(w_h)
        distinct = len(np.unique(ids_h))
        tokens = np.arange(s) if s <= 16 else np.sort(rng.choice(s, 16, replace=False))
        want = reference(x_h, ids_h, w_h, tokens, gate_up, down)
        log(f"s={s}: {distinct} distinct experts; reference on {len(tokens)} tokens")
        runs = [("auto", None)] + [(config_name(i), config) for i, config in enumerate(CONFIGS)
                                   if not ONLY or config_name(i).rstrip("*") in ONLY]
        for name, config in runs:
            tensor_cores = isinstance(config, experts_tc.CONFIG_TYPES)

            gate_up_w, down_w = (tc_gate_up, tc_down) if tensor_cores else (w_gate_up, w_down)

            def call(out, config=config, tensor_cores=tensor_cores, gate_up_w=gate_up_w, down_w=down_w):
                return moe.moe_experts(x, ids, weights, gate_up_w, down_w, out=out, config=config,
                                       tensor_cores=tensor_cores)
            out = cuda.to_device(np.full((s, D), np.nan, np.float32))
            try:
                ok = check(f"{name} s={s}", call(out).copy_to_host(), want, tokens,
                           TC_RTOL if tensor_cores else RTOL)
            except Exception as error:  # noqa: BLE001 - one broken config must not end the sweep
                log(f"  check {name} s={s}: FAIL {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                ok = False
            failures += not ok
            if not ok:
                continue  # a wrong config's speed means nothing
            if GRAPHS:
                import torch
                seconds = time_graph(torch, lambda stream: moe.moe_experts(
                    x, ids, weights, gate_up_w, down_w, out=out, config=config, tensor_cores=tensor_cores,
                    stream=stream))
            else:
                seconds = time_gpu(lambda: call(out), WARMUP, REPEATS)
            achieved = distinct * EXPERT_BYTES / seconds
            table.append((s, name, seconds, achieved, ok))
            log(f"  {name}: {seconds * 1e3:.3f} ms {achieved / 1e9:.0f} GB/s {100 * achieved / copy_bw:.1f}%")
            if tensor_cores:
                parts = breakdown(x, ids, moe.weight_view(tc_gate_up, "w_gate_up"), moe.weight_view(tc_down, "w_down"),
                                  seconds, config)
                log(f"  breakdown {name}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in parts.items())
                    + f"; kernels {distinct * EXPERT_BYTES / parts['experts'] / 1e9:.0f} GB/s "
                    f"{100 * distinct * EXPERT_BYTES / parts['experts'] / copy_bw:.1f}%")
        default = moe.default_config(s * K, E)
        auto = next((r for r in table if r[0] == s and r[1] == "auto"), None)
        if auto is not None:
            parts = breakdown(x, ids, gate_view, down_view, auto[2], default)
            log("  breakdown, default config: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in parts.items())
                + f"; gate_up + down {distinct * EXPERT_BYTES / parts['experts'] / 1e9:.0f} GB/s")

    log("\n== configs (* = DEFAULT_CONFIG; auto = moe_experts without config, i.e. default_config) ==")
    act = cuda.device_array((1, F), np.float32)  # freshly allocated: aligned like the launcher's workspace
    x_probe = cuda.device_array((1, D), np.float32)
    for i, config in enumerate(CONFIGS):
        if ONLY and config_name(i).rstrip("*") not in ONLY:
            continue
        if TENSOR_CORES:
            gate_up_kernel, down_kernel = config.kernels()
        else:
            gate_up_kernel = moe.expert_kernels(moe.word_width(gate_view, x_probe, config), config)[0]
            down_kernel = moe.expert_kernels(moe.word_width(down_view, act, config), config)[1]
        log(f"  {config_name(i)}: {config}; gate_up {kernel_resources(gate_up_kernel, ON_SIMULATOR)}; "
            f"down {kernel_resources(down_kernel, ON_SIMULATOR)}")

    log(f"\n{'s':>4} {'config':>6} {'ms':>9} {'GB/s':>7} {'%copy':>6}")
    for s, name, seconds, achieved, _ in table:
        log(f"{s:>4} {name:>6} {seconds * 1e3:>9.3f} {achieved / 1e9:>7.0f} {100 * achieved / copy_bw:>6.1f}")
    swept = [config_name(i) for i in range(len(CONFIGS))]
    for s in TOKENS:
        rows = [r for r in table if r[0] == s and r[1] in swept]
        auto = next((r for r in table if r[0] == s and r[1] == "auto"), None)
        if rows:
            best = max(rows, key=lambda r: r[3])
            log(f"best s={s}: {best[1]} {CONFIGS[swept.index(best[1])]} {100 * best[3] / copy_bw:.1f}% of copy "
                f"({best[2] * 1e3:.3f} ms)" + (f"; auto {100 * auto[3] / copy_bw:.1f}% ({auto[2] * 1e3:.3f} ms)"
                                                if auto else ""))
    complete = [n for n in swept if sum(r[1] == n for r in table) == len(TOKENS)]  # correct at every s
    if complete:  # one DEFAULT_CONFIG for every s: the best geometric mean of the bandwidth over s
        score = {n: math.exp(np.mean([math.log(r[3]) for r in table if r[1] == n])) for n in complete}
        best = max(complete, key=score.get)
        log(f"best over all s (geometric mean {score[best] / 1e9:.0f} GB/s): {best} {CONFIGS[swept.index(best)]}")
    if failures:
        log(f"CHECKS FAILED: {failures}")
        return 1
    log("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
