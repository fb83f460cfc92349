"""MLA attention sweep: every TileConfig against a float64 reference, then its TFLOP/s next to torch and the ceiling.

    python3 -m tools.sweeps.attention          (H200: ~2 min)
    python3 -m tools.sweeps.attention --sim    (CUDA simulator, toy sizes: a few seconds; the times mean nothing)

Kimi K2 dims: h=64 heads, c=512 latent, r=64 rope; a random tree mask over the s in-flight rows.
1. correctness: every config (and "auto" = mla_attention without config, what `kdtree bench attention` runs)
   against a float64 numpy reference on sampled rows (rel tol 1e-4 of max |ref|), P in 1024 / 8192, s in 1, 8,
   64, 256, default split counts plus 3 forced splits for s <= 8; outputs NaN-poisoned, all rows checked
   finite; cache rows past the in-flight ones are NaN (must never be read).
2. timing (CUDA events, median of 10 after warmup) at the bench's points; TFLOP/s counted as
   kdspec.engine.bench.attention.attention_flops, next to torch (fp32 matmul + masked softmax + matmul,
   TF32 off) and the fp32 FMA ceiling (kdspec.engine.bench.common.ceilings); for s <= 8 also half / twice
   the default split count and 132 splits (is default_num_splits right?).
3. registers / local memory (spills) / shared memory per config; a table last, then the best config per point
   and for the two defaults: make them DEFAULT_CONFIG (s >= FEW_TOKENS) and FEW_TOKENS_CONFIG (s < FEW_TOKENS)
   in numba_kernels/attention/simt.py.
"""
import math
import os
import sys
import time

if "--sim" in sys.argv[1:]:  # before numba is imported: the simulator is chosen at import time
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from kdspec.engine.bench.attention import attention_flops, random_tree_visibility  # noqa: E402
from kdspec.engine.bench.common import ceilings, time_gpu, torch_cuda  # noqa: E402
from kdspec.numba_kernels.attention import common, dispatch, simt  # noqa: E402
from kdspec.numba_kernels.attention.simt import TileConfig  # noqa: E402
from kdspec.numba_kernels.runtime import ON_SIMULATOR
from tools.sweeps.report import kernel_resources, log  # noqa: E402

if ON_SIMULATOR:
    HEADS, LATENT, ROPE = 2, 16, 4
    CHECK_POINTS = [(9, 1), (9, 6)]
    TIME_POINTS = [(9, 4)]
    CONFIGS = {"sim-default": simt.DEFAULT_CONFIG,
               "sim-b": TileConfig(rows=4, keys=8, d_chunk=2, v_chunk=4, s_rows=2, s_keys=2, o_cols=4, threads=8)}
    WARMUP, REPEATS = 1, 2
else:
    HEADS, LATENT, ROPE = 64, 512, 64
    CHECK_POINTS = [(1024, 1), (1024, 8), (1024, 64), (1024, 256), (8192, 1), (8192, 8), (8192, 64), (8192, 256)]
    TIME_POINTS = [(8192, 64), (1024, 8), (8192, 8), (1024, 64), (8192, 256), (32768, 64), (8192, 1), (1024, 1)]
    CONFIGS = {  # ptxas sm_90 registers / spill bytes as measured on 2026-11-29 in the comments
        "A 64x64 s4x4 o8x16": TileConfig(),                                          # 255 / ~650
        "A16 d16 v4": TileConfig(d_chunk=16, v_chunk=4),                              # 255 / ~400
        "C1 32x128 s4x4 o4x16": TileConfig(rows=32, keys=128, d_chunk=16, v_chunk=4, s_rows=4, s_keys=4),  # 255 / ~400
        "E 32x64 s2x4 o8x8": TileConfig(rows=32, keys=64, d_chunk=16, v_chunk=4, s_rows=2, s_keys=4,
                                        o_cols=8),                                    # 255 / 8
        "F 64x128 s4x4 o8x8 T512": TileConfig(rows=64, keys=128, d_chunk=16, v_chunk=4, s_rows=4, s_keys=4,
                                              o_cols=8, threads=512),                 # 128 / ~640
        "G 64x64 s2x4 o8x8 T512": TileConfig(rows=64, keys=64, d_chunk=16, v_chunk=8, s_rows=2, s_keys=4,
                                             o_cols=8, threads=512),                  # 128 / ~500
    }
    WARMUP, REPEATS = 2, 10
SCALE = (128 + ROPE) ** -0.5
RTOL = 1e-4
AUTO = "auto"  # mla_attention without config: the kernel attention_path picks (decode / tensor cores / SIMT)



def role(config: TileConfig) -> str:
    """Which module default a config is (a suffix for its name)."""
    roles = [name for name, value in (("DEFAULT_CONFIG", simt.DEFAULT_CONFIG),
                                      ("FEW_TOKENS_CONFIG", simt.FEW_TOKENS_CONFIG)) if value == config]
    return f" (= {' = '.join(roles)})" if roles else ""


def reference_rows(q_lat, q_pe, cache, prefix, visible, rows) -> np.ndarray:
    """o float64 [len(rows), c] for the flat (token * h + head) row indices ``rows``."""
    keys = cache[:prefix + visible.shape[0]].astype(np.float64)
    out = []
    for row in rows:
        token, head = divmod(int(row), HEADS)
        query = np.concatenate([q_lat[token, head], q_pe[token, head]]).astype(np.float64)
        scores = keys @ query * SCALE
        seen = np.concatenate([np.ones(prefix, bool), visible[token]])
        scores[~seen] = -np.inf
        weights = np.exp(scores - scores.max())
        out.append(weights @ keys[:, :LATENT] / weights.sum())
    return np.array(out)


def check(config, prefix: int, tokens: int, num_splits, rng) -> str:
    """'ok  rel err E' or 'FAIL ...' for one launch (config None: the launcher's choice)."""
    visible = random_tree_visibility(tokens, rng)
    q_lat = rng.standard_normal((tokens, HEADS, LATENT)).astype(np.float32)
    q_pe = rng.standard_normal((tokens, HEADS, ROPE)).astype(np.float32)
    cache = rng.standard_normal((prefix + tokens + 16, LATENT + ROPE)).astype(np.float32)
    cache[prefix + tokens:] = np.nan  # rows past the in-flight ones must never be read
    out = cuda.to_device(np.full((tokens, HEADS, LATENT), np.nan, np.float32))
    dispatch.mla_attention(q_lat, q_pe, cache, prefix, common.pack_visibility(visible), SCALE, out=out,
                      num_splits=num_splits, config=config)
    got = out.copy_to_host().reshape(tokens * HEADS, LATENT)
    if not np.isfinite(got).all():
        return f"FAIL not fully written / non-finite ({int((~np.isfinite(got)).sum())} entries)"
    rows = np.unique(np.concatenate([rng.choice(tokens * HEADS, min(24, tokens * HEADS), replace=False),
                                     [0, tokens * HEADS - 1]]))
    want = reference_rows(q_lat, q_pe, cache, prefix, visible, rows)
    err = np.abs(got[rows] - want).max() / max(np.abs(want).max(), 1e-30)
    return f"{'ok  ' if err <= RTOL else 'FAIL'} rel err {err:.2e}"


def resources(config: TileConfig) -> str:
    """'regs R, local L B, shared S B' of the config's kernel (compiled by the checks; '-' on the simulator)."""
    return kernel_resources(simt.attention_kernel(config), ON_SIMULATOR)


def torch_peer(torch, q_lat, q_pe, layer, visible, prefix, tokens):
    """A closure running the same attention in torch fp32 (matmul, masked softmax, matmul)."""
    t_cache = torch.as_tensor(layer, device="cuda")
    q_cat = torch.cat([torch.as_tensor(q_lat, device="cuda"), torch.as_tensor(q_pe, device="cuda")],
                      dim=-1).reshape(tokens * HEADS, LATENT + ROPE)
    bias = torch.zeros((tokens, prefix + tokens), device="cuda")
    bias[:, prefix:].masked_fill_(~torch.as_tensor(visible, device="cuda"), float("-inf"))

    def peer():
        scores = (q_cat @ t_cache.T) * SCALE
        scores = scores.view(tokens, HEADS, -1) + bias[:, None, :]
        return torch.softmax(scores, dim=-1).view(tokens * HEADS, -1) @ t_cache[:, :LATENT]
    return peer


def main() -> int:
    started = time.time()
    log(f"attention sweep: h={HEADS} c={LATENT} r={ROPE} "
        f"{'CUDA simulator (times mean nothing)' if ON_SIMULATOR else cuda.get_current_device().name}")
    peak = ceilings(quick=ON_SIMULATOR)["fma_flops"]
    log(f"fp32 FMA ceiling {peak / 1e12:.2f} TFLOP/s")
    runs = {AUTO: None, **CONFIGS}

    log(f"\n== correctness (float64 reference on sampled rows, rel tol {RTOL:g}) ==")
    failures = 0
    broken = set()
    for name, config in runs.items():
        for prefix, tokens in CHECK_POINTS:
            for splits in ([None, 3] if tokens <= 8 else [None]):
                try:
                    verdict = check(config, prefix, tokens, splits, np.random.default_rng(prefix + tokens))
                except Exception as error:  # noqa: BLE001 - one broken config must not end the sweep
                    verdict = f"FAIL {type(error).__name__}: {str(error).splitlines()[0][:160]}"
                if verdict.startswith("FAIL"):
                    failures += 1
                    broken.add(name)
                log(f"{name:28s} P={prefix:5d} s={tokens:3d} splits={splits}: {verdict}")
    resource_lines = {name: f"{name:28s}{role(config)}: {config}\n{'':28s} {resources(config)}"
                      for name, config in CONFIGS.items() if name not in broken}

    torch = torch_cuda()
    log(f"\n== timing (median of {REPEATS}, CUDA events) ==")
    rng = np.random.default_rng(0)
    max_rows = max(p for p, _ in TIME_POINTS) + max(s for _, s in TIME_POINTS)
    cache = cuda.to_device(rng.standard_normal((max_rows, LATENT + ROPE)).astype(np.float32))
    table = []
    seconds_at = {}  # ((P, s), config name) -> seconds at the default split count
    for prefix, tokens in TIME_POINTS:
        visible = random_tree_visibility(tokens, rng)
        mask = cuda.to_device(common.pack_visibility(visible))
        q_lat = cuda.to_device(rng.standard_normal((tokens, HEADS, LATENT)).astype(np.float32))
        q_pe = cuda.to_device(rng.standard_normal((tokens, HEADS, ROPE)).astype(np.float32))
        out = cuda.device_array((tokens, HEADS, LATENT), np.float32)
        layer = cache[:prefix + tokens]
        flops = attention_flops(prefix, visible, HEADS, LATENT, ROPE)
        results = {}
        for name, config in runs.items():
            if name in broken:
                continue  # a wrong config's speed means nothing
            def call(splits=None, config=config):
                return dispatch.mla_attention(q_lat, q_pe, layer, prefix, mask, SCALE, out=out, config=config,
                                         num_splits=splits)
            seconds_at[(prefix, tokens), name] = results[name] = time_gpu(call, WARMUP, REPEATS)
            if tokens <= 8 and not ON_SIMULATOR:  # small s: is the default split count right?
                chosen = config or (simt.FEW_TOKENS_CONFIG if tokens < common.FEW_TOKENS else simt.DEFAULT_CONFIG)
                splits = simt.default_num_splits(tokens * HEADS, prefix + tokens, chosen)
                results[name + f" (default splits={splits})"] = results.pop(name)
                for forced in sorted({max(1, splits // 2), splits * 2, 132} - {splits}):
                    results[f"{name} splits={forced}"] = time_gpu(lambda: call(forced), WARMUP, REPEATS)
        if torch is not None:
            results["torch fp32"] = time_gpu(torch_peer(torch, q_lat, q_pe, layer, visible, prefix, tokens),
                                             WARMUP, REPEATS)
        for name, seconds in results.items():
            line = (f"P={prefix:5d} s={tokens:3d}  {name:48s} {seconds * 1e3:9.3f} ms  "
                    f"{flops / seconds / 1e12:6.2f} TFLOP/s  {100 * flops / seconds / peak:5.1f}% of FMA peak")
            log(line)
            table.append(line)
        log(f"   (elapsed {time.time() - started:.0f} s)")

    log("\n== registers / local memory / shared memory per config ==")
    for text in resource_lines.values():
        log(text)
    log(f"\n== table: fp32 FMA ceiling {peak / 1e12:.2f} TFLOP/s; bench target at P=8192 s=64: >= 50% of it "
        "and faster than torch ==")
    for line in table:
        log(line)
    for point in TIME_POINTS:
        timed = {name: seconds_at[point, name] for name in CONFIGS if (point, name) in seconds_at}
        if timed:
            best = min(timed, key=timed.get)
            auto = seconds_at.get((point, AUTO), math.nan)
            log(f"best P={point[0]} s={point[1]}: {best}{role(CONFIGS[best])} {timed[best] * 1e3:.3f} ms "
                f"(auto {auto * 1e3:.3f} ms)")
    for label, few in (("FEW_TOKENS_CONFIG (s < FEW_TOKENS)", True), ("DEFAULT_CONFIG (s >= FEW_TOKENS)", False)):
        points = [p for p in TIME_POINTS if (p[1] < common.FEW_TOKENS) == few]
        complete = [n for n in CONFIGS if points and all((p, n) in seconds_at for p in points)]
        if complete:  # geometric mean of the times over the points that default serves
            mean = {n: math.exp(np.mean([math.log(seconds_at[p, n]) for p in points])) for n in complete}
            best = min(complete, key=mean.get)
            log(f"best for {label}: {best} {CONFIGS[best]} (geometric mean {mean[best] * 1e3:.3f} ms over "
                f"{len(points)} points){role(CONFIGS[best])}")
    log(f"total {time.time() - started:.0f} s")
    if failures:
        log(f"CHECKS FAILED: {failures} (configs {sorted(broken)})")
        return 1
    log("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
