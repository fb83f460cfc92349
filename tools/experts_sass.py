"""The tensor-core experts' (and attention's) SASS on a machine without a GPU: registers, spills and the main loop's
instruction mix.

Compiles a gate_up (or down) kernel of numba_kernels/moe/experts_tc.py for sm_90a with Numba (no device needed),
assembles it with ptxas and disassembles it with nvdisasm, then prints ptxas's register and spill line, the whole
kernel's instruction mix and that of its main loop (the innermost loop holding the most HMMA or HGMMA). The kernels
are bound by their instructions (BENCHMARKS.md, "A leaner chunk loop for the staged experts"), so the loop's count
per HMMA is the figure to lower before spending device time on timing it; for the staged kernels it is also given
without the share fold, which the loop runs only a few times a pass.

    python3 tools/experts_sass.py [--config 5,2,1,4,4] [--down] [--out DIR] [--tools DIR]
    python3 tools/experts_sass.py --attention [--config STAGES,BLOCKS_PER_SM,KEY_GROUPS]

--config: four numbers are a TcConfig (streaming), five to seven a StagedConfig (staged),
wgmma[:TOKENS,STAGES,CHUNKS_PER_STAGE[,SHARED_TOTALS[,OVERLAP]]] a WgmmaConfig (experts_wgmma.py); default
MANY_PAIRS_CONFIG. --attention: the batch-invariant tensor-core attention (attention/invariant_tc.py) instead, its
TcAttentionConfig (default DEFAULT_CONFIG), the prefix length on the device as a captured step has it. Needs ptxas
(the CUDA toolkit) on PATH, and nvdisasm and libnvrtc, which pip can fetch without installing anything:

    pip download --no-deps -d /tmp/wheels nvidia-cuda-nvdisasm nvidia-cuda-nvrtc
    mkdir -p /tmp/cuda-tools && for w in /tmp/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/cuda-tools; done
    python3 tools/experts_sass.py --tools /tmp/cuda-tools
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

INSTRUCTION = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")
MMA = re.compile(r"\bHG?MMA\b")  # mma.sync (HMMA) or wgmma (HGMMA)


def find_tools(root: Path | None) -> tuple[Path | None, Path | None]:
    """(nvdisasm, the directory holding libnvrtc) under ``root`` (extracted wheels) or on PATH."""
    nvdisasm = shutil.which("nvdisasm")
    nvrtc = None
    if root is not None:
        nvdisasm = next((str(p) for p in root.rglob("nvdisasm") if p.is_file()), nvdisasm)
        nvrtc = next((p.parent for p in root.rglob("libnvrtc.so*")), None)
    return (Path(nvdisasm) if nvdisasm else None), nvrtc


def _without_a_device():
    """Make device functions that ask the current device for its compute capability get 9.0 without one."""
    import numba.cuda.api as cuda_api
    import numba.cuda.dispatcher as dispatcher

    class Hopper:
        compute_capability = (9, 0)

    cuda_api.get_current_device = dispatcher.get_current_device = lambda: Hopper()


def compile_attention_ptx(config_text: str | None) -> tuple[str, str]:
    """(PTX, a name) of the tensor-core attention kernel for one TcAttentionConfig, for compute capability 9.0."""
    _without_a_device()
    from numba import types
    from numba.cuda import compile_ptx as numba_compile_ptx

    from kdspec.numba_kernels.attention import invariant_tc
    numbers = tuple(int(n) for n in config_text.split(",")) if config_text else ()
    if len(numbers) > len(invariant_tc.TcAttentionConfig._fields):
        raise ValueError(f"--attention --config takes up to {len(invariant_tc.TcAttentionConfig._fields)} numbers "
                         f"({', '.join(invariant_tc.TcAttentionConfig._fields)}), got {config_text}")
    config = invariant_tc.TcAttentionConfig(*numbers)
    kernel = invariant_tc.invariant_tc_kernel(config, True)
    f32 = types.Array(types.float32, 1, "C")
    i32 = types.Array(types.int32, 1, "C")
    signature = (types.Array(types.float32, 3, "C"), types.Array(types.float32, 3, "A"), f32, i32,
                 types.Array(types.int32, 2, "C"), i32, types.float32, types.boolean, f32, f32, f32)
    ptx, _ = numba_compile_ptx(kernel.py_func, signature, cc=(9, 0))
    return ptx, "attention_tc_" + "_".join(map(str, config))


def config_from_text(text: str | None):
    """A launch shape of the experts from its numbers: 4 a TcConfig, 5-7 a StagedConfig, "wgmma[:N,...]" a
    WgmmaConfig (tokens, stages, chunks_per_stage, then shared_totals and overlap as 0 / 1); None MANY_PAIRS_CONFIG."""
    from kdspec.numba_kernels.moe import experts_tc as tc
    if not text:
        return tc.MANY_PAIRS_CONFIG
    if text.startswith("wgmma"):
        rest = text[len("wgmma"):].lstrip(":")
        numbers = [int(n) for n in rest.split(",") if n]
        return tc.WgmmaConfig(*numbers[:3], *(bool(n) for n in numbers[3:]))
    numbers = tuple(int(n) for n in text.split(","))
    if len(numbers) == 4:
        return tc.TcConfig(*numbers)
    if len(numbers) in (5, 6, 7):
        return tc.StagedConfig(*numbers)
    raise ValueError(f"--config takes 4 numbers (TcConfig), 5-7 (StagedConfig) or wgmma[:N,..], got {text}")


def compile_ptx(config_text: str | None, down: bool) -> tuple[str, str]:
    """(PTX, a name) of the kernel, compiled for compute capability 9.0 without a device."""
    _without_a_device()
    from numba import types
    from numba.cuda import compile_ptx as numba_compile_ptx

    from kdspec.numba_kernels.moe import experts_tc as tc
    config = config_from_text(config_text)
    kernel = config.kernels()[1 if down else 0]
    tokens = types.Array(types.uint64, 3, "C")
    weights = types.Array(types.uint64, 1, "C")  # fragment_layout as uint64 1-D
    index = types.Array(types.int32, 1, "C")
    out = types.Array(types.float32 if down else types.uint16, 2, "C")
    signature = (tokens, weights) + (types.int64,) * 4 + (index,) * 4 + (out,)
    ptx, _ = numba_compile_ptx(kernel.py_func, signature, cc=(9, 0, "a"))  # sm_90a: wgmma
    name = f"{'down' if down else 'gate_up'}_{type(config).__name__}_{'_'.join(map(str, config.__dict__.values()))}"
    return ptx, name


def main_loop(sass: list[str]) -> list[str]:
    """The lines of the innermost loop (a label and a later branch back to it) with the most HMMA."""
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := LABEL.match(line.strip()))}
    best: tuple[int, int, int, int] | None = None  # (HMMA, -span, start, end)
    for end, line in enumerate(sass):
        m = BRANCH.search(line)
        if m and labels.get(m.group(1), end + 1) < end:
            start = labels[m.group(1)]
            hmma = sum(bool(MMA.search(row)) for row in sass[start:end + 1])
            candidate = (hmma, start - end, start, end)
            if best is None or candidate > best:
                best = candidate
    return sass[best[2]:best[3] + 1] if best else []


def without_fold(loop: list[str]) -> list[str]:
    """The loop without its share fold: the largest block a forward branch skips that holds FADD and no HMMA (the
    staged kernels add a share's sums into the total there, a few times a pass; most chunks skip it)."""
    labels = {m.group(1): i for i, line in enumerate(loop) if (m := LABEL.match(line.strip()))}
    best = None  # (size, start, end)
    for at, line in enumerate(loop):
        m = BRANCH.search(line)
        if m and labels.get(m.group(1), -1) > at:
            block = loop[at + 1:labels[m.group(1)]]
            if any("FADD" in row for row in block) and not any(MMA.search(row) for row in block):
                best = max(best or (0, 0, 0), (len(block), at + 1, labels[m.group(1)]))
    return loop[:best[1]] + loop[best[2]:] if best else loop


def mix(lines: list[str]) -> collections.Counter:
    return collections.Counter(m.group(1).split(".")[0] for line in lines if (m := INSTRUCTION.search(line)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None,
                        help="TcConfig (4 numbers), StagedConfig (5-7), comma-separated, or wgmma[:TOKENS,STAGES,"
                             "CHUNKS_PER_STAGE[,SHARED_TOTALS 0/1[,OVERLAP 0/1]]] (WgmmaConfig)")
    parser.add_argument("--down", action="store_true", help="the down kernel (default: gate_up)")
    parser.add_argument("--attention", action="store_true",
                        help="the tensor-core attention kernel (--config: stages, blocks_per_sm)")
    parser.add_argument("--out", type=Path, default=None, help="write the PTX and SASS here")
    parser.add_argument("--tools", type=Path, default=None, help="extracted nvdisasm / nvrtc wheels (see above)")
    args = parser.parse_args()
    nvdisasm, nvrtc = find_tools(args.tools)
    ptxas = shutil.which("ptxas")
    if ptxas is None or nvdisasm is None:
        print("experts_sass: needs ptxas on PATH and nvdisasm (on PATH or under --tools)", file=sys.stderr)
        return 2
    if nvrtc is not None and str(nvrtc) not in os.environ.get("LD_LIBRARY_PATH", ""):
        # numba finds libnvrtc when the process starts: run again with it on the library path
        env = dict(os.environ, LD_LIBRARY_PATH=f"{nvrtc}:{os.environ.get('LD_LIBRARY_PATH', '')}")
        return subprocess.run([sys.executable, *sys.argv], env=env).returncode
    try:
        ptx, name = compile_attention_ptx(args.config) if args.attention else compile_ptx(args.config, args.down)
    except ValueError as error:
        print(f"experts_sass: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.out or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        ptx_path, cubin = directory / f"{name}.ptx", directory / f"{name}.cubin"
        ptx_path.write_text(ptx)
        assembled = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", str(ptx_path), "-o", str(cubin)],
                                   capture_output=True, text=True)
        if assembled.returncode:
            print(f"experts_sass: ptxas failed: {assembled.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
        if args.out:
            (directory / f"{name}.sass").write_text(sass)
    print(name)
    print("\n".join(line.split(":", 1)[-1].strip() for line in assembled.stderr.splitlines()
                    if "registers" in line or "spill" in line or "wgmma" in line.lower()))
    lines = sass.splitlines()
    whole, loop = mix(lines), mix(main_loop(lines))
    print(f"kernel: {sum(whole.values())} instructions, {whole['HMMA']} HMMA, {whole['HGMMA']} HGMMA")
    print(f"main loop: {sum(loop.values())} instructions, {loop['HMMA']} HMMA, {loop['HGMMA']} HGMMA, "
          f"{sum(loop.values()) / max(1, loop['HMMA'] + loop['HGMMA']):.1f} per (H)MMA (branches not taken included)")
    print("  " + ", ".join(f"{op} {count}" for op, count in loop.most_common(16)))
    path = mix(without_fold(main_loop(lines)))
    if path != loop and not args.attention:  # (the share fold is the staged experts')
        print(f"without the share fold: {sum(path.values())} instructions, "
              f"{sum(path.values()) / max(1, path['HMMA'] + path['HGMMA']):.1f} per (H)MMA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
