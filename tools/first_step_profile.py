"""Where a recording's time to its first step goes (issue #21): the phases `kdtree record` runs before its first
step, each timed, and every kernel's compilation and link, timed by wrapping numba-cuda's dispatcher.

    python3 -W ignore tools/first_step_profile.py [--model k2-mini] [--budget 64] [--tokens 64]

Run on the GPU machine (tools/gpu_session.sh profile-k2); prints one line per phase, then the kernels by time.
"""
from __future__ import annotations

import argparse
import collections
import time


class Phases:
    """Prints each phase's end time and length as it ends."""

    def __init__(self):
        self.start = self.last = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        print(f"{now - self.start:7.2f} s  (+{now - self.last:6.2f} s)  {name}", flush=True)
        self.last = now


def time_kernel_builds() -> tuple[collections.Counter, dict]:
    """Seconds per kernel spent compiling ("compile NAME", outermost calls only) and linking ("link NAME"), and
    per compiled kernel what the kernel cache did: "hit", "miss" or "no cache", and why an entry could not be
    read or written."""
    from numba.cuda import codegen, dispatcher

    seconds, depth, outcomes = collections.Counter(), [0], {}
    compile_kernel, link = dispatcher.CUDADispatcher.compile, codegen.CUDACodeLibrary.get_cufunc

    def timed_compile(self, sig):
        started = time.perf_counter()
        depth[0] += 1
        hits, misses = sum(self._cache_hits.values()), sum(self._cache_misses.values())
        try:
            return compile_kernel(self, sig)
        finally:
            depth[0] -= 1
            name = f"compile {self.py_func.__qualname__}"
            if depth[0] == 0:
                seconds[name] += time.perf_counter() - started
            if not hasattr(self._cache, "errors"):
                outcome = "no cache"
            elif sum(self._cache_hits.values()) > hits:
                outcome = "hit"
            else:
                outcome = "miss" if sum(self._cache_misses.values()) > misses else "in memory"
            outcomes.setdefault(name, []).append(" ".join([outcome, *getattr(self._cache, "errors", [])]))

    def timed_link(self):
        started = time.perf_counter()
        try:
            return link(self)
        finally:
            seconds[f"link {self.name}"] += time.perf_counter() - started

    dispatcher.CUDADispatcher.compile, codegen.CUDACodeLibrary.get_cufunc = timed_compile, timed_link
    return seconds, outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="k2-mini")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    phases = Phases()
    from kdspec.engine.decode import api
    from kdspec.engine.decode.config import DecodeConfig
    from kdspec.engine.device.model import DeviceModel
    from kdspec.engine.model.checkpoint import load_model
    kernel_seconds, cache_outcomes = time_kernel_builds()
    phases.done("imports")
    cfg, weights = load_model(args.model, 0)
    phases.done("weights")
    device_model = DeviceModel(cfg, weights, "cuda")
    phases.done("device model (upload)")
    engine = api.Engine(cfg, weights, "cuda", device_model, 0, args.model, "float32")
    config = DecodeConfig(args.tokens, mode="ddtree", drafter="noisy:0.7", budget=args.budget)
    prompt = engine.encode_prompt(list(range(1, 9)))
    golden = engine.golden_for(prompt, config, device=engine.plan_golden("gpu").device)
    drafter = engine.make_drafter(prompt, config, golden)
    phases.done("golden on the GPU, drafter")
    step_ends = []
    decode_start = time.perf_counter()
    result = engine.generate(prompt, config, drafter=drafter, golden=golden,
                             on_step=lambda record: step_ends.append(time.perf_counter()))
    prefill_end = decode_start + result.prefill_time
    print(f"{prefill_end - phases.start:7.2f} s  (+{result.prefill_time:6.2f} s)  prefill")
    print(f"{step_ends[0] - phases.start:7.2f} s  (+{step_ends[0] - prefill_end:6.2f} s)  first step "
          f"({result.steps} steps, golden match {result.golden_match})")
    print(f"kernels: {sum(v for k, v in kernel_seconds.items() if k.startswith('compile')):.1f} s compiling, "
          f"{sum(v for k, v in kernel_seconds.items() if k.startswith('link')):.1f} s linking")
    for name, seconds in kernel_seconds.most_common(30):
        outcomes = collections.Counter(cache_outcomes.get(name, []))
        print(f"  {seconds:6.2f} s  {name}  [{', '.join(f'{n} x {o}' for o, n in outcomes.items())}]")


if __name__ == "__main__":
    main()
