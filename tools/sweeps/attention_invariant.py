"""Batch-invariant attention sweep: launch shapes of attention/invariant.py (fp32) and of its tensor-core form
attention/invariant_tc.py (tf32 mma; the bf16 model's), each checked bit for bit against its kernel's default
shape, then timed as graph replays, side by side in one run.

    python3 -m tools.sweeps.attention_invariant          (H200: ~1-2 min)
    python3 -m tools.sweeps.attention_invariant --sim    (CUDA simulator, toy sizes: seconds; times mean nothing)

Kimi K2 dims: h=64 heads, c=512 latent, r=64 rope; at each point (P committed rows, s query tokens) a random tree
over the s in-flight rows, as a verify sees them (s = 1: an AR step).
1. bits: every shape's output (NaN-poisoned first) has the default shape's bits on every row: a launch shape may
   differ only in the fields that do not set a row's arithmetic (invariant.ROW_ARITHMETIC_FIELDS are kept), so
   the engine can pick one by token count and a verify still equals its AR steps;
2. timing (the simulator's wall time means nothing): GPU microseconds of one launch, the median of graph replays
   of REPLAY_LAUNCHES launches (as the device model runs it, inside its step graphs, without Python's launch
   time); registers per shape.
The `best s=...` lines are the candidates for invariant.LAUNCH_SHAPES (each token count's shape); the `tensor
cores s=...` lines give the tensor-core kernel's default against the fp32 kernel's best (time ratio, and how far its
tf32 output is from the fp32 one, relative to the largest output).
"""
import os
import sys

if "--sim" in sys.argv[1:]:  # before numba is imported: the simulator is chosen at import time
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402

from kdspec.engine.bench.attention import random_tree_visibility  # noqa: E402
from kdspec.numba_kernels.attention import invariant, invariant_tc  # noqa: E402
from kdspec.numba_kernels.attention.common import pack_visibility  # noqa: E402
from kdspec.numba_kernels.attention.decode import DEFAULT_CONFIG, decode_kernel  # noqa: E402
from kdspec.numba_kernels.runtime import ON_SIMULATOR  # noqa: E402
from tools.sweeps.report import kernel_resources, log  # noqa: E402

D = DEFAULT_CONFIG
if ON_SIMULATOR:
    HEADS, LATENT, ROPE = 4, 16, 4
    POINTS = [(5, 1), (3, 6)]
    SHAPES = {"default": D, "h1 vu1": D._replace(heads=1, value_unroll=1),
              "h4 t8": D._replace(heads=4, key_group=2, threads=8)}
    TC_SHAPES = {"tc default": invariant_tc.DEFAULT_CONFIG, "tc stages2": invariant_tc.TcAttentionConfig(stages=2),
                 "tc kg2": invariant_tc.TcAttentionConfig(key_groups=2)}
    REPLAY_LAUNCHES = 1
else:
    HEADS, LATENT, ROPE = 64, 512, 64
    POINTS = [(96, 1), (480, 1), (96, 8), (96, 64), (96, 256)]
    SHAPES = {
        "default h8 vu4 t256": D,
        "h8 vu8": D._replace(value_unroll=8),
        "h8 vu16": D._replace(value_unroll=16),
        "h4 vu8": D._replace(heads=4, value_unroll=8),
        "h2 vu8": D._replace(heads=2, value_unroll=8),
        "h2 vu16": D._replace(heads=2, value_unroll=16),
        "h1 vu8": D._replace(heads=1, value_unroll=8),
        "h1 vu16": D._replace(heads=1, value_unroll=16),
        "h2 vu8 t128": D._replace(heads=2, value_unroll=8, threads=128),
        "h1 vu16 t128": D._replace(heads=1, value_unroll=16, threads=128),
        "h2 vu8 t512": D._replace(heads=2, value_unroll=8, threads=512),
        "h8 vu8 t128 b2": D._replace(value_unroll=8, threads=128, blocks_per_sm=2),
        "h4 vu8 t128 b3": D._replace(heads=4, value_unroll=8, threads=128, blocks_per_sm=3),
        "h8 vu4 t512": D._replace(threads=512),
        "h16 kg2 vu4": D._replace(heads=16, key_group=2),
    }
    TC_SHAPES = {
        "tc default s1 b2": invariant_tc.DEFAULT_CONFIG,
        "tc s2 b1": invariant_tc.TcAttentionConfig(stages=2, blocks_per_sm=1),
        "tc s1 b1": invariant_tc.TcAttentionConfig(stages=1, blocks_per_sm=1),
        "tc s1 b1 kg2": invariant_tc.TcAttentionConfig(stages=1, blocks_per_sm=1, key_groups=2),
        "tc s2 b1 kg2": invariant_tc.TcAttentionConfig(stages=2, blocks_per_sm=1, key_groups=2),
        "tc s1 b1 kg4": invariant_tc.TcAttentionConfig(stages=1, blocks_per_sm=1, key_groups=4),
    }
    REPLAY_LAUNCHES = 20
ALL_SHAPES = {**SHAPES, **TC_SHAPES}
SCALE = (128 + ROPE) ** -0.5


def main() -> int:
    from numba import cuda
    from kdspec.engine.bench.common import time_gpu, time_graph, torch_cuda
    rng = np.random.default_rng(0)
    torch = torch_cuda()
    failures, times, tf32_error = [], {name: {} for name in ALL_SHAPES}, {}
    for prefix, tokens in POINTS:
        visibility = cuda.to_device(pack_visibility(random_tree_visibility(tokens, rng)))
        q_lat = cuda.to_device(rng.standard_normal((tokens, HEADS, LATENT), dtype=np.float32))
        q_pe = cuda.to_device(rng.standard_normal((tokens, HEADS, ROPE), dtype=np.float32))
        cache = cuda.to_device(rng.standard_normal((prefix + tokens, LATENT + ROPE), dtype=np.float32))
        keys = invariant.visible_keys(visibility, tokens)
        references = {}  # kernel -> the output of its default shape (the first of its shapes)
        for name, shape in ALL_SHAPES.items():
            out = cuda.to_device(np.full((tokens, HEADS, LATENT), np.nan, np.float32))
            kind = "tc" if name in TC_SHAPES else "fp32"

            def run(stream=0, shape=shape, out=out, kind=kind):
                if kind == "tc":
                    return invariant_tc.mla_attention_invariant_tc(q_lat, q_pe, cache, prefix, visibility, SCALE,
                                                                   keys=keys, out=out, stream=stream, config=shape)
                return invariant.mla_attention_invariant(q_lat, q_pe, cache, prefix, visibility, SCALE, keys=keys,
                                                         out=out, stream=stream, shape=shape)
            result = run().copy_to_host()
            reference = references.get(kind)
            if reference is None:
                references[kind] = result
                if not np.isfinite(result).all():
                    failures.append(f"{name} P={prefix} s={tokens}: not finite")
                if kind == "tc":
                    fp32 = references["fp32"]
                    tf32_error[prefix, tokens] = float(np.abs(result - fp32).max() / np.abs(fp32).max())
            elif not np.array_equal(result.view(np.uint32), reference.view(np.uint32)):
                rows = np.unique(np.nonzero(result.view(np.uint32) != reference.view(np.uint32))[0])
                failures.append(f"{name} P={prefix} s={tokens}: bits differ from the default at tokens {rows[:8]}")
            def launches(stream=0, run=run):
                for _ in range(REPLAY_LAUNCHES):
                    run(stream)
            seconds = time_graph(torch, launches) if torch is not None else time_gpu(launches, 0, 1)
            times[name][prefix, tokens] = seconds / REPLAY_LAUNCHES * 1e6
    header = f"{'shape':22} {'resources':44}" + "".join(f" {f'P={p} s={s}':>12}" for p, s in POINTS)
    log(header)
    for name, shape in ALL_SHAPES.items():
        kernel = invariant_tc.invariant_tc_kernel(shape) if name in TC_SHAPES \
            else decode_kernel(invariant.invariant_config(HEADS, shape=shape))
        cells = "".join(f" {times[name].get(point, float('nan')):10.1f}us" for point in POINTS)
        log(f"{name:22} {kernel_resources(kernel, ON_SIMULATOR):44}{cells}")
    for point in POINTS:
        best = min(SHAPES, key=lambda name: times[name][point])
        log(f"best s={point[1]} P={point[0]}: {best} ({times[best][point]:.1f} us; default "
            f"{times[next(iter(SHAPES))][point]:.1f} us)")
    tc_default = next(iter(TC_SHAPES))
    for point in POINTS:
        best = min(SHAPES, key=lambda name: times[name][point])
        speedup = times[best][point] / times[tc_default][point]
        log(f"tensor cores s={point[1]} P={point[0]}: {times[tc_default][point]:.1f} us, {speedup:.2f}x as fast as "
            f"fp32's best ({best}); max |tf32 - fp32| {tf32_error[point]:.2g} of the largest output")
    for failure in failures:
        log(f"FAILED {failure}")
    log("CHECKS FAILED" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
