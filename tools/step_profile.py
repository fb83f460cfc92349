"""Where a decode step's host time goes (issue #19): k2-mini (bf16 weights) on the device model, the engine's
own AR run as the oracle's golden (as `kdtree bench e2e` does), then one AR decode and one DDTree oracle decode
at each budget under cProfile, after warm-up runs that compile every kernel. Prints the per-step stage times and,
per run, the functions with the most own time and the most time inside them. With ``--kernels``: torch's
profiler instead of cProfile, and per run the GPU kernels with the most GPU time per step (where the device
time goes, not the host's).

    python3 -W ignore tools/step_profile.py [--model k2-mini] [--budgets 7,63] [--tokens 64] [--top 30] [--out DIR]
                                            [--kernels | --timeline] [--variant] [--many-pairs 5,2,1,4,4]
                                            [--tensor-core-experts]

Run on the GPU machine; ``--out`` also writes each run's pstats dump (snakeviz / pstats can read it).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import numpy as np

PROMPT_TOKENS = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="k2-mini", help="a preset (tiny runs under the CUDA simulator)")
    parser.add_argument("--budgets", default="7,63")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kernels", action="store_true", help="GPU time per kernel (torch profiler)")
    parser.add_argument("--timeline", action="store_true",
                        help="no profiler: per step, the host's turn from the results read to the next launch")
    parser.add_argument("--variant", action="store_true",
                        help="the bf16 model without batch invariance (the forward before issue #19)")
    parser.add_argument("--many-pairs", default=None, metavar="WARPS_T,WARPS_W,TOKEN_TILES,WEIGHT_TILES,STAGES",
                        help="the experts' launch shape above MID_PAIRS pairs an expert (experts_tc's "
                             "MANY_PAIRS_CONFIG and MOST_PAIRS_CONFIG both): a StagedConfig's numbers or "
                             "wgmma:TOKENS,STAGES,CHUNKS_PER_STAGE (a WgmmaConfig); implies --tensor-core-experts")
    parser.add_argument("--tensor-core-experts", action="store_true",
                        help="the routed experts on the Numba tensor-core kernels (moe/experts_tc.py) instead of "
                             "torch's grouped GEMM (the default on cuda)")
    args = parser.parse_args()
    if args.many_pairs:  # before any forward: tc_config_for reads the module's configs at each call
        from kdspec.numba_kernels.moe import experts_tc
        from tools.experts_sass import config_from_text
        experts_tc.MANY_PAIRS_CONFIG = experts_tc.MOST_PAIRS_CONFIG = config_from_text(args.many_pairs)
        print(f"MANY_PAIRS_CONFIG = MOST_PAIRS_CONFIG = {experts_tc.MANY_PAIRS_CONFIG}")
    from kdspec.engine.device.model import DeviceModel
    from kdspec.engine.device.tree_ops import DeviceTreeOps
    from kdspec.engine.model.config import PRESETS
    from kdspec.engine.model.weights import SeededWeights
    from kdspec.numba_kernels.runtime import ON_SIMULATOR
    from kdspec.traces.schema import STAGES

    cfg = PRESETS[args.model]
    tensor_core_experts = args.tensor_core_experts or bool(args.many_pairs) or None  # None: the model's default
    model = DeviceModel(cfg, SeededWeights(cfg, 0), "sim" if ON_SIMULATOR else "cuda", weight_dtype="bfloat16",
                        batch_invariant=not args.variant, tensor_core_experts=tensor_core_experts)
    ops = DeviceTreeOps()
    runs = decodes(model, ops, args.tokens, [int(b) for b in args.budgets.split(",")])
    for decode in runs.values():   # compile every kernel of every run before profiling
        decode()
    if args.timeline:
        host_turns(runs, ops)
        return
    if args.kernels:  # each run warmed up again right before its profile: the captured graphs are its own
        kernel_tables(runs, args.top)
        return
    summary = []
    for name, decode in runs.items():
        profiler = cProfile.Profile()
        profiler.enable()
        result = decode()
        profiler.disable()
        per_step = {stage: result.stage_times[stage] / result.steps * 1e3 for stage in STAGES}
        wall = (result.elapsed - result.prefill_time) / result.steps * 1e3
        summary.append(f"{name:22s} {result.steps:3d} steps, tau {result.mean_tau:.2f}, {wall:.3g} ms/step: "
                       + ", ".join(f"{stage} {ms:.3g}" for stage, ms in per_step.items()))
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        print(f"===== {name} (cProfile slows Python: compare shares, not times)\n{text.getvalue()}")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            stats.dump_stats(args.out / (name.replace(" ", "_").replace("=", "") + ".pstats"))
    print("\n".join(summary))


def decodes(model, ops, tokens: int, budgets: list) -> dict:
    """{"AR": decode, "DDTree oracle B=<budget>": decode, ...}: functions that each run one decode of ``tokens``
    tokens from a fixed prompt of PROMPT_TOKENS tokens, the oracle's golden the engine's own AR run (made here)."""
    from kdspec.engine.decode.config import DecodeConfig
    from kdspec.engine.decode.drafters import parse_drafter
    from kdspec.engine.decode.loop import generate
    cfg = model.cfg
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, PROMPT_TOKENS).astype(np.int64)
    block = 8
    ar = generate(model, prompt, DecodeConfig(tokens + block), tree_ops=ops)   # warm-up and the golden
    golden = np.concatenate([prompt, ar.tokens])
    runs = {"AR": lambda: generate(model, prompt, DecodeConfig(tokens), tree_ops=ops)}
    for budget in budgets:
        drafter = parse_drafter("oracle").build(golden, block - 1, min(budget, cfg.vocab_size), cfg.vocab_size)
        config = DecodeConfig(tokens, mode="ddtree", block_size=block, budget=budget)
        runs[f"DDTree oracle B={budget}"] = (lambda c=config, d=drafter: generate(model, prompt, c, d, tree_ops=ops))
    return runs


def kernel_tables(runs: dict, top: int) -> None:
    """Per run: GPU milliseconds per step of the ``top`` kernels (and copies) with the most GPU time, from
    torch's profiler (CUPTI sees Numba's kernels and cuBLAS's alike), and the step's total GPU busy time."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    for name, decode in runs.items():
        decode()  # a decode over another run's cache arrays drops the step graphs: capture this run's again
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            result = decode()
        per_kernel = defaultdict(float)
        calls = defaultdict(int)
        for event in profiler.events():
            if event.device_type == DeviceType.CUDA:
                key = event.name[:90]
                per_kernel[key] += (event.time_range.end - event.time_range.start) * 1e-3
                calls[key] += 1
        total = sum(per_kernel.values())
        print(f"===== {name}: {result.steps} steps, tau {result.mean_tau:.2f}, GPU time {total / result.steps:.3f} "
              f"ms/step (kernels summed)")
        gpu_events = [event for event in profiler.events() if event.device_type == DeviceType.CUDA]
        print("  " + idle_split(gpu_events, result.steps))
        for (before, after), (ms, count) in largest_gaps(gpu_events, result.steps, 8):
            print(f"    gap {ms:7.3f} ms/step {count:5.1f}/step  {before[:60]} -> {after[:60]}")
        for key, ms in sorted(per_kernel.items(), key=lambda item: -item[1])[:top]:
            print(f"  {ms / result.steps:8.3f} ms/step {100 * ms / total:5.1f}% {calls[key] / result.steps:6.1f} "
                  f"calls/step  {key}")


def host_turns(runs: dict, ops, repeats: int = 3) -> None:
    """Per run, unprofiled: the host's turn of each step, from the moment the last step's results are on the
    host (its download returned) to the moment this step's launch call returned (DeviceSteps' graph replay or
    eager launches queued), split into the time before the step's launch call (the decode loop, drafting) and
    inside it; the decode's wall time per step; and, from GPU-clock stamps at each step's first and last launch
    (``ops.step_stamps``), the GPU's idle time between two steps: idle - turn is the way from the host's
    launch call to the GPU and back from the GPU to the host's read."""
    from kdspec.engine.device import step as device_step
    from kdspec.numba_kernels.clock import Stamps
    ops.step_stamps = stamps = Stamps(4096)
    marks = []
    download, queue = device_step.download, {}

    def timed_download(*args, **kwargs):
        out = download(*args, **kwargs)
        marks.append(("read", time.perf_counter()))
        return out

    def timed(name):
        method = getattr(device_step.DeviceSteps, name)
        queue[name] = method

        def wrapper(self, *args, **kwargs):
            marks.append(("call", time.perf_counter()))
            out = method(self, *args, **kwargs)
            marks.append(("queued", time.perf_counter()))
            return out
        return wrapper

    device_step.download = timed_download
    for name in ("ar", "ddtree"):
        setattr(device_step.DeviceSteps, name, timed(name))
    try:
        for name, decode in runs.items():
            decode()
            before, inside, walls, idle = [], [], [], []
            for _ in range(repeats):
                marks.clear()
                stamps.clear()
                result = decode()
                walls.append((result.elapsed - result.prefill_time) / result.steps)
                spans = stamps.spans()
                idle.extend(spans[1:, 0] - spans[:-1, 1])
                read = None
                for (kind, at), (next_kind, next_at) in zip(marks, marks[1:]):
                    if kind == "read":
                        read = at
                    if kind == "call" and next_kind == "queued" and read is not None:
                        before.append(at - read)
                        inside.append(next_at - at)
                        read = None
            if not before:
                print(f"{name:22s} wall {np.median(walls) * 1e3:7.3f} ms/step; no host turn (one step a decode)")
                continue
            turn = np.add(before, inside)
            print(f"{name:22s} wall {np.median(walls) * 1e3:7.3f} ms/step; host turn median {np.median(turn) * 1e3:.3f} "
                  f"mean {turn.mean() * 1e3:.3f} p90 {np.percentile(turn, 90) * 1e3:.3f} ms = before the launch call "
                  f"{np.median(before) * 1e3:.3f} + in it {np.median(inside) * 1e3:.3f} (medians, {len(turn)} turns); "
                  f"GPU idle between steps median {np.median(idle) * 1e3:.3f} mean {np.mean(idle) * 1e3:.3f} "
                  f"max {np.max(idle) * 1e3:.3f} ms")
    finally:
        ops.step_stamps = None
        device_step.download = download
        for name, method in queue.items():
            setattr(device_step.DeviceSteps, name, method)


def idle_gaps(events):
    """The GPU's idle intervals between the first and the last of ``events`` (the profiler's CUDA events), in
    time order: (milliseconds, name of the event whose end began it, name of the event that ended it)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    reach, last = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > reach:
            yield (start - reach) * 1e-3, last, name  # us -> ms
        if end >= reach:
            reach, last = end, name


def _is_result_read(name: str) -> bool:
    return "DtoH" in name or "Device -> Pinned" in name or "DtoP" in name


def idle_split(events, steps: int) -> str:
    """Where the GPU sat idle, per step: after a device-to-host copy (the host's turn: reading the results,
    drafting, the next launch) and everywhere else (gaps between the kernels of a step: inside a graph, or eager
    launches), the latter also as its count of gaps and those of 10 us or more."""
    after_read = elsewhere = 0.0
    gaps = long_gaps = 0
    for gap, before, _ in idle_gaps(events):
        if _is_result_read(before):
            after_read += gap
        else:
            elsewhere += gap
            gaps += 1
            long_gaps += gap >= 0.01
    return (f"GPU idle per step: {after_read / steps:.3f} ms after a result read (the host's turn), "
            f"{elsewhere / steps:.3f} ms between a step's kernels ({gaps / steps:.1f} gaps a step, "
            f"{long_gaps / steps:.1f} of them >= 10 us)")


def largest_gaps(events, steps: int, top: int) -> list:
    """The ``top`` kernel pairs (name before, name after) with the most GPU idle time between them, per step:
    [((before, after), (ms per step, gaps per step))]."""
    from collections import defaultdict
    idle = defaultdict(lambda: [0.0, 0])
    for gap, before, after in idle_gaps(events):
        entry = idle[(before, after)]
        entry[0] += gap
        entry[1] += 1
    ranked = sorted(idle.items(), key=lambda item: -item[1][0])[:top]
    return [(pair, (ms / steps, count / steps)) for pair, (ms, count) in ranked]


if __name__ == "__main__":
    main()
